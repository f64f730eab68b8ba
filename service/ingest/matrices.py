"""Matrices a trainer computed: scored at once (no model, no queue), recorded with the worker's own code.

Replays are answered as the first time. Must not import fastapi or torch.
"""

from __future__ import annotations

import time

import numpy as np
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from scoring.dependence import DependenceConfig, dependence_signals
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, token_entropy_stats
from service.errors import Conflict, InvalidRequest, NotFound, StepConflict, Unavailable
from service.ingest.idempotency import accepted_answer, content_hash, new_batch, replay_of
from service.ingest.limits import IngestLimits, check_size, store_payload
from service.ingest.runs import resume_warning, segment_for
from service.jobs.recording import ScoredBatch, finish_done, load_emas
from service.jobs.reward_figures import grouped_reward_figures
from service.reads.runs import require_run
from service.schemas.inputs import InputError, MatrixBatchIn
from service.schemas.results import BatchResult, MatrixAccepted
from service.settings import Settings
from service.snapshot import RunSnapshot
from service.storage import runs
from service.storage.labels import BATCH
from service.storage.matrices import MatrixRecord
from service.storage.points import Point
from service.storage.tables import Batch


def check_matrix_limits(payload: MatrixBatchIn, limits: IngestLimits) -> None:
    """413 for a matrix over its row, column or cell limits, before any numerical work on it."""
    n_rows = len(payload.row_group_ids)
    check_size(
        n_rows, limits.max_matrix_rows, "a matrix", "rows (max_matrix_rows)", "row_group_ids", setting="max_matrix_rows"
    )
    n_columns = len(set(payload.row_group_ids))
    check_size(
        n_columns,
        limits.max_matrix_columns,
        "a matrix",
        "columns (max_matrix_columns)",
        "row_group_ids",
        setting="max_matrix_columns",
    )
    check_size(
        n_rows * n_columns,
        limits.max_matrix_cells,
        "a matrix",
        "cells (max_matrix_cells)",
        "L_seq",
        setting="max_matrix_cells",
    )


MATRIX_ATTEMPTS = 3  # scorings of one matrix against an EMA state that concurrent uploads keep moving


def ingest_matrix(
    sessions: sessionmaker[Session],
    settings: Settings,
    limits: IngestLimits,
    run_name: str,
    raw: bytes,
    payload: MatrixBatchIn,
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
    check_matrix_limits(payload, limits)
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
    raced = False  # another matrix of the sampler was stored while this one was being scored
    for _ in range(MATRIX_ATTEMPTS):
        started = time.perf_counter()
        scored = score_matrix(payload, ema, run.filter)
        seconds = time.perf_counter() - started
        with sessions.begin() as session:
            if require_run(session, run_name).id != run.id:  # 404 if it was deleted while the matrix was scored
                raise NotFound(
                    f"run {run_name!r} was deleted and created again while this matrix was scored; send it again",
                    field="run",
                )
            if raced:
                _refuse_concurrent_resume(session, run, payload)
            segment = segment_for(session, run, payload.step, matrix_sampler=payload.sampler)
            replay = _matrix_replay(session, run.id, payload, raw, digest)
            current = _ema_of(session, run.id, payload.sampler)
            if replay is not None or current != ema:
                session.rollback()  # the segment move too: nothing of this attempt is kept
            else:
                batch = new_batch(
                    run.id,
                    payload.step,
                    segment.number,
                    payload.idempotency_key,
                    "matrix",
                    raw,
                    digest,
                    status="queued",  # finished below, in this transaction: no worker ever sees it
                )
                store_payload(session, run.id, len(raw), limits.max_stored_bytes_per_run)
                session.add(batch)
                try:
                    session.flush()
                except IntegrityError:  # pragma: no cover - the run's row lock orders identical uploads first
                    session.rollback()
                    replay = _matrix_replay_after_race(sessions, run.id, payload, raw, digest)
                else:
                    finish_done(session, run, batch.id, None, scored, seconds, settings)
                    answer = accepted_answer(batch).model_copy(update={"status": "done"})
                    resumed = resume_warning(run.name, payload.step, segment, payload.sampler)
                    if resumed is not None:
                        answer = answer.model_copy(update={"resumed": True, "warnings": [resumed]})
                    return MatrixAccepted(**answer.model_dump(), results=scored.result)
        if replay is not None:
            return replay
        ema, raced = current, True
    raise Unavailable(
        f"matrices of sampler {payload.sampler!r} of this run arrived concurrently {MATRIX_ATTEMPTS} times while "
        "this one was scored; retry after the Retry-After header (send a sampler's steps one at a time, in order)",
        retry_after=1,
    )


def _refuse_concurrent_resume(session: Session, run: RunSnapshot, payload: MatrixBatchIn) -> None:
    """409 for a matrix whose step went back while a later one of its sampler was stored concurrently.

    Alone, a step going back is a resume (a new segment, ``runs.advance_segment``); while it was
    in flight, it is most likely two uploaders racing, and a silent new segment would hide the
    later steps' figures. A resend after this answer is a resume.
    """
    newer = runs.newest_matrix_step(session, run.id, payload.sampler)
    if newer is not None and payload.step < newer:
        raise StepConflict(
            f"step {payload.step} of sampler {payload.sampler!r} of run {run.name!r} arrived while step {newer} "
            "was being stored by another upload: matrices of one sampler must arrive in step order (one uploader, "
            "or wait for each answer); send it again only if the trainer resumed (a new segment replaces the "
            "steps from it on)",
            field="step",
        )


def _ema_of(session: Session, run_id: int, sampler: str) -> EmaState:
    return load_emas(session, run_id, [sampler]).get(sampler, EmaState())


def _matrix_replay(
    session: Session, run_id: int, payload: MatrixBatchIn, raw: bytes, digest: str
) -> MatrixAccepted | None:
    """The stored answer to an identical earlier upload (None when there is none; 409 for other content)."""
    replay = replay_of(session, run_id, payload.idempotency_key, payload.step, raw, digest)
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
        scored.points += [Point(BATCH, name, value) for name, value in scored.result.figures.items()]
    figures = token_entropy_stats([np.asarray(e) for e in payload.token_entropy or []])
    if diagnostics.metrics:
        prompts = payload.column_prompt_tokens
        figures |= dependence_signals(L_tok, diagnostics.metrics, columns, prompts, None, DependenceConfig())
    matrix = MatrixRecord(payload.sampler, L_tok, columns, group_ids)
    scored.add_sampler(payload.sampler, diagnostics, new_ema, matrix, figures)
    scored.result.skipped_reason = diagnostics.skipped_reason
    return scored
