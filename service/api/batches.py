"""Where a batch stands: queued, scoring, done (with its results) or failed (with the reason)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.deps import State
from service.errors import NotFound
from service.storage import queries
from service.storage.tables import Batch, Run

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.get("/{batch_id}")
def batch_status(state: State, batch_id: str) -> dict[str, Any]:
    with state.sessions() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} does not exist", field="batch_id")
        run = session.get_one(Run, batch.run_id)
        return {
            "batch_id": batch.id,
            "run": run.name,
            "step": batch.step,
            "batch_key": batch.client_batch_id,
            "kind": batch.kind,
            "status": batch.status,
            "error": batch.error,
            "attempts": batch.attempts,
            "created_at": _iso(batch.created_at),
            "started_at": _iso(batch.started_at),
            "finished_at": _iso(batch.finished_at),
            "scoring_seconds": batch.scoring_seconds,
            "tokens_scored": batch.tokens_scored,
            "scorer": batch.scorer,
            "checkpoint": batch.checkpoint,
            "results": batch.result,
        }


def _iso(moment: Any) -> str | None:
    value = queries.as_utc(moment)
    return value.isoformat() if value else None
