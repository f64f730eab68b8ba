"""Queries: plain functions of a Session. Callers own the transaction (``with session.begin():``).

Must not import fastapi.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Float, and_, bindparam, case, exists, func, insert, literal, or_, select, true, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from scoring.estimators import EmaState
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
    ScorerLimits,
    utcnow,
)

SCORING_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class db_time(FunctionElement[datetime]):
    """The database's clock plus ``seconds``, as a SQL expression: what every lease is timed by.

    Leases are written by one host and compared by another (each worker, each API process): their
    clocks may differ by seconds, which would end a lease early or hold a dead worker's batch late.
    The database's clock is the one every host shares. Postgres: ``now()``, the start of the
    transaction. SQLite: ``strftime('%f')`` (milliseconds), written as SQLAlchemy writes a
    datetime there (UTC, six fraction digits), so the stored texts compare in time order.
    """

    type = DateTime(timezone=True)
    inherit_cache = True

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(literal(float(seconds), Float()))


@compiles(db_time, "postgresql")
def _db_time_postgresql(element: db_time, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return f"(now() + make_interval(secs => CAST({seconds} AS double precision)))"


@compiles(db_time, "sqlite")
def _db_time_sqlite(element: db_time, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return f"(strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', {seconds})) || '000')"


@dataclass(frozen=True)
class Point:
    sampler: str
    name: str
    value: float


# Runs -----------------------------------------------------------------------------------------


def run_by_name(session: Session, name: str) -> Run | None:
    return session.scalar(select(Run).where(Run.name == name))


def list_runs(session: Session) -> Sequence[Run]:
    return session.scalars(select(Run).order_by(Run.id)).all()


def batch_counts(session: Session, run_id: int | None = None) -> dict[str, int]:
    query = select(Batch.status, func.count()).group_by(Batch.status)
    if run_id is not None:
        query = query.where(Batch.run_id == run_id)
    return {status: int(n) for status, n in session.execute(query).all()}


def last_step(session: Session, run_id: int) -> int | None:
    """The newest step with stored figures in the run's current segment (a matrix's included)."""
    return session.scalar(
        select(func.max(LatestMetric.step))
        .join(Run, Run.id == LatestMetric.run_id)
        .where(LatestMetric.run_id == run_id, LatestMetric.segment == Run.segment)
    )


def advance_segment(session: Session, run_id: int, step: int, *, matrix_sampler: str | None = None) -> int | None:
    """The segment of a batch of ``step`` arriving now (None: the run is gone); ``matrix_sampler`` for a matrix.

    A step below one already taken for scoring starts a new segment (the trainer resumed from an
    earlier checkpoint, or a script was re-run under the same name); a step that merely arrived
    out of order, before a later one was scored, stays in the segment and is scored in step
    order. Each stream of steps is compared with itself only: rollouts with the rollouts taken
    for scoring (``claimed_step``), a matrix (scored at once) with the newest step of its own
    sampler's figures in the segment. So a matrix under a sampler name of its own, whatever its
    step, never starts a segment at the rollouts' next batch; a resume of any stream starts one
    for the whole run. One UPDATE, so concurrent ingests of a run serialize on its row.
    """
    if matrix_sampler is None:
        resumes = and_(Run.claimed_step.is_not(None), step < Run.claimed_step)
    else:
        newest = (
            select(func.max(LatestMetric.step))
            .where(
                LatestMetric.run_id == Run.id,
                LatestMetric.sampler == matrix_sampler,
                LatestMetric.segment == Run.segment,
            )
            .scalar_subquery()
        )
        resumes = step < newest  # NULL (not a resume) before the sampler's first figures of the segment
    segment = session.scalar(
        update(Run)
        .where(Run.id == run_id)
        .values(
            segment=case((resumes, Run.segment + 1), else_=Run.segment),
            claimed_step=case((resumes, None), else_=Run.claimed_step),
        )
        .returning(Run.segment)
        .execution_options(synchronize_session=False)
    )
    return int(segment) if segment is not None else None


def _newest(column: Any, step: int) -> Any:
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
    return or_(MetricPoint.segment.not_in(list(ends)), *superseded)


def record_scorer_limits(session: Session, name: str, vocab_size: int, max_positions: int | None) -> None:
    """What the named scorer can score, as the process that loaded it found (ingest checks token ids)."""
    values = {"name": name, "vocab_size": vocab_size, "max_positions": max_positions, "updated_at": utcnow()}
    # An upsert: workers loading the same scorer at once must not collide on the name.
    dialect_insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    statement = dialect_insert(ScorerLimits).values(values)
    session.execute(statement.on_conflict_do_update(index_elements=["name"], set_=values))


def latest_checkpoint(session: Session, run_id: int) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.id.desc()).limit(1))


# Batches --------------------------------------------------------------------------------------


def batch_by_key(session: Session, run_id: int, idempotency_key: str) -> Batch | None:
    return session.scalar(select(Batch).where(Batch.run_id == run_id, Batch.idempotency_key == idempotency_key))


def batch_by_content(session: Session, run_id: int, step: int, payload_sha256: str) -> Batch | None:
    """An earlier batch of this run and step with byte-identical content."""
    return session.scalar(
        select(Batch)
        .where(Batch.run_id == run_id, Batch.step == step, Batch.payload_sha256 == payload_sha256)
        .order_by(Batch.created_at)
        .limit(1)
    )


def queue_depth(session: Session, run_id: int | None = None) -> int:
    """Batches waiting to be scored: all of them, or one run's."""
    query = select(func.count()).select_from(Batch).where(Batch.status == "queued")
    if run_id is not None:
        query = query.where(Batch.run_id == run_id)
    return int(session.scalar(query) or 0)


def token_queue_depth(session: Session, token_id: int) -> int:
    """Batches waiting to be scored in the runs the token ``token_id`` created (at most the whole queue's)."""
    query = (
        select(func.count())
        .select_from(Batch)
        .join(Run, Run.id == Batch.run_id)
        .where(Batch.status == "queued", Run.created_by_token == token_id)
    )
    return int(session.scalar(query) or 0)


def _claimable(now: Any) -> Any:
    # Queued, or claimed by a worker whose lease ran out (it crashed or was killed).
    return or_(Batch.status == "queued", and_(Batch.status == "scoring", Batch.lease_expires_at <= now))


def _is(column: Any, value: Any) -> Any:
    return column.is_(None) if value is None else column == value


# The claiming group of a run: the token that created it; 0 for the runs created without one (ids start at 1).
_token_group = func.coalesce(Run.created_by_token, 0)

# A claim that loses this many races in a row (each one: a batch another worker finished, renewed,
# released or took between the claim's read and its write) returns None; the worker polls again.
MAX_LOST_CLAIMS = 8


def claim_batch(session: Session, owner: str, lease_seconds: float, max_attempts: int) -> Batch | None:
    """Claims the next batch to score: round-robin across tokens, then across their runs, step order within a run.

    Runs are grouped by the ingest token that created them (runs created without one form one
    group). Among the runs with a claimable batch and none being scored, those of the group served
    least recently go first, and among them the run claimed least recently (a group or run never
    served before all others, then the oldest waiting batch): a token that queued 200 batches
    over 10 runs takes turns with a token that posted one batch, and a run with 200 queued
    batches with a run that posted one. Within a run batches are scored one at a time in step
    order, so the EMA of each (run, sampler) advances in order. The choice reads each run row
    once (the groups' last service is one grouped pass over ``runs``), whatever the queue holds.
    On Postgres the run row is locked with SKIP LOCKED, so concurrent workers claim different
    runs without waiting on each other; a batch whose lease expired is claimed again. A batch
    interrupted ``max_attempts`` times is marked failed instead of looping forever.

    The claim is a compare-and-set: its UPDATE changes the batch only if it still is as it was
    read (status, lease owner, lease expiry, attempts) and still claimable by the database's
    clock. A worker whose lease ran out while it was slow may commit its ``done`` between the
    read and the write: the write then changes nothing, and the claim moves on, where writing by
    primary key alone would have put the finished batch back to ``scoring`` (and scored it twice).
    """
    now = db_time()
    # When each token's group of runs was last served: the newest claim of any of its runs.
    served = (
        select(_token_group.label("token"), func.max(Run.last_claimed_at).label("at")).group_by(_token_group).subquery()
    )
    lost = 0
    while lost < MAX_LOST_CLAIMS:
        claimable = _claimable(now)
        busy = exists().where(Batch.run_id == Run.id, Batch.status == "scoring", Batch.lease_expires_at > now)
        oldest = select(func.min(Batch.created_at)).where(Batch.run_id == Run.id, claimable).scalar_subquery()
        runs = (
            select(Run.id)
            .join(served, served.c.token == _token_group)
            .where(exists().where(Batch.run_id == Run.id, claimable), ~busy)
            .order_by(served.c.at.asc().nulls_first(), Run.last_claimed_at.asc().nulls_first(), oldest, Run.id)
            .limit(1)
        )
        if session.get_bind().dialect.name == "postgresql":
            # FOR NO KEY UPDATE: it still keeps other claims (and a delete) off the run, but not the
            # rows that only reference it: a worker finishing one of the run's batches (an expired
            # lease this claim is looking at) writes its points meanwhile instead of deadlocking.
            runs = runs.with_for_update(of=Run, skip_locked=True, key_share=True)
        run_id = session.scalar(runs)
        if run_id is None:
            return None
        seen = session.execute(
            select(Batch.id, Batch.status, Batch.lease_owner, Batch.lease_expires_at, Batch.attempts)
            .where(Batch.run_id == run_id, claimable)
            .order_by(Batch.segment, Batch.step, Batch.created_at)
            .limit(1)
        ).one_or_none()
        if seen is None:  # finished or deleted since the run was chosen
            lost += 1
            continue
        as_read = and_(
            Batch.id == seen.id,
            Batch.status == seen.status,
            _is(Batch.lease_owner, seen.lease_owner),
            _is(Batch.lease_expires_at, seen.lease_expires_at),
            Batch.attempts == seen.attempts,
            claimable,
        )
        # Either way the claim counts an attempt, and writes only if the batch is still as read.
        take = update(Batch).where(as_read).values(attempts=Batch.attempts + 1)
        if seen.attempts + 1 > max_attempts:
            error = f"scoring was interrupted {max_attempts} times (worker crashed or was killed); giving up"
            failed = session.execute(
                take.values(
                    status="failed", finished_at=now, error=error, lease_owner=None, lease_expires_at=None
                ).execution_options(synchronize_session=False)
            )
            if not failed.rowcount:  # type: ignore[attr-defined]  # CursorResult of an UPDATE
                lost += 1  # changed by someone else meanwhile: look again
            continue
        batch = session.scalar(
            take.values(status="scoring", lease_owner=owner, lease_expires_at=db_time(lease_seconds), started_at=now)
            .returning(Batch)
            .execution_options(synchronize_session=False, populate_existing=True)
        )
        if batch is None:  # lost the race: the batch changed between the read and this write
            lost += 1
            continue
        session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(
                last_claimed_at=now,
                claimed_step=case(
                    (Run.segment == batch.segment, _newest(Run.claimed_step, batch.step)), else_=Run.claimed_step
                ),
            )
            .execution_options(synchronize_session=False)
        )
        return batch
    return None


def release_leases(session: Session, owner_prefix: str, *, count_attempt: bool) -> list[str]:
    """Puts the batches whose lease owner starts with ``owner_prefix`` back in the queue at once.

    ``count_attempt``: whether the interrupted scoring counts towards ``max_attempts`` (it does
    when the worker crashed, which the batch itself may have caused; not on a shutdown or when
    the database was away). Returns the ids released. One UPDATE whose condition is the lease
    itself (still scoring, still this owner's), so a batch finished or taken over meanwhile is
    left alone.
    """
    released = list(
        session.scalars(
            update(Batch)
            .where(Batch.status == "scoring", Batch.lease_owner.startswith(owner_prefix, autoescape=True))
            .values(
                status="queued",
                lease_owner=None,
                lease_expires_at=None,
                attempts=Batch.attempts if count_attempt else Batch.attempts - 1,
            )
            .returning(Batch.id)
            .execution_options(synchronize_session=False)
        )
    )
    return released


def renew_lease(session: Session, batch_id: str, owner: str, lease_seconds: float) -> bool:
    """Extends the lease by ``lease_seconds`` from now (the database's clock); False if it is not ``owner``'s."""
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.lease_owner == owner, Batch.status == "scoring")
        .values(lease_expires_at=db_time(lease_seconds))
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]  # CursorResult of an UPDATE


def finish_batch(
    session: Session,
    batch_id: str,
    owner: str | None,
    *,
    status: str,
    error: str | None = None,
    result: dict[str, Any] | None = None,
    scoring_seconds: float | None = None,
    tokens_scored: int | None = None,
    scorer: str | None = None,
    checkpoint: str | None = None,
) -> bool:
    """Marks a batch done or failed, but only if ``owner`` still holds it (None: not leased).

    False means another worker took the batch over; the caller must roll back. The lease is the
    UPDATE's own condition: on Postgres a claim racing this write waits for its row lock and then
    finds the batch no longer claimable; on SQLite writers take turns.
    """
    holder = (
        and_(Batch.lease_owner == owner, Batch.status == "scoring")
        if owner is not None
        else Batch.lease_owner.is_(None)
    )
    changed = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, holder)
        .values(
            status=status,
            error=error,
            result=result,
            scoring_seconds=scoring_seconds,
            tokens_scored=tokens_scored,
            scorer=scorer,
            checkpoint=checkpoint,
            finished_at=db_time(),
            lease_owner=None,
            lease_expires_at=None,
        )
        .execution_options(synchronize_session=False)
    )
    return bool(changed.rowcount)  # type: ignore[attr-defined]  # CursorResult of an UPDATE


def record_points(
    session: Session,
    run_id: int,
    batch_id: str,
    step: int,
    segment: int,
    points: Iterable[Point],
    scorer: str | None,
    checkpoint: str | None,
) -> int:
    """Writes a batch's metric points and moves the latest values to them, unless a newer batch's are there.

    Newer means a later segment, or a later (or the same) step within one: a resumed run's
    latest values follow its newest batch even though its steps went back.
    """
    now = utcnow()
    points = list(points)
    for p in points:
        if not math.isfinite(p.value):  # no database column or JSON answer may hold one
            raise ValueError(f"the {p.sampler} figure {p.name} is not finite ({p.value}); nothing was stored")
    if not points:
        return 0
    session.execute(
        insert(MetricPoint),
        [
            {
                "run_id": run_id,
                "batch_id": batch_id,
                "step": step,
                "segment": segment,
                "sampler": p.sampler,
                "name": p.name,
                "value": p.value,
                "scorer": scorer,
                "checkpoint": checkpoint,
                "created_at": now,
            }
            for p in points
        ],
    )
    existing = {
        (lm.sampler, lm.name): lm
        for lm in session.scalars(
            select(LatestMetric).where(LatestMetric.run_id == run_id, LatestMetric.name.in_({p.name for p in points}))
        )
    }
    for p in points:
        current = existing.get((p.sampler, p.name))
        if current is None:
            session.add(
                LatestMetric(
                    run_id=run_id,
                    sampler=p.sampler,
                    name=p.name,
                    step=step,
                    segment=segment,
                    value=p.value,
                    updated_at=now,
                )
            )
        elif (current.segment, current.step) <= (segment, step):
            current.step, current.segment, current.value, current.updated_at = step, segment, p.value, now
    return len(points)


def ema_state(session: Session, run_id: int, sampler: str) -> EmaRecord | None:
    return session.get(EmaRecord, (run_id, sampler))


def save_ema(session: Session, run_id: int, sampler: str, step: int, ema: EmaState) -> None:
    record = session.get(EmaRecord, (run_id, sampler))
    if record is None:
        record = EmaRecord(run_id=run_id, sampler=sampler)
        session.add(record)
    record.step, record.marginal_std, record.marginal_std_seq = step, ema.marginal_std, ema.marginal_std_seq


SeriesRow = tuple[int, int, str, str, float, str | None, str | None, datetime]  # step, segment, sampler, name,
# value, scorer, checkpoint, created_at


@dataclass(frozen=True)
class SeriesQuery:
    """Which of a run's metric points a read wants: these names and samplers (every one when empty),
    steps from ``from_step`` to ``to_step``, at most ``limit`` points; the ones in force, or with
    ``all_segments`` the superseded ones too."""

    run_id: int
    names: Sequence[str] = ()
    samplers: Sequence[str] = ()
    from_step: int | None = None
    to_step: int | None = None
    limit: int = 100_000
    all_segments: bool = False


def metric_series(session: Session, wanted: SeriesQuery, chunk_rows: int = 10_000) -> Iterator[list[SeriesRow]]:
    """The ``wanted`` points in step order, ``chunk_rows`` at a time.

    Plain rows fetched as the caller consumes them (a server-side cursor on Postgres), so a read
    of up to a million points holds one chunk at a time: as ORM objects it held ~1 KB a point.
    """
    query = select(
        MetricPoint.step,
        MetricPoint.segment,
        MetricPoint.sampler,
        MetricPoint.name,
        MetricPoint.value,
        MetricPoint.scorer,
        MetricPoint.checkpoint,
        MetricPoint.created_at,
    ).where(MetricPoint.run_id == wanted.run_id)
    if not wanted.all_segments:
        query = query.where(_visible(segment_ends(session, wanted.run_id)))
    if wanted.names:
        query = query.where(MetricPoint.name.in_(wanted.names))
    if wanted.samplers:
        query = query.where(MetricPoint.sampler.in_(wanted.samplers))
    if wanted.from_step is not None:
        query = query.where(MetricPoint.step >= wanted.from_step)
    if wanted.to_step is not None:
        query = query.where(MetricPoint.step <= wanted.to_step)
    query = query.order_by(
        MetricPoint.step, MetricPoint.segment, MetricPoint.sampler, MetricPoint.name, MetricPoint.id
    ).limit(wanted.limit)
    for partition in session.execute(query.execution_options(yield_per=chunk_rows)).partitions():
        yield [tuple(row) for row in partition]  # type: ignore[misc]  # the selected columns, in order


def metric_columns(
    session: Session, wanted: SeriesQuery
) -> tuple[dict[tuple[str, str], tuple[list[int], list[float]]], bool]:
    """(sampler, name) -> (steps, values), ascending steps: the points of ``metric_series`` as columns,
    at most ``wanted.limit`` of them (whole series first, in sampler and name order), and whether
    there were more.

    A run's whole history (10,000 steps x 20 series) is read fast: the run's series are listed from
    the latest-value table, then each is one range of the covering (run, sampler, name, step,
    value) index, fetched as the driver's (step, value) tuples. Measured on SQLite, 130,000 points,
    one busy 2-core machine: ORM rows of one query 1.2 s, driver rows of one query 0.6-1.2 s
    (text columns on every row), driver rows of one query per series 0.5 s.
    """
    run_id, from_step, to_step = wanted.run_id, wanted.from_step, wanted.to_step
    pairs = select(LatestMetric.sampler, LatestMetric.name).where(LatestMetric.run_id == run_id)
    if wanted.names:
        pairs = pairs.where(LatestMetric.name.in_(wanted.names))
    if wanted.samplers:
        pairs = pairs.where(LatestMetric.sampler.in_(wanted.samplers))
    query = select(MetricPoint.step, MetricPoint.value).where(
        MetricPoint.run_id == run_id,
        MetricPoint.sampler == bindparam("sampler"),
        MetricPoint.name == bindparam("name"),
        *([MetricPoint.step >= from_step] if from_step is not None else []),
        *([MetricPoint.step <= to_step] if to_step is not None else []),
        # A run that never resumed has no superseded points: then this is TRUE and the index alone serves.
        *([] if wanted.all_segments else [_visible(segment_ends(session, run_id))]),
    )
    query = query.order_by(MetricPoint.step, MetricPoint.segment).limit(bindparam("limit"))
    out: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    left = wanted.limit
    with driver_cursor(session, query) as fetch:
        for sampler, name in session.execute(pairs.order_by(LatestMetric.sampler, LatestMetric.name)).all():
            rows = fetch({"sampler": sampler, "name": name, "limit": left + 1})
            if len(rows) > left:
                if left:
                    steps, values = zip(*rows[:left], strict=True)
                    out[(sampler, name)] = (list(steps), list(values))
                return out, True
            if rows:
                steps, values = zip(*rows, strict=True)
                out[(sampler, name)] = (list(steps), list(values))
                left -= len(rows)
    return out, False


@contextmanager
def driver_cursor(session: Session, query: ClauseElement) -> Iterator[Callable[[dict[str, Any]], list[Any]]]:
    """Runs ``query`` with given bind values on the database driver's own cursor; yields fetch(values).

    For reads of 100,000s of rows: SQLAlchemy's Row objects cost about 3x the driver's tuples
    there. The statement is still built and compiled by SQLAlchemy (once), only the fetch is the
    driver's, so no type conversion happens: use it for plain numbers and strings only.
    """
    compiled = query.compile(dialect=session.get_bind().dialect)
    assert isinstance(compiled, SQLCompiler)  # a SELECT compiles to SQL
    positions = compiled.positiontup  # qmark drivers (sqlite3) take positional parameters

    def bind(values: dict[str, Any]) -> Any:
        merged = {**compiled.params, **values}
        return [merged[name] for name in positions] if positions is not None else merged

    cursor = session.connection().connection.cursor()
    try:

        def fetch(values: dict[str, Any]) -> list[Any]:
            cursor.execute(compiled.string, bind(values))
            return list(cursor.fetchall())

        yield fetch
    finally:
        cursor.close()


# Prometheus collector reads -------------------------------------------------------------------


def latest_values(session: Session) -> Sequence[tuple[str, str, str, float, int]]:
    """(run, sampler, name, value, step) of each run's current segment, the most recently updated runs first."""
    newest = (
        select(LatestMetric.run_id, func.max(LatestMetric.updated_at).label("updated"))
        .group_by(LatestMetric.run_id)
        .subquery()
    )
    rows = session.execute(
        select(Run.name, LatestMetric.sampler, LatestMetric.name, LatestMetric.value, LatestMetric.step)
        .join(Run, Run.id == LatestMetric.run_id)
        .join(newest, newest.c.run_id == LatestMetric.run_id)
        .where(LatestMetric.segment == Run.segment)
        .order_by(newest.c.updated.desc(), Run.name)
    ).all()
    return [(r[0], r[1], r[2], float(r[3]), int(r[4])) for r in rows]


def scoring_stats(session: Session) -> dict[str, Any]:
    """Totals over finished batches: counts per status, scoring-seconds buckets, tokens."""
    buckets = [func.sum(case((Batch.scoring_seconds <= bound, 1), else_=0)) for bound in SCORING_SECONDS_BUCKETS]
    row = session.execute(
        select(
            func.count(Batch.scoring_seconds),
            func.coalesce(func.sum(Batch.scoring_seconds), 0.0),
            func.coalesce(func.sum(Batch.tokens_scored), 0),
            *buckets,
        ).where(Batch.status == "done", Batch.scoring_seconds.is_not(None))
    ).one()
    recent = session.execute(
        select(Batch.tokens_scored, Batch.scoring_seconds)
        .where(Batch.status == "done", Batch.tokens_scored > 0)
        .order_by(Batch.finished_at.desc())
        .limit(20)
    ).all()
    pairs = [(int(t or 0), float(s or 0.0)) for t, s in recent]
    seconds = sum(s for _, s in pairs)
    return {
        "count": int(row[0]),
        "sum_seconds": float(row[1]),
        "tokens": int(row[2]),
        "buckets": [int(v or 0) for v in row[3:]],
        "recent_tokens_per_second": sum(t for t, _ in pairs) / seconds if seconds > 0 else None,
    }


# Alerts ---------------------------------------------------------------------------------------


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
            .where(_visible(segment_ends(session, run_id)))
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


def current_segment(session: Session, run_id: int) -> int:
    """The run's segment as stored now (a Run loaded earlier in the transaction may predate advance_segment)."""
    return int(session.scalar(select(Run.segment).where(Run.id == run_id)) or 0)


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
    dialect_insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    session.execute(
        dialect_insert(AlertCheckpoint)
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
    query = select(Alert, Run.name).join(Run, Run.id == Alert.run_id)
    if run_id is not None:
        query = query.where(Alert.run_id == run_id)
    if state is not None:
        query = query.where(Alert.state == state)
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
