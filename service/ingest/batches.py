"""Rollouts batches: limits checked, stored in one transaction, answered 202; replays as the first time.

Figures the trainer sent with the batch are stored with it at once (``service.ingest.figures``). A step the
run's schedule scores is queued for a worker. A step off the schedule needs no model: its
figures (rewards, reasoning coverage) are computed here and the batch is finished ``done`` in the same
transaction, through the worker's own finish (``service.jobs.recording.finish_done``), so that noise
never takes a worker's turn.
"""

from __future__ import annotations

import time
from typing import cast

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from scoring.partition import Extraction
from service.ingest.figures import record_trainer_figures
from service.ingest.idempotency import accepted_answer, content_hash, new_batch, replay_after_race, replay_of
from service.ingest.limits import (
    IngestLimits,
    check_batch_limits,
    check_groups,
    check_queues,
    check_scoring_cost,
    check_token_ids,
    store_payload,
)
from service.ingest.runs import resume_warning, segment_for
from service.jobs.reasoning import Found, ingest_warnings, reasoning_summary
from service.jobs.recording import finish_done
from service.jobs.reward_figures import batch_figures
from service.reads.pace import run_pace
from service.reads.runs import require_run
from service.schemas.inputs import BatchAccepted, BatchIn
from service.settings import Settings
from service.snapshot import RunSnapshot, is_scheduled
from service.storage import queue, runs


def ingest_rollouts(
    sessions: sessionmaker[Session],
    settings: Settings,
    limits: IngestLimits,
    run_name: str,
    raw: bytes,
    payload: BatchIn,
) -> BatchAccepted:
    """Commits an accepted rollouts batch as queued; answers an identical replay as the first time.

    ``limits`` bound the batch; ``settings`` reach only the finish of a step off the schedule (its alerts).
    """
    check_batch_limits(payload, limits)
    check_groups(payload)
    accepted, extraction, lag, found = _commit_rollouts(sessions, settings, limits, run_name, raw, payload)
    # After the commit: the warnings split every turn (linear in the text, but up to 32 MB of it),
    # which no transaction needs to wait for; a step off the schedule had it split for its figures.
    found = found or reasoning_summary(payload, extraction)
    warnings = accepted.warnings + ingest_warnings(payload, extraction, found) + ([lag] if lag else [])
    return accepted.model_copy(update={"warnings": warnings})


def _commit_rollouts(
    sessions: sessionmaker[Session],
    settings: Settings,
    limits: IngestLimits,
    run_name: str,
    raw: bytes,
    payload: BatchIn,
) -> tuple[BatchAccepted, Extraction, str | None, Found | None]:
    """The batch stored in one transaction (or an identical earlier one), the run's reasoning extraction,
    the warning that scoring lags behind the run (``service.reads.pace``), if it does, and the batch's
    reasoning summary if it was computed (a step off the schedule)."""
    # Hashed before the transaction, and once: 32 MB take ~50 ms, which the run's row lock need not wait for.
    digest = content_hash(raw)
    with sessions.begin() as session:
        run = require_run(session, run_name)
        extraction = cast(Extraction, run.reasoning_extraction)
        replay = replay_of(session, run.id, payload.idempotency_key, payload.step, raw, digest)
        if replay is not None:
            return replay, extraction, None, None
        scheduled = is_scheduled(payload.step, run.score_every)
        check_scoring_cost(payload, run, limits)
        check_token_ids(session, payload, run.scorer)
        if scheduled:  # a step off the schedule never waits in the queue
            check_queues(session, run, limits)
        snapshot = RunSnapshot.of(run)
        # Before the run's row lock (segment_for): pure work on the payload, which other ingests need not wait for.
        started = time.perf_counter()
        found = None if scheduled else reasoning_summary(payload, extraction)
        figures = None if found is None else batch_figures(payload, snapshot, found)
        seconds = time.perf_counter() - started
        checkpoint = runs.latest_checkpoint(session, run.id) if run.scorer_mode == "policy" else None
        # A step below the one a worker took starts a segment: answered with a warning, never refused. Unlike a
        # matrix's (scored inside the request, so a later step stored meanwhile shows a race: 409), a rollouts
        # race has no sign of its own: the later step was taken seconds earlier, and after a trainer's crash its
        # last steps are as often still queued or being scored when it resumes, so a 409 would refuse real resumes.
        segment = segment_for(session, run, payload.step)
        batch = new_batch(
            run.id,
            payload.step,
            segment.number,
            payload.idempotency_key,
            "rollouts",
            raw,
            digest,
            checkpoint_id=checkpoint.id if checkpoint else None,
            status="queued",
        )
        store_payload(session, run.id, len(raw), limits.max_stored_bytes_per_run)
        session.add(batch)
        try:
            session.flush()
        except IntegrityError:  # a concurrent request with the same key won the race
            session.rollback()
            replayed = replay_after_race(sessions, run_name, payload.idempotency_key, payload.step, raw, digest)
            return replayed, extraction, None, None
        accepted = accepted_answer(batch)
        resumed = resume_warning(run.name, payload.step, segment)
        if resumed is not None:
            accepted = accepted.model_copy(update={"resumed": True, "warnings": [resumed]})
        if payload.figures:
            record_trainer_figures(session, run.id, batch, payload.figures)
        if figures is not None:
            figures.checkpoint = checkpoint.path if checkpoint else None
            finish_done(session, snapshot, batch.id, None, figures, seconds, settings)
            accepted = accepted.model_copy(update={"status": "done"})
        # A run with nothing queued has at most one batch being scored, short of a backlog (pace.BACKLOG): a step
        # finished here skips the pace's reads of the run's history.
        lag = run_pace(session, run.id).warning(run.name) if scheduled or queue.queue_depth(session, run.id) else None
    return accepted, extraction, lag, found
