"""Use cases: ingest a batch, turn an accepted batch into metric points.

Ingest only validates and commits (scoring comes later, in a worker). Scoring a batch is pure
computation on a snapshot of the run and the payload, returning everything the worker writes in
one transaction. Must not import fastapi.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from scoring import Scorer, score_batch
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, token_entropy_stats
from scoring.partition import split_turn, turn_token_ids
from scoring.samplers import SAMPLERS, Trajectory, Turn, coverage, sample_rows
from scoring.snr_filter import ZERO_SPREAD, FilterConfig, filter_groups
from service.alerting import update_alerts
from service.alerts import AlertConfig
from service.errors import Conflict, InvalidRequest, NotFound, TooLarge, Unavailable
from service.schemas import BatchAccepted, BatchIn, InputError, MatrixBatchIn, TurnWithEntropy
from service.settings import Settings
from service.storage import queries
from service.storage.queries import Point
from service.storage.tables import Batch, Run

ALL = "all"  # the sampler label of batch-level figures (rewards, coverage)


@dataclass(frozen=True)
class RunSnapshot:
    """What scoring needs to know about a run, detached from any session."""

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
    alerts: AlertConfig

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
            alerts=AlertConfig.model_validate(run.alert_rules),
        )


@dataclass
class ScoredBatch:
    """Everything one scored batch writes, in one transaction."""

    points: list[Point]
    result: dict[str, Any]
    ema: dict[str, EmaState] = field(default_factory=dict)
    tokens: int = 0
    scorer: str | None = None
    checkpoint: str | None = None


# Ingest ---------------------------------------------------------------------------------------


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
    if len(payload.trajectories) > settings.max_trajectories:
        raise TooLarge(
            f"a batch may hold at most {settings.max_trajectories} trajectories, got {len(payload.trajectories)}",
            field="trajectories",
        )
    for t, trajectory in enumerate(payload.trajectories):
        if len(trajectory.turns) > settings.max_turns:
            raise TooLarge(
                f"a trajectory may hold at most {settings.max_turns} turns, got {len(trajectory.turns)}",
                field=f"trajectories[{t}].turns",
                index=t,
            )
        for k, turn in enumerate(trajectory.turns):
            for name in ("prompt", "response", "reasoning"):
                text = getattr(turn, name)
                if text is not None and len(text) > settings.max_text_chars:
                    raise TooLarge(
                        f"{name} may hold at most {settings.max_text_chars} characters, got {len(text)}",
                        field=f"trajectories[{t}].turns[{k}].{name}",
                        index=t,
                    )
            for name in ("prompt_token_ids", "reasoning_token_ids"):
                ids = getattr(turn, name)
                if ids is not None and len(ids) > settings.max_token_ids:
                    raise TooLarge(
                        f"{name} may hold at most {settings.max_token_ids} token ids, got {len(ids)}",
                        field=f"trajectories[{t}].turns[{k}].{name}",
                        index=t,
                    )


def ingest_batch(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, raw: bytes, payload: BatchIn
) -> BatchAccepted:
    """Commits an accepted rollouts batch as queued; answers an identical replay as the first time."""
    check_batch_limits(payload, settings)
    with sessions.begin() as session:
        run = _run(session, run_name)
        replay = _replay(session, run.id, payload.batch_id, raw)
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
            payload.batch_id,
            "rollouts",
            raw,
            checkpoint_id=checkpoint.id if checkpoint else None,
            status="queued",
        )
        session.add(batch)
        try:
            session.flush()
        except IntegrityError:  # a concurrent request with the same batch_id won the race
            session.rollback()
            return _replay_after_race(sessions, run_name, payload.batch_id, raw)
    return BatchAccepted(batch_id=batch.id, status="queued", status_url=f"/v1/batches/{batch.id}")


def _new_batch(run_id: int, step: int, client_batch_id: str | None, kind: str, raw: bytes, **fields: Any) -> Batch:
    """A batch row holding the request body as sent, under a fresh id."""
    return Batch(
        id=uuid.uuid4().hex,
        run_id=run_id,
        step=step,
        client_batch_id=client_batch_id,
        kind=kind,
        payload=raw.decode(),
        payload_sha256=content_hash(raw),
        **fields,
    )


def _run(session: Session, run_name: str) -> Run:
    run = queries.run_by_name(session, run_name)
    if run is None:
        raise NotFound(f"run {run_name!r} does not exist; create it with POST /v1/runs", field="run")
    return run


def _replay(session: Session, run_id: int, client_batch_id: str | None, raw: bytes) -> BatchAccepted | None:
    if client_batch_id is None:
        return None
    existing = queries.batch_by_client_id(session, run_id, client_batch_id)
    if existing is None:
        return None
    if not same_content(existing.payload, existing.payload_sha256, raw):
        raise Conflict(
            f"batch_id {client_batch_id!r} was already used for different content (batch {existing.id}); "
            "send new content under a new batch_id",
            field="batch_id",
        )
    return BatchAccepted(
        batch_id=existing.id, status=existing.status, status_url=f"/v1/batches/{existing.id}", replayed=True
    )


def _replay_after_race(
    sessions: sessionmaker[Session], run_name: str, client_batch_id: str | None, raw: bytes
) -> BatchAccepted:
    with sessions.begin() as session:
        run = _run(session, run_name)
        replay = _replay(session, run.id, client_batch_id, raw)
    if replay is None:  # pragma: no cover - the unique constraint fired, so the row exists
        raise Conflict("batch_id conflict", field="batch_id")
    return replay


def ingest_matrix(
    sessions: sessionmaker[Session], settings: Settings, run_name: str, raw: bytes, payload: MatrixBatchIn
) -> tuple[BatchAccepted, dict[str, Any]]:
    """Stores a trainer-computed matrix and its metric points at once: no model, no queue."""
    cells = len(payload.row_group_ids) * len(set(payload.row_group_ids))
    if cells > settings.max_matrix_cells:
        raise TooLarge(f"a matrix may hold at most {settings.max_matrix_cells} cells, got {cells}", field="L_seq")
    try:
        L_tok, L_seq, columns = payload.arrays()
    except InputError as e:
        raise InvalidRequest(e.message, field=e.field) from e
    with sessions.begin() as session:
        run = _run(session, run_name)
        replay = _replay(session, run.id, payload.batch_id, raw)
        if replay is not None:
            stored = queries.batch_by_client_id(session, run.id, payload.batch_id or "")
            return replay, (stored.result if stored and stored.result else {})
        record = queries.ema_state(session, run.id, payload.sampler)
        ema = EmaState(record.marginal_std, record.marginal_std_seq) if record else EmaState()
        config = EstimatorConfig(std_eps=payload.config.std_eps, ema_decay=payload.config.ema_decay)
        diagnostics, new_ema = compute_diagnostics(L_tok, L_seq, columns, payload.column_prompt_tokens, ema, config)
        result = {
            "samplers": {payload.sampler: _sampler_result(diagnostics, len(L_tok), L_tok.shape[1], {})},
            "scored": True,
        }
        batch = _new_batch(
            run.id,
            payload.step,
            payload.batch_id,
            "matrix",
            raw,
            status="done",
            result=result,
            scoring_seconds=0.0,
            tokens_scored=0,
        )
        session.add(batch)
        session.flush()
        points = _sampler_points(payload.sampler, diagnostics, {}, len(L_tok), L_tok.shape[1])
        queries.record_points(session, run.id, batch.id, payload.step, points, scorer=None, checkpoint=None)
        if diagnostics.metrics:
            queries.save_ema(session, run.id, payload.sampler, payload.step, new_ema)
        update_alerts(session, RunSnapshot.of(run), payload.step, [payload.sampler], settings)
    accepted = BatchAccepted(batch_id=batch.id, status="done", status_url=f"/v1/batches/{batch.id}")
    return accepted, result


# Scoring --------------------------------------------------------------------------------------


def is_scheduled(step: int, every: int) -> bool:
    """RAGEN's compute_freq rule: step 1 and every multiple of ``every``; every step when it is 1."""
    return every == 1 or step == 1 or (step > 0 and step % every == 0)


def score_rollouts(
    payload: BatchIn,
    run: RunSnapshot,
    emas: dict[str, EmaState],
    get_scorer: Callable[[], Scorer],
    settings: Settings,
) -> ScoredBatch:
    """Reward/SNR and coverage figures for every batch; cross-scoring diagnostics on scheduled steps."""
    points, result = reward_figures(payload, run)
    result["scored"] = is_scheduled(payload.step, run.score_every)
    if not result["scored"]:
        return ScoredBatch(points=points, result=result)

    scorer = get_scorer()
    config = settings.scoring_config(scorer.name, run.temperature)
    trajectories = tokenized(payload, scorer)
    scored = ScoredBatch(points=points, result=result, scorer=run.scorer)
    result["samplers"] = {}
    for index, sampler in enumerate(run.samplers):
        rows = sample_rows(
            sampler, trajectories, run.num_samples, seed=[run.seed, payload.step, SAMPLERS.index(sampler)]
        )
        if rows is None:
            result["samplers"][sampler] = {"skipped_reason": "no turn carries reasoning to score"}
            continue
        cross = score_batch(scorer, rows.batch, config)
        scored.tokens += cross.tokens_processed
        diagnostics, ema = compute_diagnostics(
            cross.L_tok,
            cross.L_seq,
            rows.batch.column_of_row,
            rows.batch.column_prompts,
            emas.get(sampler, EmaState()),
            EstimatorConfig(bootstrap_seed=run.seed + index),
            _column_labels(sampler, rows.batch.column_group_ids, rows.sources, payload),
        )
        entropy = token_entropy_stats(cross.token_entropy)
        if diagnostics.metrics:
            scored.ema[sampler] = ema
        points.extend(_sampler_points(sampler, diagnostics, entropy, rows.batch.n_rows, rows.batch.n_columns))
        result["samplers"][sampler] = _sampler_result(diagnostics, rows.batch.n_rows, rows.batch.n_columns, entropy)
    return scored


def reward_figures(payload: BatchIn, run: RunSnapshot) -> tuple[list[Point], dict[str, Any]]:
    """SNR figures of the batch's reward groups, what the run's filter would keep, and coverage."""
    group_ids = sorted({t.group_id for t in payload.trajectories})
    rewards = [[t.reward for t in payload.trajectories if t.group_id == g] for g in group_ids]
    advice = filter_groups(rewards, FilterConfig(**run.filter))
    stds = np.array(advice.group_reward_std)
    figures = dict(advice.metrics)
    figures["reward_mean"] = float(np.mean([t.reward for t in payload.trajectories]))
    figures["num_groups"] = float(len(group_ids))
    figures["num_trajectories"] = float(len(payload.trajectories))
    figures["zero_variance_group_ratio"] = float((stds <= ZERO_SPREAD).mean())
    figures.update(coverage([_reasoning_presence(t.turns) for t in payload.trajectories]))
    trainer_entropy = [e for t in payload.trajectories for turn in t.turns for e in (turn.token_entropies or [])]
    if trainer_entropy:
        figures["trainer_token_entropy_mean"] = float(np.mean(trainer_entropy))
    result = {
        "rewards": {
            "group_ids": group_ids,
            "group_reward_std": advice.group_reward_std,
            "selected_group_ids": [group_ids[i] for i in advice.selected_groups],
            "single_sample_group_ids": [group_ids[i] for i in advice.single_sample_groups],
            "warnings": advice.warnings,
            "filter": run.filter,
        },
        "figures": figures,
    }
    return [Point(ALL, name, value) for name, value in figures.items()], result


def _reasoning_presence(turns: list[TurnWithEntropy]) -> Trajectory:
    """A stand-in trajectory whose turns only say whether reasoning is present (for coverage)."""
    marks = []
    for turn in turns:
        if turn.reasoning_token_ids is not None:
            present = bool(turn.reasoning_token_ids)
        elif turn.reasoning is not None:
            present = bool(turn.reasoning)
        else:
            present = bool(split_turn(turn.prompt or "", turn.response or "")[1])
        marks.append(Turn(prompt_ids=(0,), reasoning_ids=(0,) if present else ()))
    return Trajectory(group_id=0, turns=tuple(marks))


def tokenized(payload: BatchIn, scorer: Scorer) -> list[Trajectory]:
    trajectories = []
    for t, trajectory in enumerate(payload.trajectories):
        turns = []
        for k, turn in enumerate(trajectory.turns):
            if scorer.tokenizer is None and (turn.prompt is not None or turn.reasoning_token_ids is None):
                raise InvalidRequest(
                    f"scorer {scorer.name!r} has no tokenizer: send prompt_token_ids and reasoning_token_ids",
                    field=f"trajectories[{t}].turns[{k}]",
                    index=t,
                )
            x, z = turn_token_ids(
                scorer.encode,
                prompt=turn.prompt,
                prompt_ids=turn.prompt_token_ids,
                response=turn.response,
                reasoning=turn.reasoning,
                reasoning_ids=turn.reasoning_token_ids,
            )
            if not x:
                raise InvalidRequest(
                    "the prompt must produce at least 1 token, got 0",
                    field=f"trajectories[{t}].turns[{k}].prompt",
                    index=t,
                )
            turns.append(Turn(prompt_ids=x, reasoning_ids=z))
        trajectories.append(Trajectory(group_id=trajectory.group_id, turns=tuple(turns)))
    return trajectories


def _column_labels(
    sampler: str, column_group_ids: tuple[int, ...], sources: tuple[tuple[int, int], ...], payload: BatchIn
) -> list[int]:
    """Breakdown labels: the prompt's group id (trajectory draws are columns of their own)."""
    if sampler == "first_turn":
        return list(column_group_ids)
    return [payload.trajectories[m].group_id for m, _ in sources]


def _sampler_points(sampler: str, diagnostics: Any, entropy: dict[str, float], rows: int, columns: int) -> list[Point]:
    values = dict(diagnostics.metrics)
    values.update(entropy)
    for name, (low, high) in diagnostics.intervals.items():
        values[f"{name}_ci_low"], values[f"{name}_ci_high"] = low, high
    values["rows"], values["columns"] = float(rows), float(columns)
    return [Point(sampler, name, float(value)) for name, value in values.items()]


def _sampler_result(diagnostics: Any, rows: int, columns: int, entropy: dict[str, float]) -> dict[str, Any]:
    return {
        "rows": rows,
        "columns": columns,
        "metrics": {**diagnostics.metrics, **entropy},
        "intervals": {name: list(bounds) for name, bounds in diagnostics.intervals.items()},
        "per_prompt": [vars(c) for c in diagnostics.columns],
        "skipped_reason": diagnostics.skipped_reason,
    }


def timed(action: Callable[[], ScoredBatch]) -> tuple[ScoredBatch, float]:
    start = time.perf_counter()
    scored = action()
    return scored, time.perf_counter() - start
