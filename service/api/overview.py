"""The runs overview: every run's status light, latest figures and sparklines in one request."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import Caller, State
from service.schemas.inputs import RunMetadata
from service.schemas.reads import LatestValue, OverviewResponse, RunOverview, Sparkline
from service.snapshot import run_metadata
from service.storage import overview
from service.storage.tables import Run, iso_time

router = APIRouter(tags=["runs"])
SPARKLINE = ("mi_estimate", "retrieval_accuracy", "retrieval_chance_level")
LATEST = (*SPARKLINE, "retrieval_above_chance")


@router.get("/v1/overview")
def runs_overview(
    state: State,
    access: Caller,
    points: Annotated[int, Query(ge=0, le=1000, description="Sparkline length in scored steps.")] = 60,
    runs: Annotated[str | None, Query(description="Comma-separated run names; all runs when absent.")] = None,
) -> OverviewResponse:
    """What the runs page shows of each run, oldest run first."""
    names = [n for n in runs.split(",") if n] if runs is not None else None
    access.read(names)
    with state.sessions() as session:
        found = overview.runs_named(session, names)
        figures = overview.run_figures(session, [r.id for r in found], LATEST)
        main = {r.id: _main_sampler(r, figures[r.id]) for r in found}
        recent = overview.recent_points(
            session, [(run_id, s) for run_id, s in main.items() if s is not None], SPARKLINE, points
        )
    return OverviewResponse(runs=[_overview(r, figures[r.id], main[r.id], recent, points) for r in found])


def _main_sampler(run: Run, figures: overview.RunFigures) -> str | None:
    ordered = [s for s in run.samplers if s in figures.samplers]
    figures.samplers = ordered + sorted(s for s in figures.samplers if s not in ordered)
    scored = [s for s in figures.samplers if "mi_estimate" in figures.latest.get(s, {})]
    return scored[0] if scored else (figures.samplers[0] if figures.samplers else None)


def _overview(
    run: Run,
    figures: overview.RunFigures,
    sampler: str | None,
    recent: dict[tuple[int, str, str], list[tuple[int, float]]],
    points: int,
) -> RunOverview:
    latest = figures.latest.get(sampler, {}) if sampler else {}
    if figures.alerts.get("firing"):
        status = "firing"
    elif figures.alerts.get("pending"):
        status = "pending"
    else:
        status = "healthy" if "mi_estimate" in latest else "waiting"
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
        status=status,
        alerts={"pending": figures.alerts.get("pending", 0), "firing": figures.alerts.get("firing", 0)},
        last_step=figures.last_step,
        last_batch_at=iso_time(figures.last_batch_at),
        batches=figures.batches,
        samplers=figures.samplers,
        sampler=sampler,
        latest={name: LatestValue(value=v, step=s) for name, (v, s) in latest.items()},
        sparkline=sparkline,
    )
