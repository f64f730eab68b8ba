"""SNR-aware filtering in the trainer: which prompt groups a step trains on, and when the filter acts.

``SNRFilter`` holds the settings; ``SNRFilter.select(rewards)`` ranks one generation batch's prompt
groups by the spread of their rewards and says which to keep, in one of two variants:

* ``"ragen"`` (the default): RAGEN's ``rollout_filter`` (``_select_top_groups``), whose numbers the
  service's ``/v1/filter`` advice gives: groups ranked by reward std (n-1; RAGEN calls the metric
  ``reward_variance``), strategies ``top_p`` (linear or softmax mass), ``top_k`` (a fraction of the
  groups), ``top_k_abs`` (a count), ``min_p``; float32 arithmetic as RAGEN's torch code.
* ``"upstream"``: the pull requests RAGEN's authors opened for verl (#7894), TRL (#7242) and SkyRL
  (#2217): groups ranked by reward *variance* (``ddof``), a stable sort and a cumulative cut for
  ``top_p``, ``top_k`` a count, zero-variance groups dropped unless ``include_zero`` (so at top_p 1
  too), float64 arithmetic.
* ``"vagen"``: the same lab's VAGEN (``vagen/custom_filter/filter.py``, ``reward_variance_top_p``):
  groups ranked by reward variance (``ddof`` 0 by default) in a stable sort, taken while their sum is
  below ``value * total`` (no slack), every group kept when no group's rewards vary, and the kept
  rows' advantages scaled by sqrt(kept groups / groups) (``Selection.advantage_scale``), which the
  integrations apply; VAGEN drops the rows, the integrations mask them with the loss normalised as if
  dropped.

Example: group stds [3, 1, 1] at top_p 0.9 keep 3 groups under RAGEN (threshold 0.9 * 5 - 0.01 =
4.49 is reached only by 3 + 1 + 1), 2 upstream (variances 9 + 1 = 10 reach 0.9 * 11 - 0.01) and 2
under vagen for groups of two (ddof-0 variances 4.5 < 0.9 * 5.5, 4.5 + 0.5 is not), advantages times
sqrt(2/3).

The ragen and upstream selections are a pure-Python copy of ``scoring/snr_filter.py`` (the client runs
where numpy may be absent): sums are taken in numpy's pairwise order and float32 steps are rounded as
numpy rounds them, so the two copies agree bit for bit; tests/unit/test_snr_filter_copies.py fails
when they do not. vagen's lives here alone (the service advises RAGEN's filter only); the same test
holds it to cases derived from VAGEN's own code.

When the filter acts (``engage``) is ``collapse_monitor.engagement``'s. Must not import the integrations,
httpx, numpy or torch.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from collapse_monitor.alerts import OPEN_STATES, STATES, check_filters

VARIANTS = ("ragen", "upstream", "vagen")
STRATEGIES = {"ragen": ("top_p", "top_k", "top_k_abs", "min_p"), "upstream": ("top_p", "top_k"), "vagen": ("top_p",)}
# Each variant's defaults where its source differs: the variance's ddof (RAGEN's std uses n-1 and no
# other), the slack subtracted from the top_p threshold (VAGEN has none).
DDOF = {"ragen": 1, "upstream": 1, "vagen": 0}
SELECTION_EPS = {"ragen": 0.01, "upstream": 0.01, "vagen": 0.0}
FILTER_TYPES = ("largest", "smallest")
TOP_P_MODES = ("linear", "softmax")
METRICS = ("reward_variance", "reward_std", "reward", "reward_sum")
ENGAGE = ("always", "on_alert")
DISENGAGE = ("never", "on_resolve")
ZERO_SPREAD = 1e-10  # RAGEN's bound for "this score is zero"
PW_BLOCK = 128  # numpy's pairwise-summation block

# The per-step series of what the filter did (RAGEN's names where it has them), sent with the step's batch.
ENGAGED = "rollout/filter_engaged"
KEPT_RATIO = "rollout/filter_kept_ratio"
KEPT_COUNT = "rollout/filter_kept_count"
KEPT_ROWS = "rollout/filter_kept_rows"
KEPT_SPREAD = "rollout/chosen_in_group_reward_std"
DROPPED_SPREAD = "rollout/dropped_in_group_reward_std"
# 1 when the engaged filter kept no group: TRL's step skips its update; verl's loop must skip it itself
SKIPPED = "rollout/filter_skipped"
FIGURE_NAMES = (ENGAGED, KEPT_RATIO, KEPT_COUNT, KEPT_ROWS, KEPT_SPREAD, DROPPED_SPREAD, SKIPPED)


@dataclass(frozen=True)
class SNRFilter:
    """Which prompt groups a training step keeps, by the spread of their rewards, and when that applies.

    Args:
        strategy: ragen: ``top_p``, ``top_k`` (a fraction of the groups), ``top_k_abs`` (a count),
            ``min_p``; upstream: ``top_p``, ``top_k`` (a count); vagen: ``top_p``.
        value: the top_p mass, the top_k fraction or count, or the min_p ratio.
        variant: ``"ragen"``, ``"upstream"`` or ``"vagen"`` (see the module docstring).
        engage: ``"always"``, or ``"on_alert"``: from the step after an alert of ``rules`` entered
            one of ``states`` (needs a monitor's alert watcher).
        rules, states: the alerts that engage the filter (``engage="on_alert"``); default TemplateCollapse
            firing: a collapse confirmed over the rule's ``window``. Not LowRewardSignal or pending by
            default: LowRewardSignal goes pending on one step with most groups at zero spread, which is
            usual early in binary-reward training, so engagement would start from a noisy step.
        disengage: ``"never"`` (the default: once engaged it stays engaged, as RAGEN runs the filter for
            the whole training; an episode resolved under the filter tends to come back without it), or
            ``"on_resolve"``: when every episode that engaged it resolved or was dropped.
        filter_type, top_p_prob_mode, metric: RAGEN's options (ragen only).
        include_zero: whether zero-spread groups may be kept; default True (RAGEN), False (upstream);
            not vagen's (it keeps every group when none spreads).
        selection_eps: slack subtracted from the top_p threshold; default 0.01 (ragen, upstream), 0 and
            only 0 for vagen.
        ddof: the variance's delta degrees of freedom; default 1 (upstream), 0 (vagen); RAGEN's std
            uses n-1 and nothing else.
        max_skipped_in_a_row: an engaged filter that keeps no group skips the step's update; training
            stops after this many skipped steps in a row (5, as RAGEN's trainer).

    Every setting is checked here, so a bad one fails where the filter is built or attached,
    never in the middle of training. The message names the setting.
    """

    strategy: str = "top_p"
    value: float = 0.9
    variant: str = "ragen"
    engage: str = "always"
    rules: tuple[str, ...] | None = ("TemplateCollapse",)
    states: tuple[str, ...] = ("firing",)
    disengage: str = "never"
    filter_type: str = "largest"
    include_zero: bool | None = None
    top_p_prob_mode: str = "linear"
    metric: str = "reward_variance"
    selection_eps: float | None = None
    ddof: int | None = None
    max_skipped_in_a_row: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.max_skipped_in_a_row, bool) or not isinstance(self.max_skipped_in_a_row, int):
            raise ValueError(f"SNRFilter max_skipped_in_a_row must be an int, got {self.max_skipped_in_a_row!r}")
        if self.max_skipped_in_a_row < 1:
            raise ValueError(f"SNRFilter max_skipped_in_a_row must be at least 1, got {self.max_skipped_in_a_row}")
        _one_of("variant", self.variant, VARIANTS)
        _one_of("strategy", self.strategy, STRATEGIES[self.variant], f" (variant {self.variant!r})")
        _one_of("engage", self.engage, ENGAGE)
        _one_of("disengage", self.disengage, DISENGAGE)
        _one_of("filter_type", self.filter_type, FILTER_TYPES)
        _one_of("top_p_prob_mode", self.top_p_prob_mode, TOP_P_MODES)
        _one_of("metric", self.metric, METRICS)
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise ValueError(f"SNRFilter value must be a finite number, got {self.value!r}")
        eps = self.selection_eps
        if eps is not None and not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0):
            raise ValueError(f"SNRFilter selection_eps must be a number >= 0, got {eps!r}")
        if self.ddof is not None and (isinstance(self.ddof, bool) or not isinstance(self.ddof, int) or self.ddof < 0):
            raise ValueError(f"SNRFilter ddof must be a whole number >= 0, got {self.ddof!r}")
        if self.include_zero is not None and not isinstance(self.include_zero, bool):
            raise ValueError(f"SNRFilter include_zero must be True, False or None, got {self.include_zero!r}")
        if self.variant == "ragen":
            self._check_ragen()
        else:
            self._check_variance_variant()
        rules = (self.rules,) if isinstance(self.rules, str) else self.rules
        states = (self.states,) if isinstance(self.states, str) else tuple(self.states)
        object.__setattr__(self, "rules", None if rules is None else tuple(rules))
        object.__setattr__(self, "states", states)
        check_filters(self.rules, self.states)  # an unknown state raises; an unknown rule is warned about
        if self.engage == "on_alert" and not self.states:
            raise ValueError(f"SNRFilter states must name at least one of {', '.join(STATES)} for engage='on_alert'")
        if self.disengage == "on_resolve" and not set(self.states) <= set(OPEN_STATES):
            raise ValueError(
                f"SNRFilter disengage='on_resolve' ends engagement at resolved or dropped: states must be among "
                f"{', '.join(OPEN_STATES)}, got {', '.join(self.states)}"
            )

    def _check_ragen(self) -> None:
        what = {"top_p": "a share of the total score", "top_k": "a share of the groups", "min_p": "a ratio of the best"}
        if self.strategy in what and not 0 < self.value <= 1:
            raise ValueError(
                f"SNRFilter value must be in (0, 1] for {self.strategy} ({what[self.strategy]}), got {self.value}"
            )
        if self.strategy == "top_k_abs" and not (self.value >= 1 and float(self.value).is_integer()):
            raise ValueError(f"SNRFilter value must be a whole number of groups >= 1 for top_k_abs, got {self.value}")
        if self.ddof not in (None, 1):
            raise ValueError(
                f"SNRFilter ddof applies to variants 'upstream' and 'vagen' only (RAGEN's std uses n-1), "
                f"got {self.ddof}"
            )

    def _check_variance_variant(self) -> None:
        """upstream's and vagen's settings: both rank by variance, with none of RAGEN's other options."""
        for name, default in (("filter_type", "largest"), ("top_p_prob_mode", "linear"), ("metric", "reward_variance")):
            if getattr(self, name) != default:
                raise ValueError(f"SNRFilter {name} applies to variant 'ragen' only, got {getattr(self, name)!r}")
        if self.variant == "vagen" and self.include_zero is not None:
            raise ValueError(
                "SNRFilter include_zero does not apply to variant 'vagen' (VAGEN ranks zero-spread groups last and "
                f"keeps every group when none spreads), got {self.include_zero!r}"
            )
        if self.variant == "vagen" and self.selection_eps not in (None, 0):
            raise ValueError(
                f"SNRFilter selection_eps does not apply to variant 'vagen' (VAGEN's top_p has no slack), "
                f"got {self.selection_eps}"
            )
        if self.strategy == "top_p" and not 0 < self.value <= 1:
            raise ValueError(f"SNRFilter value must be in (0, 1] for top_p (a share of the variance), got {self.value}")
        if self.strategy == "top_k" and not (self.value >= 1 and float(self.value).is_integer()):
            raise ValueError(f"SNRFilter value must be a whole number of groups >= 1 for top_k, got {self.value}")

    @property
    def keeps_zero_spread(self) -> bool:
        """``include_zero`` as given, else the variant's default (RAGEN and VAGEN True, upstream False)."""
        return self.include_zero if self.include_zero is not None else self.variant != "upstream"

    @property
    def variance_ddof(self) -> int:
        """``ddof`` as given, else the variant's (``DDOF``)."""
        return self.ddof if self.ddof is not None else DDOF[self.variant]

    @property
    def top_p_slack(self) -> float:
        """``selection_eps`` as given, else the variant's (``SELECTION_EPS``)."""
        return self.selection_eps if self.selection_eps is not None else SELECTION_EPS[self.variant]

    def select(self, rewards: Sequence[Sequence[float]], rows: Sequence[int] | None = None) -> Selection:
        """The groups to keep among ``rewards`` (one list of finite rewards per group).

        ``rows``: each group's rows, when some carry no reward (default: its number of rewards).

        Raises:
            ValueError: no group, an empty group, or a reward that is not a finite number (leave a
                missing reward out of its group).
        """
        groups = [[float(r) for r in group] for group in rewards]
        _check_rewards(groups)
        spreads = tuple(_std(group) for group in groups)
        if self.variant == "ragen":
            kept = set(_ragen_select(groups, spreads, self))
        elif self.variant == "upstream":
            kept = set(_upstream_select(groups, self))
        else:
            kept = set(_vagen_select(groups, self))
        sizes = tuple(rows) if rows is not None else tuple(len(g) for g in groups)
        # VAGEN scales the kept rows' advantages by sqrt(kept groups / groups) "to account for the reduced batch"
        scale = math.sqrt(len(kept) / len(groups)) if self.variant == "vagen" else 1.0
        return Selection(tuple(g in kept for g in range(len(groups))), spreads, sizes, scale)


@dataclass(frozen=True)
class Selection:
    """One batch's groups: which the filter keeps, their reward std (n-1, 0 for one reward), their rows, and
    the factor the kept rows' advantages are multiplied by when the filter acts (vagen's; 1 otherwise)."""

    kept: tuple[bool, ...]
    spreads: tuple[float, ...]
    sizes: tuple[int, ...]
    advantage_scale: float = 1.0

    @property
    def kept_groups(self) -> list[int]:
        return [g for g, keep in enumerate(self.kept) if keep]

    def figures(self, engaged: bool) -> dict[str, float]:
        """The step's series when this batch was its only one (see ``step_figures``)."""
        return step_figures([(self, engaged)])


def step_figures(batches: Sequence[tuple[Selection, bool]]) -> dict[str, float]:
    """The series of a step that trained on these generation batches (usually one), each with whether the
    filter was engaged for it: what the step trained on, every group of a batch the filter did not act on.

    ``rollout/filter_engaged`` is 1 when the filter acted on any of them; ``rollout/chosen_in_group_reward_std``
    the mean reward std of the kept groups (0 when none is kept, as RAGEN reports it);
    ``rollout/dropped_in_group_reward_std`` that of the dropped ones, absent when none was dropped.
    """
    kept = [k or not engaged for s, engaged in batches for k in s.kept]
    spreads = [x for s, _ in batches for x in s.spreads]
    sizes = [n for s, _ in batches for n in s.sizes]
    chosen = [x for x, k in zip(spreads, kept) if k]
    dropped = [x for x, k in zip(spreads, kept) if not k]
    figures = {
        ENGAGED: 1.0 if any(engaged for _, engaged in batches) else 0.0,
        KEPT_COUNT: float(len(chosen)),
        KEPT_RATIO: len(chosen) / len(kept) if kept else 0.0,
        KEPT_ROWS: float(sum(n for n, k in zip(sizes, kept) if k)),
        KEPT_SPREAD: _mean(chosen),
        SKIPPED: 1.0 if any(engaged and not any(s.kept) for s, engaged in batches) else 0.0,
    }
    if dropped:
        figures[DROPPED_SPREAD] = _mean(dropped)
    return figures


# The selections ---------------------------------------------------------------------------------


def _ragen_select(groups: list[list[float]], spreads: tuple[float, ...], f: SNRFilter) -> list[int]:
    """RAGEN's ``_select_top_groups`` (scoring.snr_filter.select_groups), in its float32 arithmetic."""
    if f.metric == "reward":
        scores = [_pairwise(g, float) / len(g) for g in groups]
    elif f.metric == "reward_sum":
        scores = [_pairwise(g, float) for g in groups]
    else:
        scores = list(spreads)
    scores = [_f32(s) for s in scores]
    n_groups = len(scores)
    indices = list(range(n_groups))
    if not f.keeps_zero_spread:
        zero = _f32(ZERO_SPREAD)  # numpy compares float32 scores with the bound in float32
        indices = [i for i in indices if abs(scores[i]) > zero]
        if not indices:
            return []
    scores = [scores[i] for i in indices]
    largest = f.filter_type == "largest"
    order = sorted(range(len(scores)), key=lambda i: -scores[i] if largest else scores[i])  # stable
    if f.strategy == "top_p":
        kept = _ragen_top_p(scores, order, f)
    elif f.strategy in ("top_k", "top_k_abs"):
        k = int(f.value * n_groups) if f.strategy == "top_k" else int(f.value)
        kept = order[: max(min(k, len(scores)), 1)]
    else:  # min_p
        if largest:
            bound = _f32(_f32(max(scores) * _f32(f.value)) - _f32(ZERO_SPREAD))
            kept = [i for i in range(len(scores)) if scores[i] >= bound]
        else:
            bound = _f32(_f32(min(scores) / _f32(f.value + ZERO_SPREAD)) + _f32(ZERO_SPREAD))
            kept = [i for i in range(len(scores)) if scores[i] <= bound]
    return [indices[i] for i in kept]


def _ragen_top_p(scores: list[float], order: list[int], f: SNRFilter) -> list[int]:
    value = _f32(f.value)
    if f.value >= 1.0:
        return list(range(len(scores)))
    if f.top_p_prob_mode == "softmax":
        logits = scores if f.filter_type == "largest" else [-s for s in scores]
        top = max(logits)
        probs = [_f32(math.exp(_f32(x - top))) for x in logits]
        total = _pairwise(probs, _f32)
        probs = [_f32(p / total) for p in probs]
        by_prob = sorted(range(len(probs)), key=lambda i: -probs[i])  # stable
        cumulative, cutoff = 0.0, len(probs)
        for position, i in enumerate(by_prob):  # searchsorted(cumsum, value, side="left")
            cumulative = _f32(cumulative + probs[i])
            if cumulative >= value:
                cutoff = position
                break
        return by_prob[: min(cutoff + 1, len(probs))]
    threshold = _f32(_f32(value * _pairwise(scores, _f32)) - _f32(f.top_p_slack))
    total, taken = 0.0, 0
    for i in order:
        if _f32(total) >= threshold or scores[i] <= 0:
            break
        total += scores[i]
        taken += 1
    return order[:taken] if _f32(total) >= threshold else []


def _upstream_select(groups: list[list[float]], f: SNRFilter) -> list[int]:
    """The upstream pull requests' selection (scoring.snr_filter.upstream_select), in float64."""
    ddof = f.variance_ddof
    variances = [_var(g, ddof) if len(g) > ddof else 0.0 for g in groups]
    total = 0.0
    for v in variances:  # one addition at a time, as on every Python (3.12's sum() compensates)
        total += v
    n_groups = len(variances)
    include_zero = f.keeps_zero_spread
    k = int(f.value)
    if total <= 0.0:
        if not include_zero:
            return []
        return list(range(min(k, n_groups))) if f.strategy == "top_k" else list(range(n_groups))
    if f.strategy == "top_p" and include_zero and f.value == 1.0:
        return list(range(n_groups))
    candidates = [g for g in range(n_groups) if include_zero or variances[g] > 0.0]
    candidates.sort(key=lambda g: variances[g], reverse=True)  # stable: ties keep group order
    if f.strategy == "top_k":
        return candidates[:k]
    target = f.value * total - f.top_p_slack
    kept: list[int] = []
    cumulative = 0.0
    if target > 0.0:
        for g in candidates:
            kept.append(g)
            cumulative += variances[g]
            if cumulative >= target:
                break
    return kept


def _vagen_select(groups: list[list[float]], f: SNRFilter) -> list[int]:
    """VAGEN's ``reward_variance_top_p_filter`` (vagen/custom_filter/filter.py), in float64.

    Where it differs from upstream's: a batch without variance keeps every group; zero-variance groups are
    candidates, ranked last; a group is taken while the running sum is *below* ``value * total`` (no slack),
    so the group that reaches it is the last one. A group of at most ``ddof`` rewards counts as 0 (VAGEN
    takes a group of one as 0 and would divide by zero beyond that).
    """
    ddof = f.variance_ddof
    variances = [_var(g, ddof) if len(g) > ddof else 0.0 for g in groups]
    total = 0.0
    for v in variances:  # one addition at a time, as upstream's (3.12's sum(), which VAGEN calls, compensates)
        total += v
    if total <= 0.0:
        return list(range(len(groups)))
    order = sorted(range(len(groups)), key=lambda g: variances[g], reverse=True)  # stable: ties keep group order
    target = f.value * total  # > 0: value is in (0, 1], so the first group is always taken (VAGEN's "at least one")
    kept: list[int] = []
    cumulative = 0.0
    for g in order:
        if cumulative >= target:
            break
        kept.append(g)
        cumulative += variances[g]
    return kept


# numpy's arithmetic, in pure Python ---------------------------------------------------------------


def _check_rewards(groups: list[list[float]]) -> None:
    if not groups:
        raise ValueError("rewards must hold at least one group, got 0")
    for g, group in enumerate(groups):
        if not group:
            raise ValueError(f"rewards[{g}] must hold at least one reward, got 0")
        for i, reward in enumerate(group):
            if not math.isfinite(reward):
                raise ValueError(
                    f"rewards[{g}][{i}] must be a finite number, got {reward}: leave a missing reward out of its group"
                )


def _f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, ties to even), as numpy casts; infinite past float32's range."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def _pairwise(values: Sequence[float], rounded: Callable[[float], float]) -> float:
    """The sum of ``values`` in numpy's pairwise order, each addition passed through ``rounded``.

    numpy's ``add.reduce`` of a contiguous array: under 8 values, one at a time from 0; up to 128,
    eight running sums combined as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the rest one at a time;
    beyond, the two halves (the first a multiple of 8 long) summed the same way. ``rounded`` is
    ``float`` for float64 sums and ``_f32`` for float32 ones (one rounding of the exact double sum of
    two float32 values is the float32 sum: 53 >= 2 * 24 + 2 bits).
    """
    n = len(values)
    if n < 8:
        total = 0.0
        for v in values:
            total = rounded(total + v)
        return total
    if n <= PW_BLOCK:
        r = [rounded(v) for v in values[:8]]
        i = 8
        while i < n - n % 8:
            for j in range(8):
                r[j] = rounded(r[j] + values[i + j])
            i += 8
        halves = (
            rounded(rounded(r[0] + r[1]) + rounded(r[2] + r[3])),
            rounded(rounded(r[4] + r[5]) + rounded(r[6] + r[7])),
        )
        total = rounded(halves[0] + halves[1])
        for v in values[i:]:
            total = rounded(total + v)
        return total
    half = n // 2
    half -= half % 8
    return rounded(_pairwise(values[:half], rounded) + _pairwise(values[half:], rounded))


def _var(values: Sequence[float], ddof: int) -> float:
    """``np.var(values, ddof=ddof)``: the mean, the squared deviations, their pairwise sum over n - ddof."""
    mean = _pairwise(values, float) / len(values)
    return _pairwise([(v - mean) * (v - mean) for v in values], float) / (len(values) - ddof)


def _std(values: Sequence[float]) -> float:
    """``np.std(values, ddof=1)``, and 0 for a single value (RAGEN's would be NaN)."""
    return math.sqrt(_var(values, 1)) if len(values) > 1 else 0.0


def _mean(values: Sequence[float]) -> float:
    return _pairwise(values, float) / len(values) if values else 0.0


def _one_of(name: str, value: Any, allowed: Sequence[str], where: str = "") -> None:
    if value not in allowed:
        raise ValueError(f"SNRFilter {name} must be one of {', '.join(allowed)}{where}, got {value!r}")
