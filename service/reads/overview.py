"""The runs overview: a page of runs, each with its status light, main sampler, latest figures and sparklines.

Five set-wise queries a page whatever the number of runs (the page, then ``overview.run_figures``), one
more to check ``after``, and one per sparkline series of a shown run (``overview.recent_points``):
at most ``len(SPARKLINE)`` per run of the page. Must not import fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from sqlalchemy.orm import Session

from service.reads.runs import runs_page
from service.schemas.inputs import RunMetadata
from service.schemas.reads import LatestValue, RunOverview, Sparkline
from service.snapshot import run_metadata
from service.storage import overview
from service.storage.tables import Run, iso_time

SPARKLINE = ("mi_estimate", "retrieval_accuracy", "retrieval_chance_level")
LATEST = (*SPARKLINE, "retrieval_above_chance")
Status = Literal["healthy", "pending", "firing", "waiting"]


def overview_page(
    session: Session, names: Sequence[str] | None, limit: int, after: str | None, points: int
) -> list[RunOverview]:
    """Up to ``limit`` runs after ``after`` (``runs_page``), only ``names`` if given, oldest first,
    with sparklines of their newest ``points`` scored steps (none for 0)."""
    found = runs_page(session, limit, after, names)
    figures = overview.run_figures(session, [r.id for r in found], LATEST)
    samplers = {r.id: ordered_samplers(r, figures[r.id]) for r in found}
    main = {r.id: main_sampler(samplers[r.id], figures[r.id]) for r in found}
    series = [(r.id, r.segment, sampler) for r in found if (sampler := main[r.id]) is not None]
    recent = overview.recent_points(session, series, SPARKLINE, points)
    return [_overview(r, figures[r.id], samplers[r.id], main[r.id], recent, points) for r in found]


def ordered_samplers(run: Run, figures: overview.RunFigures) -> list[str]:
    """The samplers with stored figures: the run's own order first, then any others (uploaded matrices) by name."""
    own = [s for s in run.samplers if s in figures.samplers]
    return own + sorted(s for s in figures.samplers if s not in own)


def main_sampler(samplers: list[str], figures: overview.RunFigures) -> str | None:
    """The sampler the overview shows: the first with an MI estimate, else the first with any figure."""
    scored = [s for s in samplers if "mi_estimate" in figures.latest.get(s, {})]
    return scored[0] if scored else (samplers[0] if samplers else None)


def run_status(alerts: dict[str, int], latest: dict[str, tuple[float, int]]) -> Status:
    """The run's light: firing over pending over healthy; waiting before its first MI estimate."""
    if alerts.get("firing"):
        return "firing"
    if alerts.get("pending"):
        return "pending"
    return "healthy" if "mi_estimate" in latest else "waiting"


def _overview(
    run: Run,
    figures: overview.RunFigures,
    samplers: list[str],
    sampler: str | None,
    recent: dict[tuple[int, str, str], list[tuple[int, float]]],
    points: int,
) -> RunOverview:
    latest = figures.latest.get(sampler, {}) if sampler else {}
    sparkline = None
    if sampler is not None and points > 0:
        series = {name: dict(recent.get((run.id, sampler, name), [])) for name in SPARKLINE}
        steps = sorted({step for values in series.values() for step in values})[-points:]
        sparkline = Sparkline(steps=steps, **{name: [series[name].get(s) for s in steps] for name in SPARKLINE})
    return RunOverview(
        name=run.name,
        project=run.project,
        metadata=RunMetadata.model_validate(run_metadata(run.details)),
        scorer=run.scorer,
        scorer_mode=run.scorer_mode,
        score_every=run.score_every,
        created_at=iso_time(run.created_at) or "",
        status=run_status(figures.alerts, latest),
        alerts={"pending": figures.alerts.get("pending", 0), "firing": figures.alerts.get("firing", 0)},
        last_step=figures.last_step,
        last_batch_at=iso_time(figures.last_batch_at),
        batches=figures.batches,
        samplers=samplers,
        sampler=sampler,
        latest={name: LatestValue(value=v, step=s) for name, (v, s) in latest.items()},
        sparkline=sparkline,
    )
