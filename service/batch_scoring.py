"""Scoring an accepted rollouts batch: reward and coverage figures, then each sampler's diagnostics.

Pure computation on a snapshot of the run and the payload (the kernel runs here, so this module
loads torch): everything the batch writes comes back as one ``ScoredBatch``, which
``service.recording`` writes. Must not import fastapi or touch the database.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from scoring.cross_scores import score_batch
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, token_entropy_stats
from scoring.partition import split_turn, turn_token_ids
from scoring.samplers import SAMPLERS, Trajectory, Turn, coverage, sample_rows
from scoring.scorer import Scorer
from scoring.snr_filter import ZERO_SPREAD, FilterConfig, filter_groups
from service.errors import InvalidRequest
from service.recording import ALL, ScoredBatch
from service.runs import RunSnapshot, is_scheduled
from service.schemas import BatchIn, BatchResult, RewardResult, TurnWithEntropy
from service.settings import Settings
from service.storage.matrices import MatrixRecord
from service.storage.queries import Point


def score_rollouts(
    payload: BatchIn,
    run: RunSnapshot,
    emas: dict[str, EmaState],
    get_scorer: Callable[[], Scorer],
    settings: Settings,
) -> ScoredBatch:
    """Reward/SNR and coverage figures for every batch; cross-scoring diagnostics on scheduled steps."""
    rewards, figures = reward_figures(payload, run.filter)
    scheduled = is_scheduled(payload.step, run.score_every)
    scored = ScoredBatch(
        result=BatchResult(scored=scheduled, samplers={} if scheduled else None, rewards=rewards, figures=figures),
        points=[Point(ALL, name, value) for name, value in figures.items()],
    )
    if not scheduled:
        return scored
    scorer = get_scorer()
    config = settings.scoring_config(scorer.name, run.temperature)
    trajectories = tokenized(payload, scorer)
    scored.scorer = run.scorer
    for index, sampler in enumerate(run.samplers):
        rows = sample_rows(
            sampler, trajectories, run.num_samples, seed=[run.seed, payload.step, SAMPLERS.index(sampler)]
        )
        if rows is None:
            scored.skip_sampler(sampler, "no turn carries reasoning to score")
            continue
        cross = score_batch(scorer, rows.batch, config)
        scored.tokens += cross.tokens_processed
        labels = _column_labels(sampler, rows.batch.column_group_ids, rows.sources, payload)
        diagnostics, ema = compute_diagnostics(
            cross.L_tok,
            cross.L_seq,
            rows.batch.column_of_row,
            rows.batch.column_prompts,
            emas.get(sampler, EmaState()),
            EstimatorConfig(bootstrap_seed=run.seed + index),
            labels,
        )
        entropy = token_entropy_stats(cross.token_entropy)
        matrix = MatrixRecord(sampler, cross.L_tok, rows.batch.column_of_row, labels, rows.sources)
        scored.add_sampler(sampler, diagnostics, ema, matrix, entropy)
    return scored


def reward_figures(payload: BatchIn, filter_settings: dict[str, object]) -> tuple[RewardResult, dict[str, float]]:
    """SNR figures of the batch's reward groups, what the run's filter would keep, and coverage."""
    group_ids = sorted({t.group_id for t in payload.trajectories})
    rewards = [[t.reward for t in payload.trajectories if t.group_id == g] for g in group_ids]
    advice = filter_groups(rewards, FilterConfig(**filter_settings))  # type: ignore[arg-type]  # validated at run creation
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
    result = RewardResult(
        group_ids=group_ids,
        group_reward_std=advice.group_reward_std,
        selected_group_ids=[group_ids[i] for i in advice.selected_groups],
        single_sample_group_ids=[group_ids[i] for i in advice.single_sample_groups],
        warnings=advice.warnings,
        filter=dict(filter_settings),
    )
    return result, figures


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
    """The batch's trajectories as token ids under ``scorer``'s tokenizer; 400 for what it cannot encode."""
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
