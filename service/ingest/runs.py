"""Runs: creating one (idempotently), deleting one, and announcing its policy checkpoints.

The HTTP handlers only parse and respond; the rules live here. Writes only: a creation answers with the
run's read (``service.reads.runs``). Must not import fastapi.
"""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.access import Token
from service.errors import InvalidRequest, NotFound, RunConflict, RunLimitReached
from service.jobs.checkpoints import resolve_checkpoint
from service.reads.runs import require_run, run_response, run_settings
from service.schemas.inputs import CheckpointIn, CheckpointResponse, RunCreate, RunResponse
from service.settings import Settings
from service.snapshot import BUDGET_KEY, RunSnapshot
from service.storage import deletion, runs, tokens
from service.storage.tables import Checkpoint, Run, iso_time


def segment_for(
    session: Session, run: Run | RunSnapshot, step: int, *, matrix_sampler: str | None = None
) -> runs.Segment:
    """The segment a batch of ``step`` joins (``runs.advance_segment``), or 404 when the run was just deleted.

    The run was read earlier in the transaction; a concurrent ``DELETE /v1/runs/{run}`` may have
    committed since (on Postgres this UPDATE waits for its lock and then finds no row).
    """
    segment = runs.advance_segment(session, run.id, step, matrix_sampler=matrix_sampler)
    if segment is None:
        raise NotFound(f"run {run.name!r} was deleted while this request was being handled", field="run")
    return segment


def resume_warning(run_name: str, step: int, segment: runs.Segment, matrix_sampler: str | None = None) -> str | None:
    """What the answer says of a batch that started a segment (None when it joined the current one).

    The server cannot tell a resume from two uploaders racing (see docs/api.md, "Resumes and
    out-of-order uploads"); only the uploader knows, so the answer says both readings and the fix.
    """
    if segment.went_back_below is None:
        return None
    newer = (
        f"step {segment.went_back_below}, the newest of sampler {matrix_sampler!r}"
        if matrix_sampler is not None
        else f"step {segment.went_back_below}, already taken for scoring"
    )
    return (
        f"step {step} went back below {newer}: run {run_name!r} starts segment {segment.number} here, read as a "
        f"resume (reads show segment {segment.number} from step {step} on; the points it replaces stay readable with "
        "segments=all). If the trainer did not resume, two uploaders are sending this run's steps: send a run's "
        "steps from one uploader, in step order."
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
            existing = runs.run_by_name(session, body.name)
            if existing is not None:
                _check_same_settings(run_settings(existing), wanted)
                return run_response(session, existing), False
            _check_run_limit(session, settings, token)
            run = Run(
                name=wanted.name,
                project=wanted.project,
                details={**wanted.metadata.model_dump(), BUDGET_KEY: wanted.schedule.budget_seconds},
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
            existing = runs.run_by_name(session, body.name)
            if existing is None:
                raise
            _check_same_settings(run_settings(existing), wanted)
            return run_response(session, existing), False


def _check_run_limit(session: Session, settings: Settings, token: Token | None) -> None:
    if token is None:
        _check_open_run_limit(session, settings.max_runs_without_token)
        return
    limit = settings.max_runs_per_token
    if token.scope != "ingest" or limit == 0:
        return
    created = tokens.runs_created_by(session, token.id, lock=True)
    if created >= limit:
        raise RunLimitReached(
            f"this ingest token ({token.hint}...) has created {created} runs, the limit (max_runs_per_token={limit}); "
            "an admin can delete old runs (DELETE /v1/runs/{run}) or raise the limit",
            field="name",
        )


def _check_open_run_limit(session: Session, limit: int) -> None:
    """403 once requests without a token created ``limit`` runs (10,000 of them made every run list take 12-28 s)."""
    created = tokens.runs_created_by(session, None)
    if limit and created >= limit:
        raise RunLimitReached(
            f"requests without a token have created {created} runs, the limit (max_runs_without_token={limit}); "
            "an admin can delete old runs (DELETE /v1/runs/{run}), raise the limit, or issue tokens",
            field="name",
        )


def delete_run(sessions: sessionmaker[Session], name: str) -> dict[str, int]:
    """Deletes the run called ``name`` and everything it owns (404 if unknown); rows deleted per table.

    Two deletes of one run at once: the second finds no row left to delete, and answers 404 too.
    """
    with sessions.begin() as session:
        deleted = deletion.delete_run(session, require_run(session, name).id)
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
                created_at=iso_time(checkpoint.created_at) or "",
            )
    except IntegrityError as e:  # the run's foreign key: a concurrent DELETE /v1/runs/{run} committed first
        with sessions() as session:
            if runs.run_by_name(session, run_name) is None:
                raise NotFound(
                    f"run {run_name!r} was deleted while the checkpoint was being recorded", field="run"
                ) from e
        raise
