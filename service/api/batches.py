"""Where a batch stands: queued, scoring, done (with its results) or failed (with the reason)."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import Caller, ReadsNoRunData, State
from service.errors import NotFound
from service.schemas.results import BatchStatus
from service.schemas.rows import from_row
from service.storage.tables import Batch, Run

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.get("/{batch_id}", dependencies=[ReadsNoRunData])
def batch_status(state: State, access: Caller, batch_id: str) -> BatchStatus:
    with state.sessions() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} does not exist", field="batch_id")
        run = session.get_one(Run, batch.run_id)
        access.read([run.name])
        # What the row holds under other names (id, the key, result), and the run's name.
        return from_row(
            BatchStatus,
            batch,
            batch_id=batch.id,
            run=run.name,
            batch_key=batch.idempotency_key,
            results=batch.result,
        )
