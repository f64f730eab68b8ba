"""Metric points: a step's points and latest values, EMA states, series reads (chunked, driver-level cursors).

Plain functions of a Session; callers own the transaction (``with session.begin():``). Must not import
fastapi.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, bindparam, func, insert, or_, select
from sqlalchemy.orm import Session
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from scoring.estimators import EmaState
from service.storage.database import dialect_insert
from service.storage.runs import visible_points
from service.storage.tables import EmaRecord, LatestMetric, MetricPoint, Run, utcnow


@dataclass(frozen=True)
class Point:
    sampler: str
    name: str
    value: float


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
    # One upsert, not a read then an insert: two workers storing steps of one run at once would both find no row
    # and collide on the key (the batch then failed: seen under load). A row moves only to a newer (segment, step).
    rows = {(p.sampler, p.name): p.value for p in points}
    statement = dialect_insert(session, LatestMetric).values(
        [
            {"run_id": run_id, "sampler": sampler, "name": name, "step": step, "segment": segment, "value": value,
             "updated_at": now}
            for (sampler, name), value in rows.items()
        ]
    )  # fmt: skip
    new = statement.excluded
    newer = or_(
        new.segment > LatestMetric.segment, and_(new.segment == LatestMetric.segment, new.step >= LatestMetric.step)
    )
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["run_id", "sampler", "name"],
            set_={"step": new.step, "segment": new.segment, "value": new.value, "updated_at": new.updated_at},
            where=newer,
        )
    )
    return len(points)


def batch_values(session: Session, batch_id: str, sampler: str) -> dict[str, float]:
    """name -> value of the points a batch holds under ``sampler``."""
    rows = session.execute(
        select(MetricPoint.name, MetricPoint.value).where(
            MetricPoint.batch_id == batch_id, MetricPoint.sampler == sampler
        )
    )
    return {name: float(value) for name, value in rows}


def ema_state(session: Session, run_id: int, sampler: str) -> EmaRecord | None:
    return session.get(EmaRecord, (run_id, sampler))


def save_ema(session: Session, run_id: int, sampler: str, step: int, ema: EmaState) -> None:
    record = session.get(EmaRecord, (run_id, sampler))
    if record is None:
        record = EmaRecord(run_id=run_id, sampler=sampler)
        session.add(record)
    record.step, record.marginal_std, record.marginal_std_seq = step, ema.marginal_std, ema.marginal_std_seq


SeriesRow = tuple[int, int, str, str, float, str | None, str | None, datetime]  # step, segment, sampler, name,


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
        query = query.where(visible_points(session, wanted.run_id))
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
        *([] if wanted.all_segments else [visible_points(session, run_id)]),
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
    # An expanding IN is written only at execution: its placeholder would reach the driver as SQL.
    assert not compiled.post_compile_params, "driver_cursor cannot run an expanding IN; write it as plain binds"
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
