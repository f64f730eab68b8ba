"""Removing stored data: a whole run, or the payloads of old batches. Functions of a Session, like ``queries``.

Must not import fastapi.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import LargeBinary, cast, delete, func, select, update
from sqlalchemy.orm import Session

from service.storage.tables import (
    Alert,
    AlertCheckpoint,
    AlertDelivery,
    Batch,
    Checkpoint,
    EmaRecord,
    LatestMetric,
    MetricPoint,
    Run,
    ScoreMatrix,
    utcnow,
)


def delete_run(session: Session, run_id: int) -> dict[str, int]:
    """Deletes a run and every row it owns; returns the rows deleted per table.

    Explicit deletes, children first, rather than the foreign keys' cascades: they do not depend
    on how each database was migrated, and say what went. On Postgres the run row is locked
    first, so a worker cannot claim one of its batches meanwhile (a worker already scoring one
    finds its lease gone when it writes, and discards its results). An ingest of the run racing
    this delete either commits first (its batch is deleted here) or finds the run gone (404).
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Run.id).where(Run.id == run_id).with_for_update())
    alerts = select(Alert.id).where(Alert.run_id == run_id).scalar_subquery()
    statements = {
        "alert_deliveries": delete(AlertDelivery).where(AlertDelivery.alert_id.in_(alerts)),
        "alerts": delete(Alert).where(Alert.run_id == run_id),
        "alert_checkpoints": delete(AlertCheckpoint).where(AlertCheckpoint.run_id == run_id),
        "score_matrices": delete(ScoreMatrix).where(ScoreMatrix.run_id == run_id),
        "metric_points": delete(MetricPoint).where(MetricPoint.run_id == run_id),
        "latest_metrics": delete(LatestMetric).where(LatestMetric.run_id == run_id),
        "ema_states": delete(EmaRecord).where(EmaRecord.run_id == run_id),
        "batches": delete(Batch).where(Batch.run_id == run_id),
        "checkpoints": delete(Checkpoint).where(Checkpoint.run_id == run_id),
        "runs": delete(Run).where(Run.id == run_id),
    }
    deleted = {}
    for table, statement in statements.items():
        result = session.execute(statement)
        deleted[table] = int(result.rowcount)  # type: ignore[attr-defined]  # CursorResult of a DELETE
    return deleted


def _bytes_of(session: Session, text: Any) -> Any:
    """The UTF-8 size of a text column (SQLite's length() counts characters; Postgres has octet_length)."""
    if session.get_bind().dialect.name == "postgresql":
        return func.octet_length(text)
    return func.length(cast(text, LargeBinary))


def purge_payloads(session: Session, before: datetime, limit: int) -> tuple[int, int]:
    """Empties the payloads of up to ``limit`` finished batches created before ``before`` and deletes
    their stored matrices; returns (batches, matrices). Queued and scoring batches keep theirs: a
    worker still needs them. The payload's hash stays, so a byte-identical replay is still recognised.
    """
    ids = list(
        session.scalars(
            select(Batch.id)
            .where(Batch.created_at < before, Batch.payload_purged_at.is_(None), Batch.status.in_(("done", "failed")))
            .order_by(Batch.created_at)
            .limit(limit)
        )
    )
    if not ids:
        return 0, 0
    freed = session.execute(
        select(Batch.run_id, func.sum(_bytes_of(session, Batch.payload)))
        .where(Batch.id.in_(ids))
        .group_by(Batch.run_id)
    ).all()
    matrices = session.execute(delete(ScoreMatrix).where(ScoreMatrix.batch_id.in_(ids)))
    session.execute(update(Batch).where(Batch.id.in_(ids)).values(payload="", payload_purged_at=utcnow()))
    for run_id, n_bytes in freed:
        session.execute(update(Run).where(Run.id == run_id).values(payload_bytes=Run.payload_bytes - int(n_bytes or 0)))
    return len(ids), int(matrices.rowcount)  # type: ignore[attr-defined]  # CursorResult of a DELETE
