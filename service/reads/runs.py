"""Runs as the API answers them: the lookup every run read starts from, one run, a page of runs.

Ingest imports ``run_response`` to answer a creation. Must not import fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session

from service.errors import NotFound
from service.reads.pace import BACKLOG, run_pace
from service.schemas.inputs import RunCreate, RunResponse
from service.snapshot import run_budget, run_metadata
from service.storage import queue, runs
from service.storage.tables import Run, iso_time

MAX_PAGE_RUNS = 1000  # the most runs one page of GET /v1/runs or /v1/overview holds


def require_run(session: Session, name: str) -> Run:
    """The run called ``name``, or 404."""
    run = runs.run_by_name(session, name)
    if run is None:
        raise NotFound(f"run {name!r} does not exist; create it with POST /v1/runs", field="run")
    return run


def runs_page(session: Session, limit: int, after: str | None, names: Sequence[str] | None = None) -> Sequence[Run]:
    """Up to ``limit`` runs in creation order after the run called ``after`` (keyset), only ``names`` if given.

    404 when ``after`` names no run (deleted since the previous page): a page that silently restarted
    from the first run would show some runs twice. A page of ``limit`` runs has a next one (maybe empty).
    """
    cursor = runs.run_by_name(session, after) if after is not None else None
    if after is not None and cursor is None:
        raise NotFound(f"after must name a run, got {after!r} (deleted since the previous page?)", field="after")
    return runs.list_runs(session, limit, cursor.id if cursor is not None else None, names)


def run_settings(run: Run) -> RunCreate:
    """A stored run's settings in the form they were created with."""
    return RunCreate.model_validate(
        {
            "name": run.name,
            "project": run.project,
            "metadata": run_metadata(run.details),
            "scorer": run.scorer,
            "scorer_mode": run.scorer_mode,
            "schedule": {"every": run.score_every, "budget_seconds": run_budget(run.details)},
            "sampler": {"samplers": run.samplers, "num_samples": run.num_samples, "seed": run.seed},
            "temperature": run.temperature,
            "filter": run.filter,
            "alerts": run.alert_rules,
            "reasoning_extraction": run.reasoning_extraction,
        }
    )


def run_response(session: Session, run: Run) -> RunResponse:
    (response,) = run_responses(session, [run])
    return response


def run_responses(session: Session, found: Sequence[Run]) -> list[RunResponse]:
    """The runs as ``GET /v1/runs`` answers them: two queries however many runs (~3 a run made a list of
    10,000 runs take 12-28 s), plus the pace read (``run_pace``) of each run with a backlog of
    ``BACKLOG`` batches or more, whose answer says why it lags."""
    ids = [run.id for run in found]
    last = runs.last_steps(session, ids)
    counts = queue.batch_counts_of(session, ids)

    def lag(run: Run) -> str | None:
        waiting = counts.get(run.id, {}).get("queued", 0) + counts.get(run.id, {}).get("scoring", 0)
        return run_pace(session, run.id).warning(run.name) if waiting >= BACKLOG else None  # else never lagging

    return [
        RunResponse(
            **run_settings(run).model_dump(),
            id=run.id,
            created_at=iso_time(run.created_at) or "",
            last_step=last.get(run.id),
            batches=counts.get(run.id, {}),
            scoring_lag=lag(run),
        )
        for run in found
    ]
