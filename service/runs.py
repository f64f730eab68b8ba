"""Runs: creating one (idempotently), what scoring needs to know of one, and its policy checkpoints.

The HTTP handlers only parse and respond; the rules live here. Must not import fastapi.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from scoring.partition import Extraction
from service.access import Token
from service.alerts.rules import AlertSettings
from service.errors import InvalidRequest, NotFound, RunConflict, RunLimitReached
from service.schemas import CheckpointIn, CheckpointResponse, RunCreate, RunResponse
from service.settings import Settings
from service.storage import queries, retention, tokens
from service.storage.tables import Checkpoint, Run


@dataclass(frozen=True)
class RunSnapshot:
    """What scoring and the alert rules need to know about a run, detached from any session."""

    id: int
    name: str
    scorer: str
    scorer_mode: str
    score_every: int
    samplers: tuple[str, ...]
    num_samples: int | None
    seed: int
    temperature: float
    filter: dict[str, Any]
    alerts: AlertSettings
    reasoning_extraction: Extraction = "auto"

    @classmethod
    def of(cls, run: Run) -> RunSnapshot:
        return cls(
            id=run.id,
            name=run.name,
            scorer=run.scorer,
            scorer_mode=run.scorer_mode,
            score_every=run.score_every,
            samplers=tuple(run.samplers),
            num_samples=run.num_samples,
            seed=run.seed,
            temperature=run.temperature,
            filter=dict(run.filter),
            alerts=AlertSettings.model_validate(run.alert_rules),
            reasoning_extraction=cast(Extraction, run.reasoning_extraction),
        )


def is_scheduled(step: int, every: int) -> bool:
    """RAGEN's compute_freq rule: step 1 and every multiple of ``every``; every step when it is 1."""
    return every == 1 or step == 1 or (step > 0 and step % every == 0)


def require_run(session: Session, name: str) -> Run:
    """The run called ``name``, or 404."""
    run = queries.run_by_name(session, name)
    if run is None:
        raise NotFound(f"run {name!r} does not exist; create it with POST /v1/runs", field="run")
    return run


def segment_for(session: Session, run: Run | RunSnapshot, step: int, *, matrix_sampler: str | None = None) -> int:
    """The segment a batch of ``step`` joins (``queries.advance_segment``), or 404 when the run was just deleted.

    The run was read earlier in the transaction; a concurrent ``DELETE /v1/runs/{run}`` may have
    committed since (on Postgres this UPDATE waits for its lock and then finds no row).
    """
    segment = queries.advance_segment(session, run.id, step, matrix_sampler=matrix_sampler)
    if segment is None:
        raise NotFound(f"run {run.name!r} was deleted while this request was being handled", field="run")
    return segment


def run_settings(run: Run) -> RunCreate:
    """A stored run's settings in the form they were created with."""
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
            "reasoning_extraction": run.reasoning_extraction,
        }
    )


def run_response(session: Session, run: Run) -> RunResponse:
    return RunResponse(
        **run_settings(run).model_dump(),
        id=run.id,
        created_at=run.created_at.isoformat(),
        last_step=queries.last_step(session, run.id),
        batches=queries.batch_counts(session, run.id),
    )


def create_run(
    sessions: sessionmaker[Session], settings: Settings, body: RunCreate, token: Token | None = None
) -> tuple[RunResponse, bool]:
    """Creates a run; returns ``(run, created)``. The same name with the same settings returns the
    existing run (a restarted trainer re-posts it); with other settings it is refused (409).

    An ingest ``token`` creates at most ``max_runs_per_token`` runs (403 beyond; re-posting an
    existing run is not a creation). Several trainer processes posting one run at once: one
    creates it, the others get it back as a re-post."""
    wanted = body.model_copy(update={"scorer": body.scorer or settings.default_scorer})
    if wanted.scorer not in settings.scorers:
        raise InvalidRequest(
            f"scorer must be one of {', '.join(settings.scorers)}, got {wanted.scorer!r}", field="scorer"
        )
    try:
        with sessions.begin() as session:
            existing = queries.run_by_name(session, body.name)
            if existing is not None:
                _check_same_settings(run_settings(existing), wanted)
                return run_response(session, existing), False
            _check_run_limit(session, settings, token)
            run = Run(
                name=wanted.name,
                project=wanted.project,
                details=wanted.metadata.model_dump(),
                scorer=wanted.scorer,
                scorer_mode=wanted.scorer_mode,
                score_every=wanted.schedule.every,
                samplers=list(wanted.sampler.samplers),
                num_samples=wanted.sampler.num_samples,
                seed=wanted.sampler.seed,
                temperature=wanted.temperature,
                filter=wanted.filter.model_dump(),
                alert_rules=wanted.alerts.model_dump(),
                reasoning_extraction=wanted.reasoning_extraction,
                created_by_token=token.id if token is not None else None,
            )
            session.add(run)
            session.flush()
            return run_response(session, run), True
    except IntegrityError:  # a concurrent request created the same name after our read: answer as a re-post
        with sessions.begin() as session:
            existing = queries.run_by_name(session, body.name)
            if existing is None:
                raise
            _check_same_settings(run_settings(existing), wanted)
            return run_response(session, existing), False


def _check_run_limit(session: Session, settings: Settings, token: Token | None) -> None:
    limit = settings.max_runs_per_token
    if token is None or token.scope != "ingest" or limit == 0:
        return
    created = tokens.runs_created_by(session, token.id, lock=True)
    if created >= limit:
        raise RunLimitReached(
            f"this ingest token ({token.hint}...) has created {created} runs, the limit (max_runs_per_token={limit}); "
            "an admin can delete old runs (DELETE /v1/runs/{run}) or raise the limit",
            field="name",
        )


def delete_run(sessions: sessionmaker[Session], name: str) -> dict[str, int]:
    """Deletes the run called ``name`` and everything it owns (404 if unknown); rows deleted per table.

    Two deletes of one run at once: the second finds no row left to delete, and answers 404 too.
    """
    with sessions.begin() as session:
        deleted = retention.delete_run(session, require_run(session, name).id)
        if not deleted["runs"]:
            raise NotFound(f"run {name!r} does not exist (it was deleted meanwhile)", field="run")
        return deleted


def _check_same_settings(stored: RunCreate, wanted: RunCreate) -> None:
    if stored == wanted:
        return
    changed = [k for k in RunCreate.model_fields if getattr(stored, k) != getattr(wanted, k)]
    raise RunConflict(
        f"run {wanted.name!r} exists with different settings ({', '.join(changed)}); use a new name for new settings",
        field=changed[0],
    )


def announce_checkpoint(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, body: CheckpointIn
) -> CheckpointResponse:
    """Records a policy checkpoint; later batches of a ``policy``-mode run are scored with it."""
    folder = resolve_checkpoint(settings, body.path, body.kind)
    try:
        with sessions.begin() as session:
            run = require_run(session, run_name)
            checkpoint = Checkpoint(run_id=run.id, path=str(folder), kind=body.kind, step=body.step)
            session.add(checkpoint)
            session.flush()
            return CheckpointResponse(
                path=checkpoint.path,
                kind=body.kind,
                step=body.step,
                id=checkpoint.id,
                created_at=checkpoint.created_at.isoformat(),
            )
    except IntegrityError as e:  # the run's foreign key: a concurrent DELETE /v1/runs/{run} committed first
        with sessions() as session:
            if queries.run_by_name(session, run_name) is None:
                raise NotFound(
                    f"run {run_name!r} was deleted while the checkpoint was being recorded", field="run"
                ) from e
        raise


def resolve_checkpoint(settings: Settings, path: str, kind: str) -> Path:
    """The checkpoint folder ``path`` names, if it lies under the allow-listed root and looks right."""
    root = _checkpoint_root(settings)
    folder = (root / path).resolve()
    if not folder.is_relative_to(root):
        raise InvalidRequest(f"path must lie under the checkpoint root {str(root)!r}, got {path!r}", field="path")
    _check_folder(root, folder, kind, f"{path!r}")
    return folder


def checkpoint_at_load(settings: Settings, folder: Path, kind: str) -> Path:
    """The announced checkpoint ``folder``, resolved and checked against the root again just before it is loaded.

    It was checked when announced, but a folder under the root can be replaced by a link to
    anywhere afterwards (or a file in it by one): loading follows links, so the check is redone
    on what would be read now, and the folder is loaded by its resolved path. 400-style
    ``InvalidRequest``: the worker fails the batch with this reason.
    """
    root = _checkpoint_root(settings)
    resolved = folder.resolve()
    if not resolved.is_relative_to(root):
        raise InvalidRequest(
            f"the {kind} checkpoint {str(folder)!r} now resolves to {str(resolved)!r}, outside the checkpoint root "
            f"{str(root)!r} (replaced by a link since it was announced); it was not loaded",
            field="path",
        )
    _check_folder(root, resolved, kind, f"{str(folder)!r}")
    return resolved


def _checkpoint_root(settings: Settings) -> Path:
    if settings.checkpoint_root is None:
        raise InvalidRequest(
            "checkpoints are disabled on this server: set checkpoint_root (COLLAPSE_MONITOR_CHECKPOINT_ROOT)",
            field="path",
        )
    return settings.checkpoint_root.resolve()


def _check_folder(root: Path, folder: Path, kind: str, named: str) -> None:
    """The folder holds its kind's marker file, and nothing in it is a link leading out of ``root``."""
    marker = "adapter_config.json" if kind == "lora" else "config.json"
    if not (folder / marker).is_file():
        raise InvalidRequest(
            f"a {kind} checkpoint folder must contain {marker}; {str(folder)!r} does not", field="path"
        )
    for entry in folder.iterdir():  # what a loader reads: config, weights, tokenizer files
        if not entry.resolve().is_relative_to(root):
            raise InvalidRequest(
                f"the checkpoint {named} holds {entry.name!r}, a link to {str(entry.resolve())!r} outside the "
                f"checkpoint root {str(root)!r}",
                field="path",
            )
