"""Reward/SNR figures of a batch's reward groups and what the run's SNR-aware filter would keep; the
figures every rollouts batch gets, scheduled or not (``batch_figures``).

Shared by rollouts batches and trainer-computed matrices that carry rewards; torch-free, so the
API process can compute them (a step off the schedule is finished at ingest with nothing else).
Must not import fastapi or touch the database.
"""

from __future__ import annotations

import numpy as np

from scoring.samplers import coverage
from scoring.snr_filter import ZERO_SPREAD, filter_groups
from service.jobs.reasoning import Found
from service.jobs.recording import ScoredBatch
from service.schemas.inputs import BatchIn, FilterSettings
from service.schemas.results import BatchResult, RewardResult
from service.snapshot import RunSnapshot, is_scheduled
from service.storage.labels import BATCH
from service.storage.points import Point


def batch_figures(payload: BatchIn, run: RunSnapshot, found: Found) -> ScoredBatch:
    """What a rollouts batch writes before any cross-scoring: reward/SNR and reasoning-coverage figures and
    the reasoning summary, under the ``all`` sampler; on a step off the run's schedule, all it writes.

    ``found``: the batch's ``reasoning_summary`` (ingest needs it too: the turns are split once)."""
    rewards, figures = reward_figures(payload, run.filter)
    summary, presence = found
    figures.update(coverage(presence))
    figures["truncated_think_ratio"] = summary.truncated_think / summary.turns
    figures["whole_response_turn_ratio"] = summary.whole_response / summary.turns
    scheduled = is_scheduled(payload.step, run.score_every)
    return ScoredBatch(
        result=BatchResult(
            scored=False,
            samplers={} if scheduled else None,
            reasoning=summary,
            rewards=rewards,
            figures=figures,
        ),
        points=[Point(BATCH, name, value) for name, value in figures.items()],
    )


def reward_figures(payload: BatchIn, filter_settings: dict[str, object]) -> tuple[RewardResult, dict[str, float]]:
    """SNR figures of the batch's reward groups and what the run's filter would keep of them.

    Missing (null) rewards are left out of every reward figure and counted in
    ``missing_reward_ratio``; a group whose rewards are all missing is not a reward group.
    """
    trainer_entropy = [e for t in payload.trajectories for turn in t.turns for e in (turn.token_entropies or [])]
    return grouped_reward_figures(
        [t.group_id for t in payload.trajectories],
        [t.reward for t in payload.trajectories],
        filter_settings,
        {"trainer_token_entropy_mean": float(np.mean(trainer_entropy))} if trainer_entropy else {},
    )


def grouped_reward_figures(
    group_of_trajectory: list[int],
    rewards_of_trajectory: list[float | None],
    filter_settings: dict[str, object],
    extra: dict[str, float] | None = None,
) -> tuple[RewardResult, dict[str, float]]:
    """``reward_figures`` from one group id and one reward (or None) per trajectory."""
    pairs = list(zip(group_of_trajectory, rewards_of_trajectory, strict=True))
    present = [(g, r) for g, r in pairs if r is not None]
    by_group: dict[int, list[float]] = {}
    for g, r in present:  # one pass: a scan per group was O(groups x rows), 16M steps at 4096 of each
        by_group.setdefault(g, []).append(r)
    group_ids = sorted(by_group)
    rewards = [by_group[g] for g in group_ids]
    figures = {
        "num_groups": float(len(set(group_of_trajectory))),
        "num_trajectories": float(len(pairs)),
        "missing_reward_ratio": 1 - len(present) / len(pairs),
        **(extra or {}),
    }
    if not present:
        warning = f"all {len(pairs)} rewards are missing: no reward figures for this batch"
        empty = RewardResult(
            group_ids=[],
            group_reward_std=[],
            selected_group_ids=[],
            single_sample_group_ids=[],
            missing_rewards=len(pairs),
            warnings=[warning],
            filter=dict(filter_settings),
        )
        return empty, figures
    advice = filter_groups(rewards, FilterSettings.model_validate(filter_settings).filter_config())
    stds = np.array(advice.group_reward_std)
    figures.update(advice.metrics)
    figures["reward_mean"] = float(np.mean([r for group in rewards for r in group]))
    figures["zero_variance_group_ratio"] = float((stds <= ZERO_SPREAD).mean())
    result = RewardResult(
        group_ids=group_ids,
        group_reward_std=advice.group_reward_std,
        selected_group_ids=[group_ids[i] for i in advice.selected_groups],
        single_sample_group_ids=[group_ids[i] for i in advice.single_sample_groups],
        missing_rewards=len(pairs) - len(present),
        warnings=advice.warnings,
        filter=dict(filter_settings),
    )
    return result, figures
