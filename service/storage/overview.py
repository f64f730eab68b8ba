"""Queries behind the runs overview: a few set-wise reads for a page of runs, and one per sparkline series.

Functions of a Session, like the other table families'; callers own the transaction. Must not import fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from service.storage.labels import BATCH, TRAINER
from service.storage.tables import Alert, Batch, LatestMetric, MetricPoint, Run, as_utc


@dataclass
class RunFigures:
    """What the overview shows of one run, read from storage."""

    batches: dict[str, int] = field(default_factory=dict)
    last_batch_at: datetime | None = None
    last_step: int | None = None
    samplers: list[str] = field(default_factory=list)  # samplers with stored figures, "all" and "trainer" excluded
    latest: dict[str, dict[str, tuple[float, int]]] = field(default_factory=dict)  # sampler -> name -> (value, step)
    alerts: dict[str, int] = field(default_factory=dict)  # pending / firing -> count


def run_figures(session: Session, run_ids: Sequence[int], names: Sequence[str]) -> dict[int, RunFigures]:
    """Batch counts, last batch time, last step, samplers, latest ``names`` and active alerts per run."""
    out = {run_id: RunFigures() for run_id in run_ids}
    if not run_ids:
        return out
    for run_id, status, n, newest in session.execute(
        select(Batch.run_id, Batch.status, func.count(), func.max(Batch.created_at))
        .where(Batch.run_id.in_(run_ids))
        .group_by(Batch.run_id, Batch.status)
    ):
        figures = out[run_id]
        figures.batches[status] = int(n)
        arrived = as_utc(newest)
        if arrived is not None and (figures.last_batch_at is None or arrived > figures.last_batch_at):
            figures.last_batch_at = arrived
    current = LatestMetric.segment == Run.segment  # a resumed run shows its newest segment only
    for run_id, sampler, last in session.execute(
        select(LatestMetric.run_id, LatestMetric.sampler, func.max(LatestMetric.step))
        .join(Run, Run.id == LatestMetric.run_id)
        .where(LatestMetric.run_id.in_(run_ids), current)
        .group_by(LatestMetric.run_id, LatestMetric.sampler)
    ):
        figures = out[run_id]
        figures.last_step = max(figures.last_step or 0, int(last))
        if sampler not in (BATCH, TRAINER):  # batch figures and the trainer's own: no sampler to switch to
            figures.samplers.append(sampler)
    for run_id, sampler, name, value, step in session.execute(
        select(LatestMetric.run_id, LatestMetric.sampler, LatestMetric.name, LatestMetric.value, LatestMetric.step)
        .join(Run, Run.id == LatestMetric.run_id)
        .where(LatestMetric.run_id.in_(run_ids), LatestMetric.name.in_(names), current)
    ):
        out[run_id].latest.setdefault(sampler, {})[name] = (float(value), int(step))
    for run_id, state, n in session.execute(
        select(Alert.run_id, Alert.state, func.count())
        .where(Alert.run_id.in_(run_ids), Alert.state.in_(("pending", "firing")))
        .group_by(Alert.run_id, Alert.state)
    ):
        out[run_id].alerts[state] = int(n)
    return out


def recent_points(
    session: Session, series: Sequence[tuple[int, int, str]], names: Sequence[str], n_points: int
) -> dict[tuple[int, str, str], list[tuple[int, float]]]:
    """The newest ``n_points`` (step, value) of each (run, segment, sampler) x name; keyed (run, sampler, name).

    One small query per series, each walking the (run, sampler, name, step) index backwards, so the
    cost grows with the points returned, not with the runs' history (one window-function query
    would read every stored point of every run; one UNION of them all spends longer being parsed).
    Callers bound ``series`` by a page of runs. Run through the session (a cached compiled statement),
    not the driver's cursor, so that statement counts see them.
    """
    out: dict[tuple[int, str, str], list[tuple[int, float]]] = {}
    if n_points <= 0:
        return out
    query = (
        select(MetricPoint.step, MetricPoint.value)
        .where(
            MetricPoint.run_id == bindparam("run_id"),
            MetricPoint.sampler == bindparam("sampler"),
            MetricPoint.name == bindparam("name"),
            MetricPoint.segment == bindparam("segment"),
        )
        .order_by(MetricPoint.step.desc())
        .limit(n_points)
    )
    for run_id, segment, sampler in series:
        for name in names:
            values = {"run_id": run_id, "sampler": sampler, "name": name, "segment": segment}
            rows = session.execute(query, values).all()
            out[(run_id, sampler, name)] = [(int(step), float(value)) for step, value in reversed(rows)]
    return out
