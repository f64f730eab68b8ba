"""Alert state in storage: the series the rules read, checkpoints, episodes, deliveries (the outbox).

Plain functions of a Session; callers own the transaction (``with session.begin():``). Must not import
fastapi.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session

from service.storage.clock import db_time
from service.storage.database import dialect_insert
from service.storage.runs import visible_points
from service.storage.tables import Alert, AlertCheckpoint, AlertDelivery, MetricPoint, Run, utcnow


def alert_series(
    session: Session, run_id: int, sampler: str, names: Sequence[str]
) -> dict[str, list[tuple[int, float]]]:
    """[(step, value)] per name for one (run, sampler), ascending steps, superseded segments left out.

    A run's whole history: read when its rules are replayed from the start (``alert_series_after``
    serves the steps after a checkpoint). Two points of one step (two batches sent for it) come in
    the order they were written; the rules take the later one.
    """
    return _series(
        session.execute(
            select(MetricPoint.name, MetricPoint.step, MetricPoint.value)
            .where(MetricPoint.run_id == run_id, MetricPoint.sampler == sampler, MetricPoint.name.in_(set(names)))
            .where(visible_points(session, run_id))
            .order_by(MetricPoint.name, MetricPoint.step, MetricPoint.segment, MetricPoint.id)
        ).all()
    )


def alert_series_after(
    session: Session, run_id: int, sampler: str, names: Sequence[str], segment: int, step: int
) -> dict[str, list[tuple[int, float]]]:
    """``alert_series`` of the points of ``segment`` after ``step``: what a checkpoint at ``step`` lacks.

    No other segment's point can be both visible and after the checkpoint: a later segment would
    have ended the checkpoint, and an earlier one's visible points all lie before the current
    segment's first step. One range of the (run, sampler, name, step) index per name.
    """
    return _series(
        session.execute(
            select(MetricPoint.name, MetricPoint.step, MetricPoint.value)
            .where(
                MetricPoint.run_id == run_id,
                MetricPoint.sampler == sampler,
                MetricPoint.name.in_(set(names)),
                MetricPoint.step > step,
                MetricPoint.segment == segment,
            )
            .order_by(MetricPoint.name, MetricPoint.step, MetricPoint.id)
        ).all()
    )


def _series(rows: Sequence[Any]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for name, step, value in rows:
        series.setdefault(name, []).append((int(step), float(value)))
    return series


def lock_alert_checkpoint(session: Session, run_id: int, sampler: str) -> AlertCheckpoint:
    """The (run, sampler)'s alert checkpoint, locked until the transaction ends; created empty if absent.

    Postgres: ``FOR UPDATE`` waits for a transaction holding it, and a first insert for a concurrent
    one of the same key, so two transactions evaluating one (run, sampler) take turns and the second
    reads the first's checkpoint and points. SQLite: the caller already holds the write lock.
    """
    query = (
        select(AlertCheckpoint)
        .where(AlertCheckpoint.run_id == run_id, AlertCheckpoint.sampler == sampler)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    checkpoint = session.scalar(query)
    if checkpoint is not None:
        return checkpoint
    session.execute(
        dialect_insert(session, AlertCheckpoint)
        .values(run_id=run_id, sampler=sampler, rules_key="", segment=0, step=-1, state=None, updated_at=utcnow())
        .on_conflict_do_nothing(index_elements=["run_id", "sampler"])
    )
    checkpoint = session.scalar(query)
    assert checkpoint is not None  # inserted above or by a transaction that committed meanwhile
    return checkpoint


def alerts_at(session: Session, run_id: int, sampler: str, onsets: Iterable[int]) -> Sequence[Alert]:
    """The alerts of one (run, sampler) that began at any of ``onsets`` (the episodes a step touched)."""
    wanted = set(onsets)
    if not wanted:
        return []
    return session.scalars(
        select(Alert).where(Alert.run_id == run_id, Alert.sampler == sampler, Alert.onset_step.in_(wanted))
    ).all()


def alerts_of(session: Session, run_id: int, sampler: str) -> Sequence[Alert]:
    return session.scalars(select(Alert).where(Alert.run_id == run_id, Alert.sampler == sampler)).all()


def list_alerts(
    session: Session, run_id: int | None = None, state: str | None = None, rule: str | None = None
) -> Sequence[tuple[Alert, str]]:
    """Alerts (and their run's name), oldest first; dropped records only when ``state`` asks for them."""
    query = select(Alert, Run.name).join(Run, Run.id == Alert.run_id)
    if run_id is not None:
        query = query.where(Alert.run_id == run_id)
    query = query.where(Alert.state == state) if state is not None else query.where(Alert.state != "dropped")
    if rule is not None:
        query = query.where(Alert.rule == rule)
    return [(a, n) for a, n in session.execute(query.order_by(Alert.id)).all()]


def deliveries_of(session: Session, alert_ids: Sequence[int]) -> Sequence[AlertDelivery]:
    if not alert_ids:
        return []
    return session.scalars(
        select(AlertDelivery).where(AlertDelivery.alert_id.in_(alert_ids)).order_by(AlertDelivery.id)
    ).all()


def claim_deliveries(session: Session, owner: str, lease_seconds: float, limit: int) -> Sequence[AlertDelivery]:
    """Due deliveries (pending, or leased by a dispatcher that died), leased to ``owner`` for ``lease_seconds``.

    The lease is held in ``next_attempt_at`` (due again once it passes), timed by the database's
    clock. Each delivery is taken by a compare-and-set on its status and due time as read, so
    two dispatchers (SQLite has no SKIP LOCKED) never both send one, and one that was just
    recorded as delivered is not taken back.
    """
    now = db_time()
    due = and_(AlertDelivery.status.in_(("pending", "delivering")), AlertDelivery.next_attempt_at <= now)
    query = (
        select(AlertDelivery.id, AlertDelivery.status, AlertDelivery.next_attempt_at)
        .where(due)
        .order_by(AlertDelivery.next_attempt_at, AlertDelivery.id)
        .limit(limit)
    )
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    claimed = []
    for seen in session.execute(query).all():
        delivery = session.scalar(
            update(AlertDelivery)
            .where(
                AlertDelivery.id == seen.id,
                AlertDelivery.status == seen.status,
                AlertDelivery.next_attempt_at == seen.next_attempt_at,
                due,
            )
            .values(status="delivering", lease_owner=owner, next_attempt_at=db_time(lease_seconds))
            .returning(AlertDelivery)
            .execution_options(synchronize_session=False, populate_existing=True)
        )
        if delivery is not None:
            claimed.append(delivery)
    return claimed


def record_delivery(
    session: Session, delivery_id: int, owner: str, *, status: str, error: str | None, retry_seconds: float | None
) -> bool:
    """Records one try of a delivery leased to ``owner``: delivered, failed, or pending again in ``retry_seconds``.

    False when the lease is no longer ``owner``'s (it ran out and another dispatcher took the
    delivery): then nothing is written, and that dispatcher's try counts.
    """
    values: dict[str, Any] = {"status": status, "attempts": AlertDelivery.attempts + 1, "lease_owner": None}
    values["last_error"] = error
    if status == "delivered":
        values["delivered_at"] = db_time()
    if retry_seconds is not None:
        values["next_attempt_at"] = db_time(retry_seconds)
    changed = session.execute(
        update(AlertDelivery)
        .where(
            AlertDelivery.id == delivery_id, AlertDelivery.lease_owner == owner, AlertDelivery.status == "delivering"
        )
        .values(values)
        .execution_options(synchronize_session=False)
    )
    return bool(changed.rowcount)  # type: ignore[attr-defined]  # CursorResult of an UPDATE


def delivery_counts(session: Session) -> list[tuple[str, str, int]]:
    rows = session.execute(
        select(AlertDelivery.receiver, AlertDelivery.status, func.count()).group_by(
            AlertDelivery.receiver, AlertDelivery.status
        )
    ).all()
    return [(r, s, int(n)) for r, s, n in rows]


def active_alerts(session: Session) -> list[tuple[str, str, str, str, str]]:
    """(run, sampler, rule, severity, state) of pending and firing alerts."""
    rows = session.execute(
        select(Run.name, Alert.sampler, Alert.rule, Alert.severity, Alert.state)
        .join(Run, Run.id == Alert.run_id)
        .where(Alert.state.in_(("pending", "firing")))
    ).all()
    return [(a, b, c, d, e) for a, b, c, d, e in rows]
