"""SNR-aware filtering: keep the prompt groups whose rewards spread the most (RAGEN ``rollout_filter``).

Low reward variance within a group gives policy-gradient updates a weak signal relative to noise,
which RAGEN-2 identifies as the driver of template collapse. This module computes each group's
reward statistics and reproduces RAGEN's group selection. Two deliberate differences, both at
edges RAGEN leaves undefined: groups may have different sizes, and a group of one sample (whose
n-1 std RAGEN would make NaN) is given spread 0 and listed in ``single_sample_groups``. Ties are
broken towards the lower group index. A reward that is not a finite number is refused.

Beside it, ``upstream_select``: the selection of the upstream pull requests RAGEN's authors opened
for verl, TRL and SkyRL (ranked by reward variance, see ``UpstreamFilterConfig``). The client's
``collapse_monitor.snr_filter`` carries a pure-Python copy of both selections, for the trainer;
tests/unit/test_snr_filter_copies.py holds the two copies to the same answers. Must not import
service/.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

Strategy = Literal["top_p", "top_k", "top_k_abs", "min_p"]
FilterType = Literal["largest", "smallest"]
TopPMode = Literal["linear", "softmax"]
# RAGEN ranks by the group std under the name "reward_variance"; "reward_std" is its alias.
Metric = Literal["reward_variance", "reward_std", "reward", "reward_sum"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
FILTER_TYPES: tuple[FilterType, ...] = get_args(FilterType)
TOP_P_MODES: tuple[TopPMode, ...] = get_args(TopPMode)
METRICS: tuple[Metric, ...] = get_args(Metric)
ZERO_SPREAD = 1e-10  # RAGEN's bound for "this score is zero"
UPSTREAM_STRATEGIES = ("top_p", "top_k")


@dataclass(frozen=True)
class FilterConfig:
    """RAGEN's rollout-filter settings, with its defaults."""

    strategy: Strategy = "top_p"
    value: float = 0.9
    filter_type: FilterType = "largest"
    include_zero: bool = True
    top_p_prob_mode: TopPMode = "linear"
    selection_eps: float = 0.01
    metric: Metric = "reward_variance"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("strategy", STRATEGIES),
            ("filter_type", FILTER_TYPES),
            ("top_p_prob_mode", TOP_P_MODES),
            ("metric", METRICS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not self.value >= 0:
            raise ValueError(f"value must be >= 0, got {self.value}")


@dataclass(frozen=True)
class GroupStats:
    """[G] per-group reward statistics; std uses n-1 and is 0 for single-sample groups."""

    std: np.ndarray
    mean: np.ndarray
    max: np.ndarray
    sum: np.ndarray
    sizes: np.ndarray


@dataclass(frozen=True)
class FilterResult:
    selected_groups: list[int]
    kept_row_indices: list[int]
    group_reward_std: list[float]
    metrics: dict[str, float]
    single_sample_groups: list[int]
    warnings: list[str]


def group_stats(rewards: Sequence[Sequence[float]]) -> GroupStats:
    """Each group's statistics, computed for all groups of one size at once ([n_groups, size] blocks).

    Naive equivalent (the same numbers bit for bit: numpy reduces each row of a block as it
    reduces a 1-D array, and the per-group calls cost ~35 us each, 7 s for 200,000 groups)::

        g = np.asarray(rewards[i]); std[i] = g.std(ddof=1) if g.size > 1 else 0.0; mean[i] = g.mean(); ...
    """
    sizes = _check_rewards(rewards)
    std, mean, high, total = (np.empty(len(rewards)) for _ in range(4))
    for members, block in _size_blocks(rewards, sizes):
        std[members] = block.std(axis=1, ddof=1) if block.shape[1] > 1 else 0.0
        mean[members], high[members], total[members] = block.mean(axis=1), block.max(axis=1), block.sum(axis=1)
    return GroupStats(std=std, mean=mean, max=high, sum=total, sizes=sizes)


def _check_rewards(rewards: Sequence[Sequence[float]]) -> np.ndarray:
    """[G] the group sizes; ValueError for no group, an empty group or a reward that is not a finite number."""
    if not rewards:
        raise ValueError("rewards must hold at least one group, got 0")
    for g, group in enumerate(rewards):
        if not group:
            raise ValueError(f"rewards[{g}] must hold at least one reward, got 0")
        for i, reward in enumerate(group):
            if not math.isfinite(reward):
                raise ValueError(
                    f"rewards[{g}][{i}] must be a finite number, got {reward}: leave a missing reward out of its group"
                )
    return np.array([len(group) for group in rewards], dtype=np.int64)


def _size_blocks(rewards: Sequence[Sequence[float]], sizes: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(group indices, [n, size] float64 block of their rewards) for each group size."""
    order = np.argsort(sizes, kind="stable")
    starts = np.flatnonzero(np.diff(sizes[order], prepend=-1))  # where each size's run of groups begins
    for members in np.split(order, starts[1:]):
        yield members, np.array([rewards[g] for g in members], dtype=np.float64)


def filter_groups(rewards: Sequence[Sequence[float]], config: FilterConfig) -> FilterResult:
    """Selects groups as RAGEN's reward filter does and reports its ``rollout/...`` metrics.

    Args:
        rewards: one list of rewards per group (group g's rollouts).
        config: the selection rule.

    Returns:
        The kept groups (ascending), their rows numbered group-major, each group's reward std,
        RAGEN's metrics, and warnings for anything degenerate.
    """
    stats = group_stats(rewards)
    scores = {"reward": stats.mean, "reward_sum": stats.sum}.get(config.metric, stats.std)
    selected = sorted(select_groups(scores, config))
    offsets = np.concatenate([[0], np.cumsum(stats.sizes)])
    kept_rows = [int(r) for g in selected for r in range(offsets[g], offsets[g + 1])]
    singles = [int(g) for g in np.flatnonzero(stats.sizes == 1)]
    warnings = []
    if singles:
        warnings.append(f"groups {singles} have a single sample: no reward spread, std taken as 0")
    n_zero = int((np.abs(scores) <= ZERO_SPREAD).sum())
    if n_zero == len(scores):
        warnings.append(f"all {len(scores)} groups score 0 on {config.metric}: there is no learning signal to rank")
    if not selected:
        warnings.append("the filter keeps no group")
    return FilterResult(
        selected_groups=selected,
        kept_row_indices=kept_rows,
        group_reward_std=[float(s) for s in stats.std],
        metrics=filter_metrics(stats, selected, n_zero),
        single_sample_groups=singles,
        warnings=warnings,
    )


def select_groups(scores: np.ndarray, config: FilterConfig) -> list[int]:
    """Indices of the groups RAGEN's ``_select_top_groups`` keeps, in selection order.

    The arithmetic is float32 as in RAGEN (it casts scores with ``.float()``), so that knife-edge
    comparisons (``min_p``'s 1e-10 margins, the ``top_p`` threshold) come out as RAGEN's do.
    """
    scores = np.asarray(scores, dtype=np.float32)
    n_groups = len(scores)
    indices = np.arange(n_groups)
    if not config.include_zero:
        nonzero = np.abs(scores) > ZERO_SPREAD
        scores, indices = scores[nonzero], indices[nonzero]
        if indices.size == 0:
            return []
    # Stable sorts of the (negated) scores rank ties by lower group index.
    order = np.argsort(-scores if config.filter_type == "largest" else scores, kind="stable")
    kept = _SELECTORS[config.strategy](scores, order, config, n_groups)
    return [int(i) for i in indices[kept]]


def _top_p(scores: np.ndarray, order: np.ndarray, config: FilterConfig, _n_groups: int) -> np.ndarray:
    """The best groups until they carry ``value`` of the total score (linear) or probability (softmax)."""
    value = np.float32(config.value)
    if config.value >= 1.0:
        return np.arange(scores.size)
    if config.top_p_prob_mode == "softmax":
        logits = scores if config.filter_type == "largest" else -scores
        # exp in float64, rounded once: the correctly rounded float32 exp, which the client's pure-Python copy
        # reproduces bit for bit (numpy's and torch's float32 exp are within an ulp or two of it).
        probs = np.exp((logits - logits.max()).astype(np.float64)).astype(np.float32)
        probs /= probs.sum(dtype=np.float32)
        by_prob = np.argsort(-probs, kind="stable")
        cutoff = int(np.searchsorted(np.cumsum(probs[by_prob], dtype=np.float32), value, side="left"))
        return by_prob[: min(cutoff + 1, scores.size)]
    threshold = value * scores.sum(dtype=np.float32) - np.float32(config.selection_eps)
    total, taken = 0.0, 0
    for score in scores[order]:
        if np.float32(total) >= threshold or score <= 0:
            break
        total += float(score)
        taken += 1
    return order[:taken] if np.float32(total) >= threshold else order[:0]


def _top_k(scores: np.ndarray, order: np.ndarray, config: FilterConfig, n_groups: int) -> np.ndarray:
    """The best k groups: top_k is a fraction of all groups (counted before zero-spread groups were
    dropped), top_k_abs a count; at least one group is kept."""
    k = int(config.value * n_groups) if config.strategy == "top_k" else int(config.value)
    return order[: max(min(k, scores.size), 1)]


def _min_p(scores: np.ndarray, _order: np.ndarray, config: FilterConfig, _n_groups: int) -> np.ndarray:
    """Every group within ``value`` of the best score (a ratio of it)."""
    if config.filter_type == "largest":
        keep = scores >= scores.max() * np.float32(config.value) - np.float32(ZERO_SPREAD)
    else:
        keep = scores <= scores.min() / np.float32(config.value + ZERO_SPREAD) + np.float32(ZERO_SPREAD)
    return np.flatnonzero(keep)


_SELECTORS = {"top_p": _top_p, "top_k": _top_k, "top_k_abs": _top_k, "min_p": _min_p}


def filter_metrics(stats: GroupStats, selected: Sequence[int], n_zero: int) -> dict[str, float]:
    """RAGEN's ``rollout/...`` figures; a mean over no chosen group is 0, as in RAGEN."""
    chosen = np.asarray(selected, dtype=np.int64)

    def chosen_mean(values: np.ndarray) -> float:
        return float(values[chosen].mean()) if chosen.size else 0.0

    metrics: dict[str, float] = {}
    for name, values in (("std", stats.std), ("mean", stats.mean), ("max", stats.max), ("sum", stats.sum)):
        metrics[f"rollout/in_group_reward_{name}"] = float(values.mean())
        metrics[f"rollout/chosen_in_group_reward_{name}"] = chosen_mean(values)
    for name, values in (("std", stats.std), ("mean", stats.mean), ("max", stats.max)):
        metrics[f"rollout/in_group_{name}"] = float(values.mean())
        metrics[f"rollout/chosen_in_group_{name}"] = chosen_mean(values)
    n_groups = len(stats.std)
    metrics["rollout/filter_kept_count"] = float(chosen.size)
    metrics["rollout/filter_kept_ratio"] = chosen.size / n_groups
    metrics["rollout/filter_zero_count"] = float(n_zero)
    return dict(sorted(metrics.items()))


@dataclass(frozen=True)
class UpstreamFilterConfig:
    """The selection of the upstream pull requests (verl #7894, TRL #7242, SkyRL #2217), with their defaults.

    Groups are ranked by their sample reward variance (``ddof``) in a stable sort (ties keep group
    order). ``top_p`` keeps the shortest prefix whose cumulative variance reaches ``value * total -
    selection_eps`` (none when that target is not positive); ``top_k`` keeps ``value`` groups (a count).
    Zero-variance groups are candidates only with ``include_zero``, so at ``top_p`` 1 they are dropped;
    a batch without any variance keeps every group with ``include_zero`` (``top_k``: the first
    ``value``), none without.
    """

    strategy: str = "top_p"
    value: float = 0.9
    include_zero: bool = False
    ddof: int = 1
    selection_eps: float = 0.01

    def __post_init__(self) -> None:
        if self.strategy not in UPSTREAM_STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(UPSTREAM_STRATEGIES)}, got {self.strategy!r}")
        if self.strategy == "top_p" and not 0 < self.value <= 1:
            raise ValueError(f"value must be in (0, 1] for top_p (a share of the variance), got {self.value}")
        if self.strategy == "top_k" and not (self.value >= 1 and float(self.value).is_integer()):
            raise ValueError(f"value must be a whole number of groups >= 1 for top_k, got {self.value}")
        if not (isinstance(self.ddof, int) and self.ddof >= 0):
            raise ValueError(f"ddof must be a whole number >= 0, got {self.ddof!r}")
        if not self.selection_eps >= 0:
            raise ValueError(f"selection_eps must be >= 0, got {self.selection_eps}")


def group_variances(rewards: Sequence[Sequence[float]], ddof: int) -> np.ndarray:
    """[G] each group's reward variance with ``ddof`` (0 for a group of at most ``ddof`` rewards), float64.

    Naive equivalent: ``np.var(rewards[g], ddof=ddof) if len(rewards[g]) > ddof else 0.0``.
    """
    sizes = _check_rewards(rewards)
    variances = np.zeros(len(rewards))
    for members, block in _size_blocks(rewards, sizes):
        if block.shape[1] > ddof:
            variances[members] = block.var(axis=1, ddof=ddof)
    return variances


def upstream_select(rewards: Sequence[Sequence[float]], config: UpstreamFilterConfig) -> list[int]:
    """The groups the upstream pull requests keep (ascending); see ``UpstreamFilterConfig``."""
    variances = [float(v) for v in group_variances(rewards, config.ddof)]
    total = 0.0
    for v in variances:  # in order, one addition at a time (Python 3.12's sum() compensates; 3.9's does not)
        total += v
    n_groups = len(variances)
    k = int(config.value)
    if total <= 0.0:
        if not config.include_zero:
            return []
        return list(range(min(k, n_groups))) if config.strategy == "top_k" else list(range(n_groups))
    if config.strategy == "top_p" and config.include_zero and config.value == 1.0:
        return list(range(n_groups))
    candidates = [g for g in range(n_groups) if config.include_zero or variances[g] > 0.0]
    candidates.sort(key=lambda g: variances[g], reverse=True)  # stable: ties keep group order
    if config.strategy == "top_k":
        return sorted(candidates[:k])
    target = config.value * total - config.selection_eps
    kept: list[int] = []
    cumulative = 0.0
    if target > 0.0:
        for g in candidates:  # the cut searchsorted(cumsum, target, side="left") + 1 makes
            kept.append(g)
            cumulative += variances[g]
            if cumulative >= target:
                break
    return sorted(kept)
