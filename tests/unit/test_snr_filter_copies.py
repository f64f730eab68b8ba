"""The SNR filter's selections: each variant on reference cases taken from its source's own code, and the two
copies of ragen's and upstream's, scoring/snr_filter.py (the service) and the client's pure-Python one (the
trainer), on the same cases.

The copies are fed the reference cases, then random batches with ties, zero-spread groups, single-sample groups,
single-group batches, groups longer than numpy's pairwise block, and rewards from 1e-3 to 1e3. Any disagreement,
in the kept groups or in a group's spread, fails. vagen has one copy (the client's): it is held to VAGEN's cases
and to a naive numpy oracle of the same rules.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from collapse_monitor.snr_filter import SNRFilter, _f32, _pairwise, step_figures

from scoring.snr_filter import FilterConfig, UpstreamFilterConfig, filter_groups, group_stats, upstream_select

SPREAD = [[0, 1], [0, 3], [5, 5]]  # std (n-1): 0.7071, 2.1213, 0; means 0.5, 1.5, 5; sums 1, 3, 10
TIED = [[0, 1], [0, 1], [0, 2]]

# (rewards, RAGEN settings, groups kept): the cases of tests/unit/test_snr_filter.py, computed by hand there, and
# each checked against RAGEN's own selection: mll-lab-nu/RAGEN ragen/trainer/rollout_filter.py at commit
# cdc052b8c6b2bd71f5f55b4abb2abb901aaaeeaa (unchanged at 20daedc47558e000f7de912b060646bf2e8026bd),
# RolloutFilter._select_top_groups fed each group's torch std (n-1), mean or sum. Every case agreed.
RAGEN_REFERENCE = [
    ([[1, 0, 1], [1, 1, 1], [0, 0.5, 1], [3]], {}, [0, 2]),
    (SPREAD, {"value": 1.0}, [0, 1, 2]),
    (SPREAD, {"value": 1.0, "include_zero": False}, [0, 1]),
    (SPREAD, {"value": 0.5}, [1]),
    (SPREAD, {"value": 0.9}, [0, 1]),
    (SPREAD, {"value": 0.9, "filter_type": "smallest"}, []),
    ([[1, 1], [2, 2]], {"value": 0.9}, []),
    (SPREAD, {"value": 0.9, "top_p_prob_mode": "softmax"}, [0, 1]),
    (SPREAD, {"value": 0.5, "top_p_prob_mode": "softmax"}, [1]),
    (SPREAD, {"value": 0.5, "top_p_prob_mode": "softmax", "filter_type": "smallest"}, [2]),
    (SPREAD, {"strategy": "top_k", "value": 0.67}, [0, 1]),
    (SPREAD, {"strategy": "top_k", "value": 0.34}, [1]),
    (SPREAD, {"strategy": "top_k", "value": 0.1}, [1]),
    (SPREAD, {"strategy": "top_k", "value": 1.0, "include_zero": False}, [0, 1]),
    (TIED, {"strategy": "top_k_abs", "value": 2}, [0, 2]),
    (TIED, {"strategy": "top_k_abs", "value": 1, "filter_type": "smallest"}, [0]),
    (SPREAD, {"strategy": "min_p", "value": 0.5}, [1]),
    (SPREAD, {"strategy": "min_p", "value": 0.3}, [0, 1]),
    (SPREAD, {"strategy": "min_p", "value": 0.5, "filter_type": "smallest", "include_zero": False}, [0]),
    (SPREAD, {"strategy": "top_k_abs", "value": 1, "metric": "reward"}, [2]),
    (SPREAD, {"strategy": "top_k_abs", "value": 1, "metric": "reward_sum"}, [2]),
    (SPREAD, {"value": 0.5, "metric": "reward_sum"}, [2]),
    ([[1, 1], [-1, -1]], {"value": 0.9, "metric": "reward"}, []),
    (SPREAD, {"value": 0.9, "metric": "reward_std"}, [0, 1]),
    ([[1, 2, 3], [4], [5, 9]], {"strategy": "top_k_abs", "value": 1}, [2]),
    # The example: stds 3, 1, 1 (times sqrt 2): RAGEN keeps all three at top_p 0.9.
    ([[0, 6], [0, 2], [0, 2]], {"value": 0.9}, [0, 1, 2]),
    # Knife edges of RAGEN's float32 arithmetic, where the same steps in float64 keep other groups (found by
    # search): a spread of 1e-10 against the zero bound cast to float32; the top_p threshold 0.2 * 1.7678 in
    # float32; the min_p bound 0.2 * 1.7678 - 1e-10 in float32.
    (
        [[2, 0.3, 2, 0.5], [0.5, 2e-10], [0, 2e-10, 1e-10], [0.5, 0, 0.3]],
        {"value": 0.3, "include_zero": False, "top_p_prob_mode": "softmax", "filter_type": "smallest"},
        [3],
    ),
    (
        [[1e-10, 0.5], [1, 3]],
        {"value": 0.2, "selection_eps": 0.0, "include_zero": False, "filter_type": "smallest"},
        [0],
    ),
    (
        [[2e-10, 2, 0.5, 0], [3, 0.1, 3], [0.5, 1], [3, 0.5], [0.5, 0.3, 0.3]],
        {"strategy": "min_p", "value": 0.2, "include_zero": False},
        [0, 1, 2, 3],
    ),
]

# (rewards, upstream settings, groups kept): variances (ddof 1) in the comments. The cases marked "PR" are the
# pull request's own tests (verl-project/verl #7894: tests/trainer/ppo/test_reward_variance_filter_on_cpu.py at
# commit 52af575ec9e1bec0bf6583b9db4ee39f5626ac42, for verl/trainer/ppo/reward_variance_filter.py at
# a9772ca7226340db6b0a3b0846de53da873230e8), their uids numbered in first-seen order; the rest were computed by hand
# from that file's get_reward_variance_filter_mask.
UPSTREAM_REFERENCE = [
    ([[0, 6], [0, 2], [0, 2]], {"value": 0.9}, [0, 1]),  # 18, 2, 2: 0.9 * 22 - 0.01 = 19.79 <= 18 + 2
    ([[-3, 3], [-2, 2], [-1, 1]], {"value": 0.8, "selection_eps": 0}, [0, 1]),  # PR: 18, 8, 2: 22.4 <= 26
    ([[-1, 1], [-1, 1]], {"value": 0.5, "selection_eps": 0}, [0]),  # PR: a tie, the first group seen
    ([[1, 1], [2, 2]], {}, []),  # PR: no variance at all, zeros not included: nothing
    ([[1, 1], [2, 2]], {"include_zero": True}, [0, 1]),  # PR: ... included: everything
    ([[1, 1], [2, 2], [3, 3]], {"strategy": "top_k", "value": 2, "include_zero": True}, [0, 1]),
    ([[-3, 3], [-2, 2], [-1, 1]], {"strategy": "top_k", "value": 2}, [0, 1]),  # PR
    ([[-1, 1], [0, 0], [1, 1]], {"strategy": "top_k", "value": 2}, [0]),  # PR: zeros are not candidates
    ([[-1, 1], [0, 0], [1, 1]], {"strategy": "top_k", "value": 2, "include_zero": True}, [0, 1]),  # PR
    ([[0, 0.1]], {"value": 0.9}, []),  # PR: 0.005: the target 0.9 * 0.005 - 0.01 is not positive
    ([[-3, 3], [-1, 1]], {"value": 0.7, "selection_eps": 0}, [0]),  # PR (its DataProto case): 18, 2: 14 <= 18
    ([[-1, 1], [0, 0]], {"value": 1.0}, [0]),  # top_p 1 drops the zero-variance group
    ([[-1, 1], [0, 0]], {"value": 1.0, "include_zero": True}, [0, 1]),
    ([[0, 1, 2], [0, 2]], {"value": 0.5, "ddof": 0}, [1]),  # ddof 0: 2/3 and 1
]


# (rewards, vagen settings, groups kept, the kept rows' advantage scale): each the answer of VAGEN's own
# reward_variance_top_p_filter (mll-lab-nu/VAGEN vagen/custom_filter/filter.py at commit
# 8036390c35f40f811ed9ae905c6c90cc61d4c251, unchanged at 2936322a6f6c02fbd29ca28e4b6ec37eefefc081) run on a verl
# DataProto holding these rewards as token_level_scores, a uid per group and advantages of 1: the groups of the rows
# it returned and the advantage they came back with. Variances (ddof 0) in the comments.
VAGEN_REFERENCE = [
    ([[0, 6], [0, 2], [0, 2]], {}, [0, 1], math.sqrt(2 / 3)),  # 9, 1, 1: 9 < 9.9, 10 >= 9.9 (stds 3, 1, 1 x sqrt 2)
    ([[1, 1], [2, 2]], {}, [0, 1], 1.0),  # no variance at all: every group, unscaled
    ([[0, 0.1]], {}, [0], 1.0),  # no slack: a tiny variance still trains (upstream keeps nothing here)
    ([[0, 0.1], [0, 0]], {}, [0], math.sqrt(1 / 2)),
    ([[0, 1, 2], [0, 2]], {"value": 0.5}, [1], math.sqrt(1 / 2)),  # 2/3, 1: ddof 0 ranks the pair first
    ([[0, 6], [0, 2], [0, 2]], {"ddof": 1}, [0, 1], math.sqrt(2 / 3)),  # 18, 2, 2
    ([[-1, 1], [0, 0], [1, 1]], {"value": 1.0}, [0], math.sqrt(1 / 3)),  # top_p 1 stops once the total is reached
    ([[0, 1], [0, 1], [5, 5], [0, 0, 0, 1]], {}, [0, 1, 3], math.sqrt(3 / 4)),  # 0.25, 0.25, 0, 0.1875
    ([[0, 1], [0, 1], [5, 5], [0, 0, 0, 1]], {"value": 0.5}, [0, 1], math.sqrt(1 / 2)),  # a tie, both under target
    ([[0, 1], [0, 1]], {"value": 0.5}, [0], math.sqrt(1 / 2)),  # a tie: the first group seen
    ([[0, 1], [0, 1], [0, 1]], {}, [0, 1, 2], 1.0),  # equal groups: 0.5 < 0.675, so all three
    ([[-3, 3], [-2, 2], [-1, 1]], {"value": 0.8}, [0, 1], math.sqrt(2 / 3)),  # 9, 4, 1: 9 < 11.2 <= 13
    ([[3], [0, 1]], {}, [1], math.sqrt(1 / 2)),  # a single reward has variance 0
    ([[1, 0, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], {}, [0, 1], math.sqrt(1 / 2)),  # binary rewards
    ([[2, 2, 2], [0, 1, 0, 1, 0, 1, 0, 1]], {}, [1], math.sqrt(1 / 2)),  # groups of different sizes
]


def scoring_ragen(rewards, settings):
    return filter_groups(rewards, FilterConfig(**settings)).selected_groups


def scoring_upstream(rewards, settings):
    config = {k: settings[k] for k in ("strategy", "value", "include_zero", "ddof", "selection_eps") if k in settings}
    return upstream_select(rewards, UpstreamFilterConfig(**config))


def client(rewards, settings, variant):
    return SNRFilter(variant=variant, **settings).select(rewards)


@pytest.mark.parametrize(("rewards", "settings", "kept"), RAGEN_REFERENCE)
def test_both_copies_keep_ragens_reference_groups(rewards, settings, kept):
    assert scoring_ragen(rewards, settings) == kept
    assert client(rewards, settings, "ragen").kept_groups == kept


@pytest.mark.parametrize(("rewards", "settings", "kept"), UPSTREAM_REFERENCE)
def test_both_copies_keep_the_upstream_reference_groups(rewards, settings, kept):
    assert scoring_upstream(rewards, settings) == kept
    assert client(rewards, settings, "upstream").kept_groups == kept


@pytest.mark.parametrize(("rewards", "settings", "kept", "scale"), VAGEN_REFERENCE)
def test_the_client_keeps_vagens_reference_groups_and_scales_their_advantages_as_vagen(rewards, settings, kept, scale):
    selection = client(rewards, settings, "vagen")
    assert selection.kept_groups == kept
    assert selection.advantage_scale == pytest.approx(scale, rel=1e-15)
    assert naive_vagen(rewards, SNRFilter(variant="vagen", **settings)) == kept


def naive_vagen(rewards, snr: SNRFilter) -> list[int]:
    """vagen's rules in numpy, one step at a time: the oracle for the client's copy on random batches."""
    ddof = snr.variance_ddof
    variances = np.array([np.var(g, ddof=ddof) if len(g) > ddof else 0.0 for g in rewards])
    total = 0.0
    for v in variances:
        total += float(v)
    if total <= 0:
        return list(range(len(rewards)))
    order = np.argsort(-variances, kind="stable")
    below = np.concatenate([[0.0], np.cumsum(variances[order])[:-1]]) < snr.value * total  # sum before each
    return sorted(int(g) for g in order[: int(np.argmin(below)) if not below.all() else len(order)])


@pytest.mark.parametrize("seed", range(10))
def test_the_clients_vagen_selection_agrees_with_the_naive_one_on_random_batches(seed):
    rng = random.Random(seed)
    for _ in range(50):
        rewards = random_rewards(rng)
        value = rng.choice([1.0, 0.9, 0.5, rng.uniform(0.01, 1.0)])
        snr = SNRFilter(variant="vagen", value=value, ddof=rng.choice([None, 0, 1, 2]))
        selection = snr.select(rewards)
        assert selection.kept_groups == naive_vagen(rewards, snr), (rewards, value, snr.ddof)
        assert selection.advantage_scale == math.sqrt(len(selection.kept_groups) / len(rewards))


def random_rewards(rng: random.Random) -> list[list[float]]:
    """A batch with the shapes that break copies: ties, zero spread, one sample, one group, long groups."""
    n_groups = rng.choice([1, 1, 2, 3, 5, 8, 17, 40])
    groups: list[list[float]] = []
    for _ in range(n_groups):
        kind = rng.random()
        size = rng.choice([1, 2, 3, 4, 8, 9, 16, 200]) if rng.random() < 0.3 else rng.choice([2, 4, 8])
        scale = 10.0 ** rng.randint(-3, 3)
        if kind < 0.15 and groups:
            groups.append(list(rng.choice(groups)))  # a tie with an earlier group
        elif kind < 0.25 and groups:
            groups.append(list(reversed(rng.choice(groups))))  # the same rewards in another order
        elif kind < 0.4:
            groups.append([rng.choice([0.0, 1.0, -0.5, scale])] * size)  # no spread
        elif kind < 0.6:
            groups.append([float(rng.randint(0, 1)) for _ in range(size)])  # binary, as most tasks
        else:
            groups.append([rng.gauss(0, 1) * scale for _ in range(size)])
    return groups


def random_ragen_settings(rng: random.Random, n_groups: int) -> dict:
    strategy = rng.choice(["top_p", "top_p", "top_k", "top_k_abs", "min_p"])
    value = {
        "top_p": rng.choice([1.0, 0.9, 0.5, rng.uniform(0.01, 1.0)]),
        "top_k": rng.choice([1.0, 0.5, rng.uniform(0.01, 1.0)]),
        "top_k_abs": float(rng.randint(1, max(1, n_groups + 1))),
        "min_p": rng.choice([1.0, 0.5, rng.uniform(0.01, 1.0)]),
    }[strategy]
    return {
        "strategy": strategy,
        "value": value,
        "filter_type": rng.choice(["largest", "largest", "smallest"]),
        "include_zero": rng.choice([True, False]),
        "top_p_prob_mode": rng.choice(["linear", "linear", "softmax"]),
        "selection_eps": rng.choice([0.01, 0.0, 0.1]),
        "metric": rng.choice(["reward_variance", "reward_variance", "reward_std", "reward", "reward_sum"]),
    }


def random_upstream_settings(rng: random.Random, n_groups: int) -> dict:
    strategy = rng.choice(["top_p", "top_p", "top_k"])
    value = float(rng.randint(1, n_groups + 1)) if strategy == "top_k" else rng.choice([1.0, 0.9, rng.uniform(0.01, 1)])
    return {
        "strategy": strategy,
        "value": value,
        "include_zero": rng.choice([True, False]),
        "ddof": rng.choice([1, 1, 0, 2]),
        "selection_eps": rng.choice([0.01, 0.0, 0.1]),
    }


@pytest.mark.parametrize("seed", range(40))
def test_both_copies_agree_on_random_batches(seed):
    rng = random.Random(seed)
    for _ in range(50):
        rewards = random_rewards(rng)
        ragen = random_ragen_settings(rng, len(rewards))
        kept = client(rewards, ragen, "ragen")
        assert kept.kept_groups == scoring_ragen(rewards, ragen), (rewards, ragen)
        assert list(kept.spreads) == [float(s) for s in group_stats(rewards).std]  # bit for bit
        upstream = random_upstream_settings(rng, len(rewards))
        assert client(rewards, upstream, "upstream").kept_groups == scoring_upstream(rewards, upstream), (
            rewards,
            upstream,
        )


@pytest.mark.parametrize("seed", range(5))
def test_the_client_sums_as_numpy_does_in_float64_and_float32(seed):
    rng = np.random.default_rng(seed)
    for n in [1, 7, 8, 9, 15, 16, 127, 128, 129, 255, 256, 1000]:
        values = rng.normal(size=n) * 10.0 ** rng.integers(-3, 4)
        assert _pairwise(list(values), float) == float(values.sum())
        singles = values.astype(np.float32)
        assert _pairwise([float(v) for v in singles], _f32) == float(singles.sum(dtype=np.float32))


def test_float32_rounding_matches_numpys_cast_and_overflows_to_infinity():
    rng = np.random.default_rng(0)
    doubles = rng.normal(size=10_000) * 10.0 ** rng.integers(-40, 39, size=10_000)
    assert [_f32(float(d)) for d in doubles] == [float(f) for f in doubles.astype(np.float32)]
    assert _f32(1e39) == math.inf
    assert _f32(-1e39) == -math.inf


@pytest.mark.parametrize("variant", ["ragen", "upstream"])
def test_a_reward_that_is_not_a_finite_number_is_refused_by_both_copies(variant):
    rewards = [[1.0, 0.0], [float("nan"), 1.0]]
    message = r"rewards\[1\]\[0\] must be a finite number, got nan: leave a missing reward out of its group"
    with pytest.raises(ValueError, match=message):
        SNRFilter(variant=variant).select(rewards)
    with pytest.raises(ValueError, match=message):
        scoring_ragen(rewards, {}) if variant == "ragen" else scoring_upstream(rewards, {})


def test_the_step_figures_count_kept_groups_rows_and_the_spread_of_kept_and_dropped():
    selection = SNRFilter(value=0.9).select([[0, 1], [0, 3], [5, 5, 5]])  # keeps groups 0 and 1
    figures = step_figures([(selection, True)])
    assert figures == {
        "rollout/filter_engaged": 1.0,
        "rollout/filter_kept_count": 2.0,
        "rollout/filter_kept_ratio": 2 / 3,
        "rollout/filter_kept_rows": 4.0,
        "rollout/chosen_in_group_reward_std": pytest.approx((math.sqrt(0.5) + math.sqrt(4.5)) / 2),
        "rollout/dropped_in_group_reward_std": 0.0,
        "rollout/filter_skipped": 0.0,
    }
    # Not engaged: the step trained on every group, and nothing was dropped.
    idle = selection.figures(engaged=False)
    assert (idle["rollout/filter_engaged"], idle["rollout/filter_kept_ratio"], idle["rollout/filter_kept_rows"]) == (
        0.0,
        1.0,
        7.0,
    )
    assert "rollout/dropped_in_group_reward_std" not in idle
