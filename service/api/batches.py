"""Where a batch stands: queued, scoring, done (with its results) or failed (with the reason)."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import Caller, ReadsNoRunData, State
from service.errors import NotFound
from service.schemas import BatchResult, BatchStatus
from service.storage.tables import Batch, Run, iso_time

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.get("/{batch_id}", dependencies=[ReadsNoRunData])
def batch_status(state: State, access: Caller, batch_id: str) -> BatchStatus:
    with state.sessions() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} does not exist", field="batch_id")
        run = session.get_one(Run, batch.run_id)
        access.read([run.name])
        return BatchStatus(
            batch_id=batch.id,
            run=run.name,
            step=batch.step,
            idempotency_key=batch.idempotency_key,
            batch_key=batch.idempotency_key,
            kind=batch.kind,
            status=batch.status,
            error=batch.error,
            attempts=batch.attempts,
            created_at=iso_time(batch.created_at),
            payload_purged_at=iso_time(batch.payload_purged_at),
            started_at=iso_time(batch.started_at),
            finished_at=iso_time(batch.finished_at),
            scoring_seconds=batch.scoring_seconds,
            tokens_scored=batch.tokens_scored,
            scorer=batch.scorer,
            checkpoint=batch.checkpoint,
            results=BatchResult.model_validate(batch.result) if batch.result is not None else None,
        )
