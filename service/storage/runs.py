"""Runs: lookup, segments (a resumed run's steps going back), scorer limits, checkpoints.

Plain functions of a Session; callers own the transaction (``with session.begin():``). Must not import
fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import and_, case, func, or_, select, true, update
from sqlalchemy.orm import Session

from service.storage.database import dialect_insert
from service.storage.tables import Batch, Checkpoint, LatestMetric, MetricPoint, Run, ScorerLimits, utcnow


def run_by_name(session: Session, name: str) -> Run | None:
    return session.scalar(select(Run).where(Run.name == name))


def list_runs(
    session: Session, limit: int, after_id: int | None = None, names: Sequence[str] | None = None
) -> Sequence[Run]:
    """Up to ``limit`` runs in creation order, from the one after the run of id ``after_id`` (keyset pages),
    only those called ``names`` when given. One query.

    The key is the id, not the name: a run deleted after its name was looked up (a statement later, on
    Postgres's read-committed snapshots) still orders the page instead of emptying it."""
    query = select(Run).order_by(Run.id).limit(limit)
    if after_id is not None:
        query = query.where(Run.id > after_id)
    if names is not None:
        query = query.where(Run.name.in_(names))
    return session.scalars(query).all()


def last_steps(session: Session, run_ids: Sequence[int]) -> dict[int, int]:
    """run id -> the newest step with stored figures in the run's current segment (a matrix's included);
    runs without figures are absent. One query."""
    rows = session.execute(
        select(LatestMetric.run_id, func.max(LatestMetric.step))
        .join(Run, Run.id == LatestMetric.run_id)
        .where(LatestMetric.run_id.in_(run_ids), LatestMetric.segment == Run.segment)
        .group_by(LatestMetric.run_id)
    ).all()
    return {int(run_id): int(step) for run_id, step in rows}


class Segment(NamedTuple):
    """The segment a batch joins; ``went_back_below``: when the batch started it, the step it went back below."""

    number: int
    went_back_below: int | None = None


def advance_segment(session: Session, run_id: int, step: int, *, matrix_sampler: str | None = None) -> Segment | None:
    """The segment of a batch of ``step`` arriving now (None: the run is gone); ``matrix_sampler`` for a matrix.

    A step below one already taken for scoring starts a new segment (the trainer resumed from an
    earlier checkpoint, or a script was re-run under the same name); a step that merely arrived
    out of order, before a later one was scored, stays in the segment and is scored in step
    order. Each stream of steps is compared with itself only: rollouts with the rollouts taken
    for scoring (``claimed_step``), a matrix (scored at once) with the newest step of its own
    sampler's figures in the segment. So a matrix under a sampler name of its own, whatever its
    step, never starts a segment at the rollouts' next batch; a resume of any stream starts one
    for the whole run. The first statement takes the run's row lock (concurrent ingests of a run
    serialize on it: queued on Postgres, behind the one writer on SQLite), so the step compared
    with is the one the answer names.
    """
    locked = lock_run(session, run_id)
    if locked is None:
        return None
    segment, claimed = locked
    newest = claimed if matrix_sampler is None else newest_matrix_step(session, run_id, matrix_sampler)
    if newest is None or step >= newest:  # None: nothing taken yet (or the sampler's first figures)
        return Segment(segment)
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(segment=segment + 1, claimed_step=None)
        .execution_options(synchronize_session=False)
    )
    return Segment(segment + 1, went_back_below=int(newest))


def lock_run(session: Session, run_id: int) -> tuple[int, int | None] | None:
    """Takes the run's row lock for the rest of the transaction; the run's (segment, claimed_step) under it, or
    None when the run is gone.

    Every write of a run's points from a request takes it first, so concurrent requests of a run serialize
    (queued on Postgres, behind the one writer on SQLite) and each reads what the others committed: a race
    ends in a replay or a 409, never in a duplicate key.
    """
    locked = session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(segment=Run.segment)  # the lock, and the run as it stands under it
        .returning(Run.segment, Run.claimed_step)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    return None if locked is None else (int(locked[0]), locked[1])


def _newest_of(sampler: str) -> Any:
    """The newest step of ``sampler``'s figures in the run's current segment, correlated with ``Run``."""
    return (
        select(func.max(LatestMetric.step))
        .where(LatestMetric.run_id == Run.id, LatestMetric.sampler == sampler, LatestMetric.segment == Run.segment)
        .scalar_subquery()
    )


def newest_matrix_step(session: Session, run_id: int, sampler: str) -> int | None:
    """The newest step of ``sampler``'s figures in the run's current segment (what a matrix is compared with)."""
    return session.scalar(select(_newest_of(sampler)).where(Run.id == run_id))


def newest_step(column: Any, step: int) -> Any:
    """``column`` raised to ``step`` (NULL counts as lower): the newest step a run has claimed or recorded."""
    return case((column.is_(None), step), (column < step, step), else_=column)


def segment_ends(session: Session, run_id: int) -> dict[int, int]:
    """Per superseded segment, the first step a later segment took over (its points from there on are hidden)."""
    starts = {
        int(g): int(first)
        for g, first in session.execute(
            select(Batch.segment, func.min(Batch.step)).where(Batch.run_id == run_id).group_by(Batch.segment)
        ).all()
    }
    ends = {}
    for segment in starts:
        later = [first for other, first in starts.items() if other > segment]
        if later:
            ends[segment] = min(later)
    return ends


def _visible(ends: dict[int, int]) -> Any:
    """The points not superseded by a later segment (every point when the run never resumed)."""
    if not ends:
        return true()
    superseded = [and_(MetricPoint.segment == g, MetricPoint.step < end) for g, end in ends.items()]
    # One != per segment, not NOT IN: an expanding IN is filled in only at execution, which
    # points.driver_cursor (a statement compiled once to a string) bypasses.
    return or_(and_(*(MetricPoint.segment != g for g in ends)), *superseded)


def record_scorer_limits(session: Session, name: str, vocab_size: int, max_positions: int | None) -> None:
    """What the named scorer can score, as the process that loaded it found (ingest checks token ids)."""
    values = {"name": name, "vocab_size": vocab_size, "max_positions": max_positions, "updated_at": utcnow()}
    # An upsert: workers loading the same scorer at once must not collide on the name.
    statement = dialect_insert(session, ScorerLimits).values(values)
    session.execute(statement.on_conflict_do_update(index_elements=["name"], set_=values))


def latest_checkpoint(session: Session, run_id: int) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.id.desc()).limit(1))


def current_segment(session: Session, run_id: int) -> int:
    """The run's segment as stored now (a Run loaded earlier in the transaction may predate advance_segment)."""
    return int(session.scalar(select(Run.segment).where(Run.id == run_id)) or 0)


def visible_points(session: Session, run_id: int) -> Any:
    """The run's points not superseded by a later segment, as a condition on ``MetricPoint``."""
    return _visible(segment_ends(session, run_id))
