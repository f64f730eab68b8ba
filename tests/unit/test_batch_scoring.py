"""service/jobs/rollouts.py without a database: the schedule and a batch's reward figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from scoring.snr_filter import FilterConfig, filter_groups
from service.jobs.reward_figures import reward_figures
from service.schemas.inputs import BatchIn, FilterSettings
from service.snapshot import is_scheduled


@pytest.mark.parametrize(
    ("every", "scheduled"),
    [(1, [0, 1, 2, 3, 4, 5, 6]), (3, [1, 3, 6]), (5, [1, 5])],
)
def test_the_schedule_is_ragens_compute_freq_step_1_and_multiples(every, scheduled):
    assert [step for step in range(7) if is_scheduled(step, every)] == scheduled


def batch(
    rewards: Mapping[int, Sequence[float | None]], reasoning: bool = True, entropies: list[float] | None = None
) -> BatchIn:
    response = "<think>I look at the board.</think><answer>Up</answer>" if reasoning else "<answer>Up</answer>"
    return BatchIn.model_validate(
        {
            "step": 1,
            "trajectories": [
                {
                    "group_id": g,
                    "reward": r,
                    "turns": [{"prompt": f"board {g}", "response": response, "token_entropies": entropies}],
                }
                for g, values in rewards.items()
                for r in values
            ],
        }
    )


def test_reward_figures_are_the_filters_figures_of_the_groups_plus_batch_figures():
    rewards = {3: [1.0, 0.0, 1.0], 0: [0.5, 0.5], 7: [2.0, 0.0, 1.0, 1.0]}
    result, figures = reward_figures(batch(rewards), FilterSettings().model_dump())
    assert result.group_ids == [0, 3, 7]
    expected = filter_groups([rewards[0], rewards[3], rewards[7]], FilterConfig())
    assert result.group_reward_std == expected.group_reward_std
    assert result.selected_group_ids == [[0, 3, 7][i] for i in expected.selected_groups]
    for name, value in expected.metrics.items():
        assert figures[name] == value
    every = [r for values in rewards.values() for r in values]
    assert figures["reward_mean"] == pytest.approx(np.mean(every))
    assert figures["num_groups"] == 3
    assert figures["num_trajectories"] == 9
    assert figures["zero_variance_group_ratio"] == pytest.approx(1 / 3)  # group 0
    assert figures["missing_reward_ratio"] == 0.0
    assert result.missing_rewards == 0
    assert "trainer_token_entropy_mean" not in figures


def test_trainer_entropies_show_in_the_figures():
    _, figures = reward_figures(batch({0: [1.0, 0.0]}, entropies=[1.0, 3.0]), {})
    assert figures["trainer_token_entropy_mean"] == 2.0


def test_missing_rewards_are_left_out_of_the_reward_figures_and_counted():
    with_missing: dict[int, list[float | None]] = {0: [1.0, None, 0.0], 1: [None, None], 2: [0.5, 0.5]}
    result, figures = reward_figures(batch(with_missing), {})
    present = {0: [1.0, 0.0], 2: [0.5, 0.5]}
    _, expected = reward_figures(batch(present), {})
    assert result.group_ids == [0, 2]  # group 1 has no reward at all
    assert result.missing_rewards == 3
    assert figures["missing_reward_ratio"] == pytest.approx(3 / 7)
    assert figures["num_groups"] == 3
    assert figures["num_trajectories"] == 7
    for name in (
        "reward_mean",
        "zero_variance_group_ratio",
        "rollout/in_group_reward_std",
        "rollout/filter_kept_ratio",
    ):
        assert figures[name] == expected[name]


def test_a_batch_without_any_reward_has_no_reward_figures_and_says_so():
    result, figures = reward_figures(batch({0: [None, None], 1: [None]}), {})
    assert figures == {"num_groups": 2.0, "num_trajectories": 3.0, "missing_reward_ratio": 1.0}
    assert result.group_ids == []
    assert result.warnings == ["all 3 rewards are missing: no reward figures for this batch"]


def test_the_run_filter_settings_decide_what_would_be_kept():
    rewards = {0: [0.0, 1.0], 1: [0.0, 0.1], 2: [0.0, 0.0]}
    top_k = FilterSettings(strategy="top_k_abs", value=1).model_dump()
    result, figures = reward_figures(batch(rewards), top_k)
    assert result.selected_group_ids == [0]
    assert figures["rollout/filter_kept_ratio"] == pytest.approx(1 / 3)
    assert result.filter == top_k


def test_the_figures_ingest_writes_for_an_off_schedule_step_are_the_workers():
    from service.jobs.reasoning import reasoning_summary
    from service.jobs.reward_figures import batch_figures
    from service.jobs.rollouts import score_rollouts
    from service.settings import Settings
    from service.snapshot import RunSnapshot

    payload = batch({0: [1.0, 0.0], 1: [0.5, None]}).model_copy(update={"step": 2})
    run = RunSnapshot.model_validate(
        {
            "id": 1,
            "name": "r",
            "scorer": "tiny-random",
            "scorer_mode": "reference",
            "score_every": 3,
            "samplers": ("first_turn",),
            "num_samples": None,
            "seed": 0,
            "temperature": 1.0,
            "filter": FilterSettings().model_dump(),
            "alerts": {},
        }
    )
    ours = batch_figures(payload, run, reasoning_summary(payload, run.reasoning_extraction))
    workers = score_rollouts(payload, run, {}, lambda: pytest.fail("no scorer is needed"), Settings(_env_file=None))
    assert ours.points == workers.points
    assert ours.result == workers.result
