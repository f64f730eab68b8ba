"""Runs and what trainers send to them: batches of rollouts, matrices, checkpoints; metric series."""

from __future__ import annotations

import csv
import io
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Response, status
from fastapi.responses import JSONResponse

from service import pipeline
from service.api.deps import RawBody, State
from service.errors import InvalidRequest, NotFound, RunConflict
from service.schemas import (
    BatchAccepted,
    BatchIn,
    CheckpointIn,
    CheckpointResponse,
    MatrixBatchIn,
    RunCreate,
    RunResponse,
)
from service.scorers import resolve_checkpoint
from service.storage import queries
from service.storage.tables import Checkpoint, Run

router = APIRouter(prefix="/v1/runs", tags=["runs"])

BATCH_EXAMPLE = {
    "step": 12,
    "batch_id": "ppo-sokoban-step-12",
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


def _run_response(session: Any, run: Run) -> RunResponse:
    return RunResponse(
        **_run_config(run).model_dump(),
        id=run.id,
        created_at=run.created_at.isoformat(),
        last_step=queries.last_step(session, run.id),
        batches=queries.batch_counts(session, run.id),
    )


def _run_config(run: Run) -> RunCreate:
    return RunCreate.model_validate(
        {
            "name": run.name,
            "project": run.project,
            "metadata": run.details,
            "scorer": run.scorer,
            "scorer_mode": run.scorer_mode,
            "schedule": {"every": run.score_every},
            "sampler": {"samplers": run.samplers, "num_samples": run.num_samples, "seed": run.seed},
            "temperature": run.temperature,
            "filter": run.filter,
            "alerts": run.alert_rules,
        }
    )


def _get_run(session: Any, name: str) -> Run:
    run = queries.run_by_name(session, name)
    if run is None:
        raise NotFound(f"run {name!r} does not exist; create it with POST /v1/runs", field="run")
    return run


@router.post("", status_code=status.HTTP_201_CREATED, responses={200: {"description": "The run already existed"}})
def create_run(state: State, body: RunCreate, response: Response) -> RunResponse:
    """Creates a run, or returns it when one with this name and the same settings exists."""
    config = body.model_copy(update={"scorer": body.scorer or state.settings.default_scorer})
    if config.scorer not in state.settings.scorers:
        raise InvalidRequest(
            f"scorer must be one of {', '.join(state.settings.scorers)}, got {config.scorer!r}", field="scorer"
        )
    with state.sessions.begin() as session:
        existing = queries.run_by_name(session, body.name)
        if existing is not None:
            stored = _run_config(existing)
            if stored != config:
                changed = [k for k in RunCreate.model_fields if getattr(stored, k) != getattr(config, k)]
                raise RunConflict(
                    f"run {body.name!r} exists with different settings ({', '.join(changed)}); "
                    "use a new name for new settings",
                    field=changed[0],
                )
            response.status_code = status.HTTP_200_OK
            return _run_response(session, existing)
        run = Run(
            name=config.name,
            project=config.project,
            details=config.metadata.model_dump(),
            scorer=config.scorer,
            scorer_mode=config.scorer_mode,
            score_every=config.schedule.every,
            samplers=list(config.sampler.samplers),
            num_samples=config.sampler.num_samples,
            seed=config.sampler.seed,
            temperature=config.temperature,
            filter=config.filter.model_dump(),
            alert_rules=config.alerts.model_dump(),
        )
        session.add(run)
        session.flush()
        return _run_response(session, run)


@router.get("")
def list_runs(state: State) -> list[RunResponse]:
    with state.sessions() as session:
        return [_run_response(session, run) for run in queries.list_runs(session)]


@router.get("/{run}")
def get_run(state: State, run: str) -> RunResponse:
    with state.sessions() as session:
        return _run_response(session, _get_run(session, run))


@router.post(
    "/{run}/batches",
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        404: {"description": "Unknown run"},
        409: {"description": "batch_id replayed with different content"},
        413: {"description": "Body or batch over the configured limits"},
        503: {"description": "Scoring queue full; retry after the Retry-After header"},
    },
)
def ingest_batch(
    state: State,
    run: str,
    raw: RawBody,
    body: Annotated[BatchIn, Body(openapi_examples={"two groups": {"value": BATCH_EXAMPLE}})],
) -> BatchAccepted:
    """Accepts one training step's rollouts; answers before any scoring (follow ``status_url``)."""
    return pipeline.ingest_batch(state.sessions, state.settings, run, raw, body)


@router.post("/{run}/matrices", status_code=status.HTTP_201_CREATED)
def ingest_matrix(state: State, run: str, raw: RawBody, body: MatrixBatchIn) -> dict[str, Any]:
    """Stores a cross-scoring matrix computed by the trainer and returns its metrics (no model involved)."""
    accepted, result = pipeline.ingest_matrix(state.sessions, state.settings, run, raw, body)
    return {**accepted.model_dump(), "results": result}


@router.post("/{run}/checkpoints", status_code=status.HTTP_201_CREATED)
def announce_checkpoint(state: State, run: str, body: CheckpointIn) -> CheckpointResponse:
    """Announces a policy checkpoint; later batches of a ``policy``-mode run are scored with it."""
    folder = resolve_checkpoint(state.settings, body.path, body.kind)
    with state.sessions.begin() as session:
        target = _get_run(session, run)
        checkpoint = Checkpoint(run_id=target.id, path=str(folder), kind=body.kind, step=body.step)
        session.add(checkpoint)
        session.flush()
        return CheckpointResponse(
            path=checkpoint.path,
            kind=body.kind,
            step=body.step,
            id=checkpoint.id,
            created_at=checkpoint.created_at.isoformat(),
        )


@router.get("/{run}/metrics", response_model=None)
def metric_series(
    state: State,
    run: str,
    names: Annotated[str | None, Query(description="Comma-separated metric names; all when absent.")] = None,
    sampler: Annotated[str | None, Query(description="first_turn, trajectory, all, or a matrix sampler.")] = None,
    from_step: Annotated[int | None, Query(ge=0)] = None,
    to_step: Annotated[int | None, Query(ge=0)] = None,
    format: Annotated[str, Query(pattern="^(json|csv)$")] = "json",
    limit: Annotated[int, Query(ge=1, le=1_000_000)] = 100_000,
) -> Response:
    """Stored metric points of a run, ordered by step."""
    wanted = [n for n in (names or "").split(",") if n]
    with state.sessions() as session:
        target = _get_run(session, run)
        points = queries.metric_series(session, target.id, wanted, sampler, from_step, to_step, limit)
        rows = [
            {
                "step": p.step,
                "sampler": p.sampler,
                "name": p.name,
                "value": p.value,
                "scorer": p.scorer,
                "checkpoint": p.checkpoint,
                "time": queries.as_utc(p.created_at).isoformat(),  # type: ignore[union-attr]  # never None
            }
            for p in points
        ]
    if format == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=["step", "sampler", "name", "value", "scorer", "checkpoint", "time"])
        writer.writeheader()
        writer.writerows(rows)
        return Response(out.getvalue(), media_type="text/csv")
    return JSONResponse({"run": run, "points": rows})
