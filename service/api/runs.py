"""Runs and what trainers send to them: batches of rollouts, matrices, checkpoints; metric series."""

from __future__ import annotations

import csv
import io
import logging
import tempfile
from collections.abc import Iterator
from typing import IO, Annotated
from urllib.parse import urlencode

import orjson
from fastapi import APIRouter, Body, Query, Response, status
from fastapi.responses import StreamingResponse

from service.api.deps import AccessFirst, Caller, RawBody, ReadsAll, ReadsRun, State, WritesRun, WritesSomeRun
from service.api.state import SERIES_READERS, AppState
from service.errors import NotFound, ReadsBusy
from service.ingest import batches, figures, matrices, runs
from service.schemas.inputs import (
    INT32_MAX,
    BatchAccepted,
    BatchIn,
    CheckpointIn,
    CheckpointResponse,
    FiguresAccepted,
    FiguresIn,
    MatrixBatchIn,
    RunCreate,
    RunResponse,
)
from service.schemas.reads import MetricPointOut, MetricSeries
from service.schemas.results import MatrixAccepted
from service.storage import points
from service.storage import runs as stored_runs
from service.storage.points import SeriesQuery
from service.storage.tables import iso_time

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
def create_run(state: State, access: Caller, body: RunCreate, response: Response) -> RunResponse:
    """Creates a run, or returns it when one with this name and the same settings exists."""
    token = access.write(body.name, field="name")
    run, created = runs.create_run(state.sessions, state.settings, body, token)
    if not created:
        response.status_code = status.HTTP_200_OK
    return run


@router.get("", dependencies=[ReadsAll])
def list_runs(
    state: State,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=1000, description="Runs per page, in creation order.")] = 1000,
    after: Annotated[
        str | None, Query(max_length=200, description="The last run of the previous page (its `Link: rel=next`).")
    ] = None,
) -> list[RunResponse]:
    """The runs, a page of ``limit`` at a time; a full page links to the next one (``Link: <...>; rel="next"``)."""
    with state.sessions() as session:
        if after is not None and stored_runs.run_by_name(session, after) is None:
            raise NotFound(f"after must name a run, got {after!r} (deleted since the previous page?)", field="after")
        found = stored_runs.list_runs(session, limit, after)
        page = runs.run_responses(session, found)
    if len(found) == limit:
        response.headers["Link"] = f'</v1/runs?{urlencode({"limit": limit, "after": found[-1].name})}>; rel="next"'
    return page


@router.get("/{run}", dependencies=[ReadsRun])
def get_run(state: State, run: str) -> RunResponse:
    with state.sessions() as session:
        return runs.run_response(session, runs.require_run(session, run))


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
    accepted = batches.ingest_rollouts(state.sessions, state.settings, run, raw, body)
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
    accepted = matrices.ingest_matrix(state.sessions, state.settings, run, raw, body)
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


# The segment column comes only with segments=all, so the default CSV keeps the columns it always had.
CSV_COLUMNS = [name for name in MetricPointOut.model_fields if name != "segment"]


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

    JSON and CSV are encoded as the points are read, a chunk at a time, into a spool (``_spooled``)
    sent once the read is over, so no database session waits on a slow client. At most
    ``SERIES_READERS`` such reads run at once; the others wait their turn, up to 10 s, then 503.
    """
    wanted = [n for n in (names or "").split(",") if n]
    samplers = [s for s in (sampler or "").split(",") if s]
    if format == "columns":
        with state.sessions() as session:
            target = runs.require_run(session, run)
            found, truncated = points.metric_columns(
                session, SeriesQuery(target.id, wanted, samplers, from_step, to_step, limit, segments == "all")
            )
        series = [
            {"sampler": s, "name": n, "steps": steps, "values": values}
            for (s, n), (steps, values) in sorted(found.items())
        ]
        # orjson: a long run's history is ~10^5 floats, which the json module writes 20x slower.
        body = {"run": run, "series": series, "truncated": truncated}
        return Response(orjson.dumps(body), media_type="application/json")
    with state.sessions() as session:
        run_id = runs.require_run(session, run).id  # 404 before the body starts
    query = SeriesQuery(run_id, wanted, samplers, from_step, to_step, limit, all_segments=segments == "all")
    if not state.series_reads.acquire(timeout=SERIES_READ_WAIT_SECONDS):
        raise ReadsBusy(f"{SERIES_READERS} series reads are being read from the database already; retry shortly")
    try:
        spooled = _spooled(_csv_body(state, query) if format == "csv" else _json_body(state, run, query))
    finally:
        state.series_reads.release()
    return StreamingResponse(spooled, media_type="text/csv" if format == "csv" else "application/json")


SERIES_READ_WAIT_SECONDS = 10.0  # a read waits this long for its turn (SERIES_READERS), then 503 reads_busy


SPOOL_MEMORY_BYTES = 8 * 2**20  # an answer's part kept in memory; the rest of it waits in a temporary file
SPOOL_READ_BYTES = 256 * 1024


def _spooled(body: Iterator[bytes] | Iterator[str]) -> Iterator[bytes]:
    """``body`` written out whole (its database session closed with it), then sent from a temporary file.

    Called in the handler (the thread pool): the series is read and encoded at the database's pace,
    not the client's. Streamed straight from the cursor, an answer kept its session and pooled
    connection while the client read it: 16 clients that never read held the whole pool, and every
    database request, ``/readyz`` too, answered 503 (issue 29). Memory stays bounded (at most
    ``SPOOL_MEMORY_BYTES`` per answer, the rest on disk).
    """
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115  # closed by the generator below
    try:
        for part in body:
            spool.write(part.encode() if isinstance(part, str) else part)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return _sent_from(spool)


def _sent_from(spool: IO[bytes]) -> Iterator[bytes]:
    with spool:
        while part := spool.read(SPOOL_READ_BYTES):
            yield part


def _json_body(state: AppState, run: str, query: SeriesQuery) -> Iterator[bytes]:
    """``MetricSeries`` as JSON (its fields in order), written a chunk of points at a time."""
    yield b'{"run":' + orjson.dumps(run) + b',"points":['
    separator = b""
    with state.sessions() as session:
        for chunk in points.metric_series(session, query):
            rows = [
                {
                    "step": step,
                    "segment": segment,
                    "sampler": sampler,
                    "name": name,
                    "value": value,
                    "scorer": scorer,
                    "checkpoint": checkpoint,
                    "time": iso_time(created) or "",
                }
                for step, segment, sampler, name, value, scorer, checkpoint, created in chunk
            ]
            yield separator + orjson.dumps(rows)[1:-1]
            separator = b","
    yield b"]}"


def _csv_body(state: AppState, query: SeriesQuery) -> Iterator[str]:
    """The points as CSV (``CSV_COLUMNS``, then ``segment`` with segments=all), a chunk at a time."""
    all_segments = query.all_segments
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([*CSV_COLUMNS, "segment"] if all_segments else CSV_COLUMNS)
    with state.sessions() as session:
        for chunk in points.metric_series(session, query):
            for step, segment, sampler, name, value, scorer, checkpoint, created in chunk:
                row = [step, sampler, name, value, scorer, checkpoint, iso_time(created) or ""]
                writer.writerow([*row, segment] if all_segments else row)
            yield out.getvalue()
            out.seek(0)
            out.truncate()
    yield out.getvalue()
