"""SNR-aware filtering: every strategy on hand-computed cases, ties, zero spread, tiny groups."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scoring.snr_filter import FilterConfig, filter_groups, group_stats

SQRT_HALF = math.sqrt(0.5)
SPREAD = [[0, 1], [0, 3], [5, 5]]  # std (n-1): 0.7071, 2.1213, 0; means 0.5, 1.5, 5; sums 1, 3, 10


def select(rewards, **config):
    return filter_groups(rewards, FilterConfig(**config)).selected_groups


def test_group_statistics_use_n_minus_1_and_report_single_samples_as_no_spread():
    result = filter_groups([[1, 0, 1], [1, 1, 1], [0, 0.5, 1], [3]], FilterConfig())
    assert result.group_reward_std == pytest.approx([math.sqrt(1 / 3), 0.0, 0.5, 0.0])
    assert result.single_sample_groups == [3]
    assert result.warnings == ["groups [3] have a single sample: no reward spread, std taken as 0"]
    # Linear top-p 0.9: threshold 0.9 * 1.0774 - 0.01 = 0.9597, reached after groups 0 and 2.
    assert result.selected_groups == [0, 2]
    assert result.kept_row_indices == [0, 1, 2, 6, 7, 8]


def test_two_sample_groups_have_the_textbook_std():
    assert group_stats([[0, 1]]).std[0] == pytest.approx(SQRT_HALF)


def naive_group_stats(rewards):
    """One numpy call per group and statistic (what group_stats did before its size blocks): the oracle."""
    groups = [np.asarray(g, dtype=np.float64) for g in rewards]
    return (
        np.array([g.std(ddof=1) if g.size > 1 else 0.0 for g in groups]),
        np.array([g.mean() for g in groups]),
        np.array([g.max() for g in groups]),
        np.array([g.sum() for g in groups]),
        np.array([g.size for g in groups]),
    )


@pytest.mark.parametrize("seed", range(20))
def test_group_statistics_by_size_block_equal_the_per_group_ones_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    rewards = [
        list(rng.normal(size=int(rng.integers(1, 40))) * 10.0 ** rng.integers(-3, 4))
        for _ in range(int(rng.integers(1, 60)))
    ]
    stats = group_stats(rewards)
    got = (stats.std, stats.mean, stats.max, stats.sum, stats.sizes)
    for ours, naive in zip(got, naive_group_stats(rewards), strict=True):
        assert np.array_equal(ours, naive)


def test_top_p_at_one_keeps_everything_with_zeros_and_only_spread_without():
    assert select(SPREAD, value=1.0) == [0, 1, 2]
    assert select(SPREAD, value=1.0, include_zero=False) == [0, 1]


def test_linear_top_p_takes_groups_until_the_mass_is_reached():
    # threshold 0.5 * 2.8284 - 0.01 = 1.404: group 1 (2.1213) alone reaches it.
    assert select(SPREAD, value=0.5) == [1]
    # threshold 0.9 * 2.8284 - 0.01 = 2.536: groups 1 and 0.
    assert select(SPREAD, value=0.9) == [0, 1]
    assert select(SPREAD, value=0.9, filter_type="smallest") == []  # smallest first is group 2 with score 0: stop


def test_all_zero_spread_keeps_nothing_under_top_p_and_says_so():
    result = filter_groups([[1, 1], [2, 2]], FilterConfig(value=0.9))
    assert result.selected_groups == []
    assert result.metrics["rollout/filter_zero_count"] == 2
    assert result.metrics["rollout/filter_kept_ratio"] == 0.0
    assert result.metrics["rollout/chosen_in_group_reward_std"] == 0.0
    assert "all 2 groups score 0 on reward_variance: there is no learning signal to rank" in result.warnings
    assert "the filter keeps no group" in result.warnings


def test_softmax_top_p_keeps_until_the_cumulative_probability_reaches_value():
    # softmax(0.7071, 2.1213, 0) = 0.178, 0.734, 0.088; cumulative by rank: 0.734, 0.912, 1.
    assert select(SPREAD, value=0.9, top_p_prob_mode="softmax") == [0, 1]
    assert select(SPREAD, value=0.5, top_p_prob_mode="softmax") == [1]
    assert select(SPREAD, value=0.5, top_p_prob_mode="softmax", filter_type="smallest") == [2]


def test_top_k_takes_a_fraction_of_all_groups_at_least_one():
    assert select(SPREAD, strategy="top_k", value=0.67) == [0, 1]  # floor(2.01) = 2
    assert select(SPREAD, strategy="top_k", value=0.34) == [1]  # floor(1.02) = 1
    assert select(SPREAD, strategy="top_k", value=0.1) == [1]  # floor(0.3) = 0 -> at least 1


def test_top_k_counts_all_groups_even_when_zeros_are_dropped():
    # floor(1.0 * 3) = 3 of all groups, but only 2 have spread.
    assert select(SPREAD, strategy="top_k", value=1.0, include_zero=False) == [0, 1]


def test_top_k_abs_and_ties_go_to_the_lower_group_index():
    tied = [[0, 1], [0, 1], [0, 2]]  # std 0.7071, 0.7071, 1.4142
    assert select(tied, strategy="top_k_abs", value=2) == [0, 2]
    assert select(tied, strategy="top_k_abs", value=1, filter_type="smallest") == [0]
    assert select(tied, strategy="top_k_abs", value=0) == [2]  # at least one


def test_min_p_keeps_groups_close_to_the_best():
    assert select(SPREAD, strategy="min_p", value=0.5) == [1]  # >= 2.1213 * 0.5
    assert select(SPREAD, strategy="min_p", value=0.3) == [0, 1]  # >= 0.636
    # smallest: <= min / value; without zeros min is 0.7071, so keep <= 1.414.
    assert select(SPREAD, strategy="min_p", value=0.5, filter_type="smallest", include_zero=False) == [0]


def test_mean_and_sum_metrics_rank_by_reward_level():
    assert select(SPREAD, strategy="top_k_abs", value=1, metric="reward") == [2]
    assert select(SPREAD, strategy="top_k_abs", value=1, metric="reward_sum") == [2]
    # sums 1, 3, 10: threshold 0.5 * 14 - 0.01; group 2 alone reaches it.
    assert select(SPREAD, value=0.5, metric="reward_sum") == [2]
    # means 1 and -1 sum to 0: threshold -0.01 is met before any group is taken.
    assert select([[1, 1], [-1, -1]], value=0.9, metric="reward") == []


def test_reward_std_is_an_alias_of_reward_variance():
    assert select(SPREAD, value=0.9, metric="reward_std") == select(SPREAD, value=0.9, metric="reward_variance")


def test_rows_are_numbered_group_major_with_ragged_groups():
    result = filter_groups([[1, 2, 3], [4], [5, 9]], FilterConfig(strategy="top_k_abs", value=1))
    assert result.selected_groups == [2]
    assert result.kept_row_indices == [4, 5]


def test_metrics_are_ragens_names_and_means():
    result = filter_groups(SPREAD, FilterConfig(value=0.9))
    m = result.metrics
    assert m["rollout/in_group_reward_std"] == pytest.approx((SQRT_HALF + 3 * SQRT_HALF) / 3)
    assert m["rollout/in_group_std"] == m["rollout/in_group_reward_std"]
    assert m["rollout/in_group_reward_sum"] == pytest.approx(14 / 3)
    assert m["rollout/chosen_in_group_reward_mean"] == pytest.approx(1.0)
    assert m["rollout/chosen_in_group_reward_max"] == pytest.approx(2.0)
    assert m["rollout/filter_kept_count"] == 2
    assert m["rollout/filter_kept_ratio"] == pytest.approx(2 / 3)
    assert m["rollout/filter_zero_count"] == 1
    assert set(m) == {
        *(f"rollout/{p}in_group_reward_{s}" for p in ("", "chosen_") for s in ("std", "mean", "max", "sum")),
        *(f"rollout/{p}in_group_{s}" for p in ("", "chosen_") for s in ("std", "mean", "max")),
        "rollout/filter_kept_count",
        "rollout/filter_kept_ratio",
        "rollout/filter_zero_count",
    }


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"strategy": "top_q"}, "strategy must be one of top_p, top_k, top_k_abs, min_p, got 'top_q'"),
        ({"filter_type": "middle"}, "filter_type must be one of largest, smallest, got 'middle'"),
        ({"value": -0.1}, "value must be >= 0, got -0.1"),
        ({"metric": "entropy"}, "metric must be one of"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        FilterConfig(**config)


def test_empty_groups_are_refused():
    with pytest.raises(ValueError, match=r"rewards\[1\] must hold at least one reward, got 0"):
        group_stats([[1.0], []])
    with pytest.raises(ValueError, match="rewards must hold at least one group, got 0"):
        group_stats([])
