"""Ingest: validate a trainer's batch, commit it in one transaction, answer; replays are answered as the first time.

Rollouts are queued for a worker; a matrix the trainer computed is scored here at once (no model)
and recorded with the same code as a worker's results. Must not import fastapi or torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from typing import Any, cast

import numpy as np
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, token_entropy_stats
from scoring.partition import Extraction
from service.errors import Conflict, InvalidRequest, RunQueueFull, TokenQueueFull, TooLarge, Unavailable
from service.reasoning import ingest_warnings
from service.recording import ALL, ScoredBatch, load_emas, record_step
from service.reward_figures import grouped_reward_figures
from service.runs import RunSnapshot, is_scheduled, require_run, segment_for
from service.schemas import (
    BatchAccepted,
    BatchIn,
    BatchResult,
    InputError,
    MatrixAccepted,
    MatrixBatchIn,
    TurnWithEntropy,
)
from service.settings import Settings
from service.storage import queries
from service.storage.matrices import MatrixRecord
from service.storage.queries import Point
from service.storage.tables import Batch, Run, ScorerLimits


def content_hash(raw: bytes) -> str:
    """SHA-256 of the body as sent: a retried request matches at the cost of one pass over its bytes."""
    return hashlib.sha256(raw).hexdigest()


def same_content(stored_payload: str, stored_hash: str, raw: bytes, is_purged: bool = False) -> bool:
    """Whether a replayed body carries the stored content; key order and spacing do not matter,
    except once the stored payload was purged (retention): then only the hash of the bytes is left."""
    if content_hash(raw) == stored_hash:
        return True
    if is_purged:
        return False
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
    check_groups(payload)
    with sessions.begin() as session:
        run = require_run(session, run_name)
        warnings = ingest_warnings(payload, cast(Extraction, run.reasoning_extraction))
        replay = _replay(session, run.id, payload.idempotency_key, payload.step, raw)
        if replay is not None:
            return replay.model_copy(update={"warnings": warnings})
        check_scoring_cost(payload, run, settings)
        check_token_ids(payload, session.get(ScorerLimits, run.scorer))
        _check_queues(session, run, settings)
        checkpoint = queries.latest_checkpoint(session, run.id) if run.scorer_mode == "policy" else None
        batch = _new_batch(
            run.id,
            payload.step,
            segment_for(session, run, payload.step),
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
            replayed = _replay_after_race(sessions, run_name, payload.idempotency_key, payload.step, raw)
            return replayed.model_copy(update={"warnings": warnings})
    return _accepted(batch).model_copy(update={"warnings": warnings})


def check_groups(payload: BatchIn) -> None:
    """400 when trajectories of one group start from different prompts: a group is one prompt's rollouts."""
    first: dict[int, tuple[int, object]] = {}
    for t, trajectory in enumerate(payload.trajectories):
        turn = trajectory.turns[0]
        prompt = turn.prompt if turn.prompt is not None else turn.prompt_token_ids
        seen = first.setdefault(trajectory.group_id, (t, prompt))
        if seen[1] != prompt:
            raise InvalidRequest(
                f"trajectories {seen[0]} and {t} share group_id {trajectory.group_id} but start from different "
                "prompts; a group holds the rollouts of one prompt",
                field=f"trajectories[{t}].turns[0].prompt",
                index=t,
            )


def check_scoring_cost(payload: BatchIn, run: Run, settings: Settings) -> None:
    """413 when scoring the batch would cost more than ``max_scoring_cost`` (see ``scoring_cost``)."""
    cost = scoring_cost(payload, run.samplers, run.num_samples, run.score_every)
    if cost > settings.max_scoring_cost:
        raise TooLarge(
            f"scoring this batch would cost about {cost} tokens (rows x columns x tokens per pair, summed over "
            f"the run's samplers), more than max_scoring_cost={settings.max_scoring_cost}; send fewer or shorter "
            "trajectories, or create the run with a smaller sampler.num_samples",
            field="trajectories",
        )


def scoring_cost(payload: BatchIn, samplers: list[str], num_samples: int | None, every: int) -> int:
    """Tokens a naive scorer would run for this batch: per sampler, rows x columns x tokens of a pair.

    An upper bound of the kernel's work (which shares prompts) that grows as its time does. Text is
    counted at ``CHARS_PER_TOKEN`` characters a token; 0 on steps the schedule does not score.
    """
    if not is_scheduled(payload.step, every):
        return 0
    turns = [turn for trajectory in payload.trajectories for turn in trajectory.turns]
    tokens_per_pair = sum(_tokens(turn) for turn in turns) / len(turns)
    n_groups = len({trajectory.group_id for trajectory in payload.trajectories})
    cost = 0.0
    for sampler in samplers:
        usable = len(payload.trajectories) if sampler == "first_turn" else len(turns)
        rows = min(num_samples or usable, usable)
        columns = min(rows, n_groups) if sampler == "first_turn" else rows
        cost += rows * columns * tokens_per_pair
    return math.ceil(cost)


CHARS_PER_TOKEN = 3  # fewer than the ~4 of English BPE text, so that the estimate errs high


def _tokens(turn: TurnWithEntropy) -> float:
    prompt = (
        len(turn.prompt_token_ids) if turn.prompt_token_ids is not None else len(turn.prompt or "") / CHARS_PER_TOKEN
    )
    if turn.reasoning_token_ids is not None:
        return prompt + len(turn.reasoning_token_ids)
    return prompt + len(turn.response or turn.reasoning or "") / CHARS_PER_TOKEN


def check_token_ids(payload: BatchIn, limits: ScorerLimits | None) -> None:
    """400 for token ids the run's scorer cannot score: outside its vocabulary, or past its context.

    Known once a worker has loaded the scorer (it records its limits); text is tokenized, and
    checked, by the worker.
    """
    if limits is None:
        return
    for t, trajectory in enumerate(payload.trajectories):
        for k, turn in enumerate(trajectory.turns):
            where = f"trajectories[{t}].turns[{k}]"
            for name in ("prompt_token_ids", "reasoning_token_ids"):
                ids = getattr(turn, name)
                if ids and max(ids) >= limits.vocab_size:
                    raise InvalidRequest(
                        f"token id {max(ids)} is outside the vocabulary of scorer {limits.name!r} "
                        f"({limits.vocab_size} tokens)",
                        field=f"{where}.{name}",
                        index=t,
                    )
            if limits.max_positions is not None and turn.prompt_token_ids is not None:
                length = len(turn.prompt_token_ids) + len(turn.reasoning_token_ids or ())
                if length > limits.max_positions:
                    raise InvalidRequest(
                        f"prompt and reasoning hold {length} tokens, more than the context of scorer "
                        f"{limits.name!r} ({limits.max_positions})",
                        field=f"{where}.prompt_token_ids",
                        index=t,
                    )


def _check_queues(session: Session, run: Run, settings: Settings) -> None:
    """429 when this run, or its token's runs, have too many batches waiting (they alone slow down); 503 when
    everyone's queue is full."""
    queued = queries.queue_depth(session, run.id)
    if queued >= settings.max_queued_per_run:
        raise RunQueueFull(
            f"this run has {queued} batches waiting to be scored, its limit (max_queued_per_run); retry later",
            retry_after=5,
        )
    if run.created_by_token is not None:
        by_token = queries.token_queue_depth(session, run.created_by_token)
        if by_token >= settings.max_queued_per_token:
            raise TokenQueueFull(
                f"the runs of the token that created this run have {by_token} batches waiting to be scored, its "
                "share (max_queued_per_token); retry later",
                retry_after=5,
            )
    if queries.queue_depth(session) >= settings.max_queue_depth:
        raise Unavailable(
            f"the scoring queue holds {settings.max_queue_depth} batches, its limit; retry later", retry_after=5
        )


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
        replay = _replay(session, run.id, payload.idempotency_key, payload.step, raw)
        if replay is not None:
            stored = session.get_one(Batch, replay.batch_id)
            result = BatchResult.model_validate(stored.result) if stored.result else BatchResult(scored=True)
            return MatrixAccepted(**replay.model_dump(), results=result)
        ema = load_emas(session, run.id, [payload.sampler]).get(payload.sampler, EmaState())
        scored = score_matrix(payload, ema, run.filter)
        batch = _new_batch(
            run.id,
            payload.step,
            segment_for(session, run, payload.step, matrix_sampler=payload.sampler),
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
        record_step(session, run, batch, scored, settings)
    return MatrixAccepted(**_accepted(batch).model_dump(), results=scored.result)


def score_matrix(payload: MatrixBatchIn, ema: EmaState, filter_settings: dict[str, object]) -> ScoredBatch:
    """The diagnostics of a (checked) matrix the trainer computed: no model; reward figures when it sent rewards."""
    L_tok, L_seq, columns = payload.arrays()
    config = EstimatorConfig(std_eps=payload.config.std_eps, ema_decay=payload.config.ema_decay)
    group_ids = sorted(set(payload.row_group_ids))
    diagnostics, new_ema = compute_diagnostics(
        L_tok, L_seq, columns, payload.column_prompt_tokens, ema, config, group_ids
    )
    scored = ScoredBatch(result=BatchResult(scored=bool(diagnostics.metrics), samplers={}))
    if payload.rewards is not None:
        scored.result.rewards, scored.result.figures = grouped_reward_figures(
            payload.row_group_ids, list(payload.rewards), filter_settings
        )
        scored.points += [Point(ALL, name, value) for name, value in scored.result.figures.items()]
    entropy = token_entropy_stats([np.asarray(e) for e in payload.token_entropy or []])
    matrix = MatrixRecord(payload.sampler, L_tok, columns, group_ids)
    scored.add_sampler(payload.sampler, diagnostics, new_ema, matrix, entropy)
    scored.result.skipped_reason = diagnostics.skipped_reason
    return scored


def _new_batch(run_id: int, step: int, segment: int, key: str | None, kind: str, raw: bytes, **fields: Any) -> Batch:
    """A batch row holding the request body as sent, under a fresh id."""
    return Batch(
        id=uuid.uuid4().hex,
        run_id=run_id,
        step=step,
        segment=segment,
        idempotency_key=key,
        kind=kind,
        payload=raw.decode(),
        payload_sha256=content_hash(raw),
        **fields,
    )


def _accepted(batch: Batch, replayed: bool = False) -> BatchAccepted:
    return BatchAccepted(
        batch_id=batch.id,
        status=batch.status,  # type: ignore[arg-type]  # the column only ever holds a BatchState
        status_url=f"/v1/batches/{batch.id}",
        replayed=replayed,
    )


def _replay(session: Session, run_id: int, key: str | None, step: int, raw: bytes) -> BatchAccepted | None:
    """The first answer to an identical earlier request; 409 for other content under the same key.

    Without a key, an earlier batch of the same step with byte-identical content is a replay too
    (a client that retried after a lost answer).
    """
    if key is None:
        existing = queries.batch_by_content(session, run_id, step, content_hash(raw))
        return _accepted(existing, replayed=True) if existing is not None else None
    existing = queries.batch_by_key(session, run_id, key)
    if existing is None:
        return None
    is_purged = existing.payload_purged_at is not None
    if not same_content(existing.payload, existing.payload_sha256, raw, is_purged):
        purged = " (its payload was purged, so only a byte-identical replay is recognised)" if is_purged else ""
        raise Conflict(
            f"batch_id {key!r} was already used for different content (batch {existing.id}){purged}; "
            "send new content under a new batch_id",
            field="batch_id",
        )
    return _accepted(existing, replayed=True)


def _replay_after_race(
    sessions: sessionmaker[Session], run_name: str, key: str | None, step: int, raw: bytes
) -> BatchAccepted:
    with sessions.begin() as session:
        replay = _replay(session, require_run(session, run_name).id, key, step, raw)
    if replay is None:  # pragma: no cover - the unique constraint fired, so the row exists
        raise Conflict("batch_id conflict", field="batch_id")
    return replay
