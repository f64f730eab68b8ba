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
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, token_entropy_stats
from scoring.partition import Extraction
from service.errors import Conflict, InvalidRequest, NotFound, RunQueueFull, TokenQueueFull, TooLarge, Unavailable
from service.jobs.reasoning import ingest_warnings
from service.jobs.recording import ALL, ScoredBatch, load_emas, record_step
from service.jobs.reward_figures import grouped_reward_figures
from service.runs import require_run, segment_for
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
from service.snapshot import RunSnapshot, is_scheduled
from service.storage import queries
from service.storage.matrices import MatrixRecord
from service.storage.queries import Point
from service.storage.tables import Batch, Run, ScorerLimits


def content_hash(raw: bytes) -> str:
    """SHA-256 of the body as sent: a retried request matches at the cost of one pass over its bytes."""
    return hashlib.sha256(raw).hexdigest()


def same_content(
    stored_payload: str, stored_hash: str, raw: bytes, is_purged: bool = False, digest: str | None = None
) -> bool:
    """Whether a replayed body carries the stored content; key order and spacing do not matter,
    except once the stored payload was purged (retention): then only the hash of the bytes is left.
    ``digest``: ``content_hash(raw)`` when the caller has it."""
    if (digest or content_hash(raw)) == stored_hash:
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
    accepted, extraction = _commit_rollouts(sessions, settings, run_name, raw, payload)
    # After the commit: the warnings split every turn (linear in the text, but up to 32 MB of it),
    # which no transaction needs to wait for.
    return accepted.model_copy(update={"warnings": ingest_warnings(payload, extraction)})


def _commit_rollouts(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, raw: bytes, payload: BatchIn
) -> tuple[BatchAccepted, Extraction]:
    """The batch queued in one transaction (or an identical earlier one), and the run's reasoning extraction."""
    # Hashed before the transaction, and once: 32 MB take ~50 ms, which the run's row lock need not wait for.
    digest = content_hash(raw)
    with sessions.begin() as session:
        run = require_run(session, run_name)
        extraction = cast(Extraction, run.reasoning_extraction)
        replay = _replay(session, run.id, payload.idempotency_key, payload.step, raw, digest)
        if replay is not None:
            return replay, extraction
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
            digest,
            checkpoint_id=checkpoint.id if checkpoint else None,
            status="queued",
        )
        session.add(batch)
        try:
            session.flush()
        except IntegrityError:  # a concurrent request with the same key won the race
            session.rollback()
            replayed = _replay_after_race(sessions, run_name, payload.idempotency_key, payload.step, raw, digest)
            return replayed, extraction
    return _accepted(batch), extraction


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


def check_matrix_limits(payload: MatrixBatchIn, settings: Settings) -> None:
    """413 for a matrix over its row, column or cell limits, before any numerical work on it."""
    n_rows = len(payload.row_group_ids)
    _limit(n_rows, settings.max_matrix_rows, "a matrix", "rows (max_matrix_rows)", "row_group_ids")
    n_columns = len(set(payload.row_group_ids))
    _limit(n_columns, settings.max_matrix_columns, "a matrix", "columns (max_matrix_columns)", "row_group_ids")
    _limit(n_rows * n_columns, settings.max_matrix_cells, "a matrix", "cells (max_matrix_cells)", "L_seq")


MATRIX_ATTEMPTS = 3  # scorings of one matrix against an EMA state that concurrent uploads keep moving


def ingest_matrix(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, raw: bytes, payload: MatrixBatchIn
) -> MatrixAccepted:
    """Stores a trainer-computed matrix and its metric points at once: no model, no queue.

    The diagnostics are computed outside any transaction, from the sampler's EMA state read
    before; the write transaction first takes the run's row lock (``advance_segment``: on
    Postgres concurrent uploads to the run queue there, on SQLite behind the one writer), then
    re-checks what another upload may have changed meanwhile. An identical upload that got
    there first makes this one a replay (its stored answer). A matrix of the same sampler that
    moved the EMA state makes this one's figures stale: they are thrown away and computed again
    from the new state (``MATRIX_ATTEMPTS`` times, then 503 with Retry-After), so each step's EMA
    follows the one written before it, as when the figures were computed inside the transaction.
    """
    check_matrix_limits(payload, settings)
    try:
        payload.check()
    except InputError as e:
        raise InvalidRequest(e.message, field=e.field) from e
    digest = content_hash(raw)
    with sessions.begin() as session:
        run = RunSnapshot.of(require_run(session, run_name))
        replay = _matrix_replay(session, run.id, payload, raw, digest)
        ema = _ema_of(session, run.id, payload.sampler)
    if replay is not None:
        return replay
    for _ in range(MATRIX_ATTEMPTS):
        scored = score_matrix(payload, ema, run.filter)
        with sessions.begin() as session:
            if require_run(session, run_name).id != run.id:  # 404 if it was deleted while the matrix was scored
                raise NotFound(
                    f"run {run_name!r} was deleted and created again while this matrix was scored; send it again",
                    field="run",
                )
            segment = segment_for(session, run, payload.step, matrix_sampler=payload.sampler)
            replay = _matrix_replay(session, run.id, payload, raw, digest)
            current = _ema_of(session, run.id, payload.sampler)
            if replay is not None or current != ema:
                session.rollback()  # the segment move too: nothing of this attempt is kept
            else:
                batch = _new_batch(
                    run.id,
                    payload.step,
                    segment,
                    payload.idempotency_key,
                    "matrix",
                    raw,
                    digest,
                    status="done",
                    result=scored.result.model_dump(mode="json"),
                    scoring_seconds=0.0,
                    tokens_scored=0,
                )
                session.add(batch)
                try:
                    session.flush()
                except IntegrityError:  # pragma: no cover - the run's row lock orders identical uploads first
                    session.rollback()
                    replay = _matrix_replay_after_race(sessions, run.id, payload, raw, digest)
                else:
                    record_step(session, run, batch, scored, settings)
                    return MatrixAccepted(**_accepted(batch).model_dump(), results=scored.result)
        if replay is not None:
            return replay
        ema = current
    raise Unavailable(
        f"matrices of sampler {payload.sampler!r} of this run arrived concurrently {MATRIX_ATTEMPTS} times while "
        "this one was scored; retry after the Retry-After header (send a sampler's steps one at a time, in order)",
        retry_after=1,
    )


def _ema_of(session: Session, run_id: int, sampler: str) -> EmaState:
    return load_emas(session, run_id, [sampler]).get(sampler, EmaState())


def _matrix_replay(
    session: Session, run_id: int, payload: MatrixBatchIn, raw: bytes, digest: str
) -> MatrixAccepted | None:
    """The stored answer to an identical earlier upload (None when there is none; 409 for other content)."""
    replay = _replay(session, run_id, payload.idempotency_key, payload.step, raw, digest)
    if replay is None:
        return None
    stored = session.scalar(select(Batch.result).where(Batch.id == replay.batch_id))
    result = BatchResult.model_validate(stored) if stored else BatchResult(scored=True)
    return MatrixAccepted(**replay.model_dump(), results=result)


def _matrix_replay_after_race(
    sessions: sessionmaker[Session], run_id: int, payload: MatrixBatchIn, raw: bytes, digest: str
) -> MatrixAccepted:  # pragma: no cover - see ingest_matrix
    with sessions.begin() as session:
        replay = _matrix_replay(session, run_id, payload, raw, digest)
    if replay is None:
        raise Conflict("batch_id conflict", field="batch_id")
    return replay


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


def _new_batch(
    run_id: int, step: int, segment: int, key: str | None, kind: str, raw: bytes, digest: str, **fields: Any
) -> Batch:
    """A batch row holding the request body as sent (``digest``: its ``content_hash``), under a fresh id."""
    return Batch(
        id=uuid.uuid4().hex,
        run_id=run_id,
        step=step,
        segment=segment,
        idempotency_key=key,
        kind=kind,
        payload=raw.decode(),
        payload_sha256=digest,
        **fields,
    )


def _accepted(batch: Batch, replayed: bool = False) -> BatchAccepted:
    return BatchAccepted(
        batch_id=batch.id,
        status=batch.status,  # type: ignore[arg-type]  # the column only ever holds a BatchState
        status_url=f"/v1/batches/{batch.id}",
        replayed=replayed,
    )


def _replay(session: Session, run_id: int, key: str | None, step: int, raw: bytes, digest: str) -> BatchAccepted | None:
    """The first answer to an identical earlier request; 409 for other content under the same key.

    Without a key, an earlier batch of the same step with byte-identical content is a replay too
    (a client that retried after a lost answer).
    """
    if key is None:
        existing = queries.batch_by_content(session, run_id, step, digest)
        return _accepted(existing, replayed=True) if existing is not None else None
    existing = queries.batch_by_key(session, run_id, key)
    if existing is None:
        return None
    is_purged = existing.payload_purged_at is not None
    if not same_content(existing.payload, existing.payload_sha256, raw, is_purged, digest):
        purged = " (its payload was purged, so only a byte-identical replay is recognised)" if is_purged else ""
        raise Conflict(
            f"batch_id {key!r} was already used for different content (batch {existing.id}){purged}; "
            "send new content under a new batch_id",
            field="batch_id",
        )
    return _accepted(existing, replayed=True)


def _replay_after_race(
    sessions: sessionmaker[Session], run_name: str, key: str | None, step: int, raw: bytes, digest: str
) -> BatchAccepted:
    with sessions.begin() as session:
        replay = _replay(session, require_run(session, run_name).id, key, step, raw, digest)
    if replay is None:  # pragma: no cover - the unique constraint fired, so the row exists
        raise Conflict("batch_id conflict", field="batch_id")
    return replay
