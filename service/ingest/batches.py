"""Rollouts batches: limits checked, queued for a worker in one transaction, answered 202; replays as the first time."""

from __future__ import annotations

from typing import cast

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from scoring.partition import Extraction
from service.ingest.idempotency import accepted_answer, content_hash, new_batch, replay_after_race, replay_of
from service.ingest.limits import check_batch_limits, check_groups, check_queues, check_scoring_cost, check_token_ids
from service.ingest.pace import run_pace
from service.ingest.runs import require_run, segment_for
from service.jobs.reasoning import ingest_warnings
from service.schemas import BatchAccepted, BatchIn
from service.settings import Settings
from service.storage import queries
from service.storage.tables import ScorerLimits


def ingest_rollouts(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, raw: bytes, payload: BatchIn
) -> BatchAccepted:
    """Commits an accepted rollouts batch as queued; answers an identical replay as the first time."""
    check_batch_limits(payload, settings)
    check_groups(payload)
    accepted, extraction, lag = _commit_rollouts(sessions, settings, run_name, raw, payload)
    # After the commit: the warnings split every turn (linear in the text, but up to 32 MB of it),
    # which no transaction needs to wait for.
    warnings = ingest_warnings(payload, extraction) + ([lag] if lag else [])
    return accepted.model_copy(update={"warnings": warnings})


def _commit_rollouts(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, raw: bytes, payload: BatchIn
) -> tuple[BatchAccepted, Extraction, str | None]:
    """The batch queued in one transaction (or an identical earlier one), the run's reasoning extraction, and
    the warning that scoring lags behind the run (``service.ingest.pace``), if it does."""
    # Hashed before the transaction, and once: 32 MB take ~50 ms, which the run's row lock need not wait for.
    digest = content_hash(raw)
    with sessions.begin() as session:
        run = require_run(session, run_name)
        extraction = cast(Extraction, run.reasoning_extraction)
        replay = replay_of(session, run.id, payload.idempotency_key, payload.step, raw, digest)
        if replay is not None:
            return replay, extraction, None
        check_scoring_cost(payload, run, settings)
        check_token_ids(payload, session.get(ScorerLimits, run.scorer))
        check_queues(session, run, settings)
        checkpoint = queries.latest_checkpoint(session, run.id) if run.scorer_mode == "policy" else None
        batch = new_batch(
            run.id,
            payload.step,
            segment_for(session, run, payload.step),
            payload.idempotency_key,
            "rollouts",
            raw,
            digest,
            checkpoint_id=checkpoint.id if checkpoint else None,
            status="queued",
        )
        session.add(batch)
        try:
            session.flush()
        except IntegrityError:  # a concurrent request with the same key won the race
            session.rollback()
            replayed = replay_after_race(sessions, run_name, payload.idempotency_key, payload.step, raw, digest)
            return replayed, extraction, None
        lag = run_pace(session, run.id).warning(run.name)
    return accepted_answer(batch), extraction, lag
