"""Ingest: validate a trainer's batch, commit it in one transaction, answer; replays are answered as the first time.

Rollouts are queued for a worker; a matrix the trainer computed is scored here at once (no model)
and recorded with the same code as a worker's results. Must not import fastapi or torch.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics
from service.errors import Conflict, InvalidRequest, TooLarge, Unavailable
from service.recording import ScoredBatch, load_emas, record_step
from service.runs import RunSnapshot, require_run
from service.schemas import BatchAccepted, BatchIn, BatchResult, InputError, MatrixAccepted, MatrixBatchIn
from service.settings import Settings
from service.storage import queries
from service.storage.tables import Batch


def content_hash(raw: bytes) -> str:
    """SHA-256 of the body as sent: a retried request matches at the cost of one pass over its bytes."""
    return hashlib.sha256(raw).hexdigest()


def same_content(stored_payload: str, stored_hash: str, raw: bytes) -> bool:
    """Whether a replayed body carries the stored content; key order and spacing do not matter."""
    if content_hash(raw) == stored_hash:
        return True
    try:
        return bool(json.loads(stored_payload) == json.loads(raw))
    except json.JSONDecodeError:  # pragma: no cover - both bodies were validated JSON
        return False


def check_batch_limits(payload: BatchIn, settings: Settings) -> None:
    """413 for batches over the configured sizes; every oversized field is named, none is truncated."""
    _limit(len(payload.trajectories), settings.max_trajectories, "a batch", "trajectories", "trajectories")
    for t, trajectory in enumerate(payload.trajectories):
        _limit(len(trajectory.turns), settings.max_turns, "a trajectory", "turns", f"trajectories[{t}].turns", t)
        for k, turn in enumerate(trajectory.turns):
            where = f"trajectories[{t}].turns[{k}]"
            for name in ("prompt", "response", "reasoning"):
                text = getattr(turn, name)
                if text is not None:
                    _limit(len(text), settings.max_text_chars, name, "characters", f"{where}.{name}", t)
            for name in ("prompt_token_ids", "reasoning_token_ids"):
                ids = getattr(turn, name)
                if ids is not None:
                    _limit(len(ids), settings.max_token_ids, name, "token ids", f"{where}.{name}", t)


def _limit(size: int, limit: int, what: str, unit: str, field: str, index: int | None = None) -> None:
    if size > limit:
        raise TooLarge(f"{what} may hold at most {limit} {unit}, got {size}", field=field, index=index)


def ingest_rollouts(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, raw: bytes, payload: BatchIn
) -> BatchAccepted:
    """Commits an accepted rollouts batch as queued; answers an identical replay as the first time."""
    check_batch_limits(payload, settings)
    with sessions.begin() as session:
        run = require_run(session, run_name)
        replay = _replay(session, run.id, payload.idempotency_key, raw)
        if replay is not None:
            return replay
        if queries.queue_depth(session) >= settings.max_queue_depth:
            raise Unavailable(
                f"the scoring queue holds {settings.max_queue_depth} batches, its limit; retry later",
                retry_after=5,
            )
        checkpoint = queries.latest_checkpoint(session, run.id) if run.scorer_mode == "policy" else None
        batch = _new_batch(
            run.id,
            payload.step,
            payload.idempotency_key,
            "rollouts",
            raw,
            checkpoint_id=checkpoint.id if checkpoint else None,
            status="queued",
        )
        session.add(batch)
        try:
            session.flush()
        except IntegrityError:  # a concurrent request with the same key won the race
            session.rollback()
            return _replay_after_race(sessions, run_name, payload.idempotency_key, raw)
    return _accepted(batch)


def ingest_matrix(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, raw: bytes, payload: MatrixBatchIn
) -> MatrixAccepted:
    """Stores a trainer-computed matrix and its metric points at once: no model, no queue."""
    cells = len(payload.row_group_ids) * len(set(payload.row_group_ids))
    if cells > settings.max_matrix_cells:
        raise TooLarge(f"a matrix may hold at most {settings.max_matrix_cells} cells, got {cells}", field="L_seq")
    try:
        payload.check()
    except InputError as e:
        raise InvalidRequest(e.message, field=e.field) from e
    with sessions.begin() as session:
        run = RunSnapshot.of(require_run(session, run_name))
        replay = _replay(session, run.id, payload.idempotency_key, raw)
        if replay is not None:
            stored = queries.batch_by_key(session, run.id, payload.idempotency_key or "")
            result = BatchResult.model_validate(stored.result) if stored and stored.result else BatchResult(scored=True)
            return MatrixAccepted(**replay.model_dump(), results=result)
        scored = score_matrix(payload, load_emas(session, run.id, [payload.sampler]).get(payload.sampler, EmaState()))
        batch = _new_batch(
            run.id,
            payload.step,
            payload.idempotency_key,
            "matrix",
            raw,
            status="done",
            result=scored.result.model_dump(mode="json"),
            scoring_seconds=0.0,
            tokens_scored=0,
        )
        session.add(batch)
        session.flush()
        record_step(session, run, batch.id, payload.step, scored, settings)
    return MatrixAccepted(**_accepted(batch).model_dump(), results=scored.result)


def score_matrix(payload: MatrixBatchIn, ema: EmaState) -> ScoredBatch:
    """The diagnostics of a (checked) matrix the trainer computed: no model, no reward figures."""
    L_tok, L_seq, columns = payload.arrays()
    config = EstimatorConfig(std_eps=payload.config.std_eps, ema_decay=payload.config.ema_decay)
    diagnostics, new_ema = compute_diagnostics(L_tok, L_seq, columns, payload.column_prompt_tokens, ema, config)
    scored = ScoredBatch(result=BatchResult(scored=True, samplers={}))
    scored.add_sampler(payload.sampler, diagnostics, new_ema, len(L_tok), L_tok.shape[1], {})
    return scored


def _new_batch(run_id: int, step: int, key: str | None, kind: str, raw: bytes, **fields: Any) -> Batch:
    """A batch row holding the request body as sent, under a fresh id."""
    return Batch(
        id=uuid.uuid4().hex,
        run_id=run_id,
        step=step,
        idempotency_key=key,
        kind=kind,
        payload=raw.decode(),
        payload_sha256=content_hash(raw),
        **fields,
    )


def _accepted(batch: Batch, replayed: bool = False) -> BatchAccepted:
    return BatchAccepted(
        batch_id=batch.id,
        status=batch.status,
        status_url=f"/v1/batches/{batch.id}",
        replayed=replayed,
    )


def _replay(session: Session, run_id: int, key: str | None, raw: bytes) -> BatchAccepted | None:
    """The first answer to an identical earlier request under ``key``; 409 for other content."""
    if key is None:
        return None
    existing = queries.batch_by_key(session, run_id, key)
    if existing is None:
        return None
    if not same_content(existing.payload, existing.payload_sha256, raw):
        raise Conflict(
            f"batch_id {key!r} was already used for different content (batch {existing.id}); "
            "send new content under a new batch_id",
            field="batch_id",
        )
    return _accepted(existing, replayed=True)


def _replay_after_race(sessions: sessionmaker[Session], run_name: str, key: str | None, raw: bytes) -> BatchAccepted:
    with sessions.begin() as session:
        replay = _replay(session, require_run(session, run_name).id, key, raw)
    if replay is None:  # pragma: no cover - the unique constraint fired, so the row exists
        raise Conflict("batch_id conflict", field="batch_id")
    return replay
