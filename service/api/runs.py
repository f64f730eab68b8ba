"""Runs and what trainers send to them: batches of rollouts, matrices, checkpoints; metric series."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Body, Query, Response, status
from fastapi.responses import StreamingResponse

from service.api.deps import (
    AccessFirst,
    Caller,
    RawBody,
    ReadsAll,
    ReadsRun,
    State,
    WritesRun,
    WritesSomeRun,
    next_page,
)
from service.api.state import AppState
from service.ingest import batches, figures, matrices, runs
from service.reads import series
from service.reads.runs import MAX_PAGE_RUNS, require_run, run_response, run_responses, runs_page
from service.schemas.inputs import (
    INT32_MAX,
    BatchAccepted,
    BatchIn,
    BatchLimits,
    CheckpointIn,
    CheckpointResponse,
    FiguresAccepted,
    FiguresIn,
    MatrixBatchIn,
    RunCreate,
    RunCreated,
    RunResponse,
)
from service.schemas.reads import MetricSeries
from service.schemas.results import MatrixAccepted
from service.storage.points import SeriesQuery

# AccessFirst: the body routes check access on the headers, then parse the body off the event loop.
router = APIRouter(prefix="/v1/runs", tags=["runs"], route_class=AccessFirst)
log = logging.getLogger("collapse_monitor.api")

BATCH_EXAMPLE = {
    "step": 12,
    "idempotency_key": "ppo-sokoban-step-12",
    "trajectories": [
        {
            "group_id": 0,
            "reward": 1.0,
            "turns": [
                {
                    "prompt": "<|im_start|>user\nYou are in a grid world. The box is left of the target.<|im_end|>\n"
                    "<|im_start|>assistant\n",
                    "response": "<think>Push the box right once.</think><answer>Right</answer>",
                }
            ],
        },
        {
            "group_id": 1,
            "reward": 0.0,
            "turns": [{"prompt_token_ids": [1, 2, 3, 4], "reasoning_token_ids": [5, 6, 7]}],
        },
    ],
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={200: {"description": "The run already existed"}},
    dependencies=[WritesSomeRun],
)
def create_run(state: State, access: Caller, body: RunCreate, response: Response) -> RunCreated:
    """Creates a run, or returns it when one with this name and the same settings exists; either way with the
    service's batch limits, which the trainer's client fits its batches to."""
    token = access.write(body.name, field="name")
    run, created = runs.create_run(state.sessions, state.settings, body, token)
    if not created:
        response.status_code = status.HTTP_200_OK
    limits = BatchLimits(**{name: getattr(state.settings, name) for name in BatchLimits.model_fields})
    return RunCreated(**run.model_dump(), limits=limits)


@router.get("", dependencies=[ReadsAll], responses={404: {"description": "`after` names no run"}})
def list_runs(
    state: State,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_RUNS, description="Runs per page, in creation order.")] = 1000,
    after: Annotated[
        str | None, Query(max_length=200, description="The last run of the previous page (its `Link: rel=next`).")
    ] = None,
) -> list[RunResponse]:
    """The runs, a page of ``limit`` at a time; a full page links to the next one (``Link: <...>; rel="next"``)."""
    with state.sessions() as session:
        page = run_responses(session, runs_page(session, limit, after))
    if len(page) == limit:
        next_page(response, "/v1/runs", {"limit": limit, "after": page[-1].name})
    return page


@router.get("/{run}", dependencies=[ReadsRun])
def get_run(state: State, run: str) -> RunResponse:
    with state.sessions() as session:
        return run_response(session, require_run(session, run))


@router.delete(
    "/{run}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={404: {"description": "Unknown run"}, 403: {"description": "Not an admin token"}},
)
def delete_run(state: State, access: Caller, run: str) -> Response:
    """Deletes a run and everything it owns (batches, series, alerts, matrices, checkpoints); admin only."""
    access.admin("deleting a run")
    runs.delete_run(state.sessions, run)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/{run}/batches",
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        404: {"description": "Unknown run"},
        409: {"description": "an idempotency_key sent again with different content (error code batch_id_conflict)"},
        413: {"description": "Body or batch over the configured limits"},
        503: {"description": "Scoring queue full; retry after the Retry-After header"},
    },
    dependencies=[WritesRun],
)
def ingest_batch(
    state: State,
    run: str,
    raw: RawBody,
    body: Annotated[BatchIn, Body(openapi_examples={"two groups": {"value": BATCH_EXAMPLE}})],
) -> BatchAccepted:
    """Accepts one training step's rollouts; answers before any scoring (follow ``status_url``)."""
    accepted = batches.ingest_rollouts(state.sessions, state.settings, state.ingest_limits, run, raw, body)
    _note_resume(state, run, "rollouts", accepted)
    return accepted


@router.post(
    "/{run}/matrices",
    status_code=status.HTTP_201_CREATED,
    responses={
        404: {"description": "Unknown run"},
        409: {
            "description": "a step that went back while a later step of its sampler was stored by another upload "
            "(error code step_conflict), or an idempotency_key sent again with different content (batch_id_conflict)"
        },
    },
    dependencies=[WritesRun],
)
def ingest_matrix(state: State, run: str, raw: RawBody, body: MatrixBatchIn) -> MatrixAccepted:
    """Stores a cross-scoring matrix computed by the trainer and returns its metrics (no model involved)."""
    accepted = matrices.ingest_matrix(state.sessions, state.settings, state.ingest_limits, run, raw, body)
    _note_resume(state, run, "matrix", accepted)
    return accepted


def _note_resume(state: AppState, run: str, stream: str, accepted: BatchAccepted) -> None:
    """Counts and logs a batch that started a segment: a step going back is never silent (docs/api.md)."""
    if accepted.resumed:
        state.metrics.segments_started.labels(stream).inc()
        log.warning("run %r, %s: %s", run, stream, accepted.warnings[0])  # the resume's warning comes first


@router.post(
    "/{run}/figures",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"description": "Every figure was stored already with the same value (a replay)"},
        404: {"description": "Unknown run, or no batch of the step"},
        409: {"description": "A figure of the step stored already with another value (error code figure_conflict)"},
    },
    dependencies=[WritesRun],
)
def ingest_figures(state: State, run: str, body: FiguresIn, response: Response) -> FiguresAccepted:
    """Stores figures the trainer computed for a step whose batch it sent already (series of sampler ``trainer``)."""
    accepted = figures.ingest_figures(state.sessions, run, body)
    if accepted.replayed:
        response.status_code = status.HTTP_200_OK
    return accepted


@router.post("/{run}/checkpoints", status_code=status.HTTP_201_CREATED, dependencies=[WritesRun])
def announce_checkpoint(state: State, run: str, body: CheckpointIn) -> CheckpointResponse:
    """Announces a policy checkpoint; later batches of a ``policy``-mode run are scored with it."""
    return runs.announce_checkpoint(state.sessions, state.settings, run, body)


@router.get(
    "/{run}/metrics",
    response_model=MetricSeries,
    responses={200: {"content": {"text/csv": {}}}},
    dependencies=[ReadsRun],
)
def metric_series(
    state: State,
    run: str,
    names: Annotated[
        str | None, Query(max_length=10_000, description="Comma-separated metric names; all when absent.")
    ] = None,
    sampler: Annotated[
        str | None,
        Query(
            max_length=200,
            description="first_turn, trajectory, all, or a matrix sampler; comma-separated for several.",
        ),
    ] = None,
    from_step: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    to_step: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None,
    format: Annotated[
        str,
        Query(
            pattern="^(json|csv|columns)$",
            description="json: one object per point; csv: the same as a table; columns: per (sampler, name) "
            "arrays of steps and values (compact, for plotting), with `truncated` set when more than `limit` "
            "points matched.",
        ),
    ] = "json",
    limit: Annotated[int, Query(ge=1, le=1_000_000)] = 100_000,
    segments: Annotated[
        str,
        Query(
            pattern="^(current|all)$",
            description="current: the points in force (a resumed run's newest segment replaces the older ones "
            "from its first step on); all: the superseded points too.",
        ),
    ] = "current",
) -> Response | MetricSeries:
    """Stored metric points of a run, ordered by step (JSON, or CSV with ``format=csv``).

    JSON and CSV are read whole into a spool before the answer starts (``service.reads.series``), so
    no database session waits on a slow client; at most ``SERIES_READERS`` such reads run at once, the
    others wait their turn, up to 10 s, then 503.
    """
    wanted = [n for n in (names or "").split(",") if n]
    samplers = [s for s in (sampler or "").split(",") if s]
    with state.sessions() as session:
        run_id = require_run(session, run).id  # 404 before the body starts
        query = SeriesQuery(run_id, wanted, samplers, from_step, to_step, limit, all_segments=segments == "all")
        if format == "columns":
            return Response(series.series_columns(session, run, query), media_type="application/json")
    spooled = series.spooled_series(
        state.sessions, state.series_reads, run, query, "csv" if format == "csv" else "json"
    )
    return StreamingResponse(spooled, media_type="text/csv" if format == "csv" else "application/json")
