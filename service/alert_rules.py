"""Template-collapse alert rules, evaluated on a run's stored series after each scored step.

Pure: series in, alert episodes out. Each evaluation replays the whole history of a (run,
sampler) through the rules' state machine, so the result never depends on what a previous
process remembered:

    condition holds ──▶ pending ──(holds `window` consecutive steps)──▶ firing
    pending ──(condition fails)──▶ dropped (never fired, nothing to tell)
    firing ──(condition fails `resolve_window` consecutive steps)──▶ resolved

Rules (RAGEN-2: entropy stays flat while input dependence vanishes under template collapse):
    TemplateCollapse  the input-dependence signal falls below a threshold, or drops by more than
                      ``drop_fraction`` from the run's baseline (for ``mi_cusum``, the default: its
                      CUSUM rises above ``cusum_threshold``), while H(Z|X) stays within its band
                      (no more than ``entropy_band`` below its baseline, ``entropy_band_above``
                      above): the failure entropy cannot see. When the episode reaches the latest
                      batch it names that batch's prompts that lost input dependence.
    EntropyCollapse   H(Z|X) (or the matched-pair token entropy) falls below ``entropy_floor`` of
                      its baseline: reasoning became deterministic per input.
    LowRewardSignal   the mean in-group reward std stays below ``reward_std_fraction`` of its
                      baseline for ``reward_window`` steps (RAGEN's early-stop rule), or the share
                      of zero-variance groups exceeds ``zero_variance_ratio`` for ``window`` steps.
    NoReasoning       no turn of the run's batches carried reasoning to score for ``window``
                      batches in a row: no collapse metric can be computed (no baseline needed).
A baseline is the median of the first ``baseline_steps`` values; rules wait for it.
Must not import fastapi or touch the database.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from scoring.estimators import between_step_variance, cusum

Series = dict[str, list[tuple[int, float]]]  # stored name -> [(step, value)], ascending steps
RuleName = Literal["TemplateCollapse", "EntropyCollapse", "LowRewardSignal", "NoReasoning"]
AlertState = Literal["pending", "firing", "resolved"]
Severity = Literal["critical", "warning"]
MAX_WINDOW = 1000  # scored steps; every evaluation replays the history, so windows stay bounded
SIGNAL_THRESHOLDS = {"mi_zscore_ema": 0.0, "retrieval_above_chance": 0.02, "mi_estimate": 0.01}
CUSUM = "mi_cusum"  # not a stored series: computed here from mi_estimate and mi_estimate_se
CUSUM_SE_FLOOR = 0.05  # share of the MI baseline: a standard error is never taken as smaller
TEMPLATE: RuleName = "TemplateCollapse"
ENTROPY: RuleName = "EntropyCollapse"
REWARD: RuleName = "LowRewardSignal"
NO_REASONING: RuleName = "NoReasoning"
SEVERITY: dict[RuleName, Severity] = {
    TEMPLATE: "critical",
    ENTROPY: "warning",
    REWARD: "warning",
    NO_REASONING: "warning",
}


Signal = Literal["retrieval_above_chance", "mi_cusum", "mi_zscore_ema", "mi_estimate"]


class AlertSettings(BaseModel):
    """Alert thresholds of one run (``alerts`` in ``POST /v1/runs``); docs/alerts.md's table is generated
    from these fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = Field(True, description="Evaluate alert rules for this run.")
    signal: Signal = Field(
        "retrieval_above_chance",
        description="The input-dependence signal TemplateCollapse watches (the default calibrated on the SmolLM2 "
        "corpus, docs/corpus.md). mi_cusum: a one-sided CUSUM of mi_estimate standardized by its standard error "
        "against its baseline (scoring.estimators.cusum), which fires when it exceeds cusum_threshold; the others: "
        "a level (threshold, drop_fraction).",
    )
    threshold: float | None = Field(
        None,
        ge=-1e6,
        le=1e6,
        allow_inf_nan=False,
        description="Absolute level the signal must stay above; default per signal: "
        + ", ".join(f"{name} {value}" for name, value in SIGNAL_THRESHOLDS.items())
        + " (mi_estimate in nats per token).",
    )
    drop_fraction: float = Field(0.2, gt=0, le=1, description="Relative drop from the baseline that counts.")
    cusum_drop: float = Field(
        0.4,
        gt=0,
        le=1,
        description="mi_cusum: the drop of mi_estimate it is designed to catch, as a share of its baseline (a "
        "quarter of the prompts collapsing takes about a quarter of the MI).",
    )
    cusum_threshold: float = Field(
        3.0, gt=0, le=1e6, description="mi_cusum: the CUSUM level (in standard errors) above which a step counts."
    )
    baseline_steps: int = Field(5, ge=1, le=MAX_WINDOW, description="Scored steps whose median is the baseline.")
    window: int = Field(
        2,
        ge=1,
        le=MAX_WINDOW,
        description="Consecutive scored steps a condition must hold to fire (NoReasoning: batches).",
    )
    resolve_window: int = Field(2, ge=1, le=MAX_WINDOW, description="Consecutive scored steps without it to resolve.")
    entropy_signal: Literal["conditional_entropy_est", "token_entropy_mean"] = Field(
        "conditional_entropy_est", description="The entropy EntropyCollapse watches."
    )
    entropy_band: float = Field(
        0.25, gt=0, lt=1, description="TemplateCollapse needs H(Z|X) no lower than this share below its baseline."
    )
    entropy_band_above: float = Field(
        2.0,
        gt=0,
        le=100,
        description="... and no higher than this share above it. Template reasoning often scores a higher per-token "
        "entropy than grounded reasoning (it is generic text), so the band is wide upwards.",
    )
    entropy_floor: float = Field(0.5, gt=0, lt=1, description="EntropyCollapse fires below this share of baseline.")
    reward_std_fraction: float = Field(0.1, gt=0, lt=1, description="LowRewardSignal: share of baseline reward std.")
    reward_window: int = Field(
        10, ge=1, le=MAX_WINDOW, description="LowRewardSignal: consecutive steps of low reward std."
    )
    zero_variance_ratio: float = Field(0.5, gt=0, le=1, description="LowRewardSignal: zero-variance group share.")
    use_intervals: bool = Field(
        False,
        description="Count a step only when the whole bootstrap interval of mi_estimate is below the same relative "
        "level of its baseline (ignored when the series carries no intervals).",
    )

    @property
    def signal_threshold(self) -> float:
        return self.threshold if self.threshold is not None else SIGNAL_THRESHOLDS[self.signal]


@dataclass(frozen=True)
class Episode:
    """One alert of one rule: when it began, fired and resolved, and the figures behind it."""

    rule: RuleName
    sampler: str
    state: AlertState
    onset_step: int
    fired_step: int | None
    resolved_step: int | None
    last_step: int
    value: float
    baseline: float
    threshold: float
    summary: str
    description: str

    @property
    def severity(self) -> Severity:
        return SEVERITY[self.rule]


@dataclass(frozen=True)
class _Span:
    """Where one episode lies on the step axis, as the state machine found it."""

    onset: int
    fired: int | None
    resolved: int | None
    last: int

    @property
    def state(self) -> AlertState:
        return "resolved" if self.resolved is not None else "firing" if self.fired is not None else "pending"


@dataclass(frozen=True)
class _Figures:
    """What an episode reports at its last step."""

    value: float
    baseline: float
    threshold: float
    summary: str
    description: str


def evaluate(
    run: str, sampler: str, series: Series, config: AlertSettings, lost: Sequence[int] | None = None
) -> list[Episode]:
    """Every alert episode the rules produce on this (run, sampler)'s history, oldest first.

    ``lost``: group ids of the prompts that lost input dependence in the latest batch
    (``SamplerResult.lost_group_ids``); a TemplateCollapse episode reaching that batch names them.
    """
    if not config.enabled:
        return []
    if sampler == "all":
        return _reward_episodes(run, series, config) + _no_reasoning_episodes(run, series, config)
    return _template_episodes(run, sampler, series, config, lost) + _entropy_episodes(run, sampler, series, config)


def _baseline(values: Sequence[tuple[int, float]], steps: int) -> float | None:
    return statistics.median(v for _, v in values[:steps]) if len(values) >= steps else None


def _aligned(series: Series, *names: str) -> list[tuple[int, tuple[float, ...]]]:
    """Steps where every named series has a value, with those values."""
    maps = [dict(series.get(name, [])) for name in names]
    steps = sorted(set.intersection(*(set(m) for m in maps))) if maps else []
    return [(s, tuple(m[s] for m in maps)) for s in steps]


def _spans(steps: Sequence[int], holds: Sequence[bool], ready: Sequence[bool], resolve_window: int) -> list[_Span]:
    """The state machine over a history; ``ready[i]``: the condition held long enough to fire at step i."""
    spans: list[_Span] = []
    onset: int | None = None
    fired: int | None = None
    clear = 0
    for step, hold, can_fire in zip(steps, holds, ready, strict=True):
        if onset is not None and fired is not None:  # firing: resolve after enough consecutive clear steps
            clear = 0 if hold else clear + 1
            if clear >= resolve_window:
                spans.append(_Span(onset, fired, step, step))
                onset, fired, clear = None, None, 0
            continue
        if hold:
            onset = step if onset is None else onset
            if can_fire:
                fired = step
        else:
            onset = None  # a pending condition that breaks is dropped
    if onset is not None:
        spans.append(_Span(onset, fired, None, steps[-1]))
    return spans


def _streaks(holds: Sequence[bool]) -> list[int]:
    out, n = [], 0
    for hold in holds:
        n = n + 1 if hold else 0
        out.append(n)
    return out


def _episodes(
    rule: RuleName,
    sampler: str,
    steps: Sequence[int],
    holds: Sequence[bool],
    ready: Sequence[bool],
    config: AlertSettings,
    figures: Callable[[_Span], _Figures],
) -> list[Episode]:
    """Runs the state machine and describes each episode it finds with ``figures``."""
    episodes = []
    for span in _spans(steps, holds, ready, config.resolve_window):
        at = figures(span)
        episodes.append(
            Episode(
                rule=rule,
                sampler=sampler,
                state=span.state,
                onset_step=span.onset,
                fired_step=span.fired,
                resolved_step=span.resolved,
                last_step=span.last,
                value=at.value,
                baseline=at.baseline,
                threshold=at.threshold,
                summary=at.summary,
                description=at.description,
            )
        )
    return episodes


def _level(threshold: float, baseline: float, drop_fraction: float) -> float:
    """Below this a signal counts as low: the absolute threshold, or the relative drop when higher."""
    # A relative drop means nothing from a baseline at or below zero.
    return max(threshold, (1 - drop_fraction) * baseline) if baseline > 0 else threshold


TEMPLATE_ADVICE = (
    "Reasoning no longer depends on the input although its entropy looks healthy (RAGEN-2 template "
    "collapse). Check which prompts lost input dependence in the per-prompt breakdown of the latest batch "
    "(GET /v1/batches/{id}); enable SNR-aware filtering (RAGEN's rollout filter, top_p 0.9) or lower its "
    "top_p; lower the KL or entropy-regularization weight."
)


def _cusum_series(series: Series, config: AlertSettings) -> list[tuple[int, float]]:
    """The mi_cusum statistic at each step with mi_estimate and its standard error; [] before a baseline."""
    rows = _aligned(series, "mi_estimate", "mi_estimate_se")
    base = _baseline(series.get("mi_estimate", []), config.baseline_steps)
    if not rows or base is None or base <= 0:
        return []
    head = rows[: config.baseline_steps]
    values = cusum(
        [v for _, (v, _) in rows],
        [e for _, (_, e) in rows],
        baseline=base,
        drop=config.cusum_drop * base,
        se_floor=CUSUM_SE_FLOOR * base,
        tau2=between_step_variance([v for _, (v, _) in head], [e for _, (_, e) in head]),
    )
    return [(step, value) for (step, _), value in zip(rows, values, strict=True)]


def _template_episodes(
    run: str, sampler: str, series: Series, config: AlertSettings, lost: Sequence[int] | None = None
) -> list[Episode]:
    signal = config.signal
    if signal == CUSUM:
        series = {**series, CUSUM: _cusum_series(series, config)}
    rows = _aligned(series, signal, "conditional_entropy_est")
    signal_base = _baseline(series.get(signal, []), config.baseline_steps)
    entropy_base = _baseline(series.get("conditional_entropy_est", []), config.baseline_steps)
    if not rows or signal_base is None or entropy_base is None:
        return []
    # The CUSUM already weighs each step by its standard error: it rises above a fixed level.
    cumulative = signal == CUSUM
    level = config.cusum_threshold if cumulative else _level(config.signal_threshold, signal_base, config.drop_fraction)
    # Noise guard: a step also needs the whole bootstrap interval of the MI estimate below the same
    # relative level of its own baseline, so one batch's sampling noise cannot count as a drop.
    ci_high = dict(series.get("mi_estimate_ci_high", []))
    mi_base = _baseline(series.get("mi_estimate", []), config.baseline_steps)
    confirm = config.use_intervals and bool(ci_high) and mi_base is not None and not cumulative
    mi_level = _level(SIGNAL_THRESHOLDS["mi_estimate"], mi_base or 0.0, config.drop_fraction)
    holds = [
        (value > level if cumulative else value < level)
        and (1 - config.entropy_band) * entropy_base <= entropy <= (1 + config.entropy_band_above) * entropy_base
        and (not confirm or ci_high.get(step, float("inf")) < mi_level)
        for step, (value, entropy) in rows
    ]
    values = dict(rows)

    def figures(span: _Span) -> _Figures:
        value, entropy = values[span.last]
        streak = sum(1 for s, _ in rows if span.onset <= s <= span.last)
        bound = (
            f" (the 95% interval of mi_estimate reaches {ci_high[span.last]:.4g}, under {mi_level:.4g})"
            if confirm and span.last in ci_high
            else ""
        )
        if cumulative:
            mi = dict(series.get("mi_estimate", []))
            change = (
                f"mi_estimate {mi.get(span.last, float('nan')):.4g} fell from its baseline {mi_base or 0.0:.4g} "
                f"(its CUSUM {value:.4g} rose above {level:.4g} standard errors)"
            )
        else:
            change = f"{signal} {value:.4g} fell below {level:.4g} (baseline {signal_base:.4g}){bound}"
        summary = (
            f"{TEMPLATE} on run {run} ({sampler}) at step {span.last}: {change} over {streak} scored steps since step "
            f"{span.onset}, while H(Z|X) {entropy:.4g} did not fall (baseline {entropy_base:.4g})"
            + _lost_prompts(lost, span.last, rows[-1][0])
        )
        return _Figures(value, signal_base, level, summary, TEMPLATE_ADVICE)

    ready = [n >= config.window for n in _streaks(holds)]
    return _episodes(TEMPLATE, sampler, [s for s, _ in rows], holds, ready, config, figures)


def _lost_prompts(lost: Sequence[int] | None, step: int, latest: int) -> str:
    """Names the latest batch's prompts that lost input dependence, when the episode reaches it."""
    if lost is None or step != latest:
        return ""
    if not lost:
        return "; no single prompt of the latest batch stands out as lost"
    return f"; prompts (group ids) of the latest batch that lost input dependence: {', '.join(map(str, lost))}"


ENTROPY_ADVICE = (
    "Reasoning became (nearly) deterministic for each input. Raise the rollout temperature or the "
    "entropy bonus, or lower the learning rate; watch whether MI follows."
)


def _entropy_episodes(run: str, sampler: str, series: Series, config: AlertSettings) -> list[Episode]:
    name = config.entropy_signal
    rows = series.get(name, [])
    base = _baseline(rows, config.baseline_steps)
    if not rows or base is None or base <= 0:
        return []
    floor = config.entropy_floor * base
    holds = [value < floor for _, value in rows]
    values = dict(rows)

    def figures(span: _Span) -> _Figures:
        summary = (
            f"{ENTROPY} on run {run} ({sampler}) at step {span.last}: {name} {values[span.last]:.4g} fell below "
            f"{config.entropy_floor:.0%} of its baseline {base:.4g} (since step {span.onset})"
        )
        return _Figures(values[span.last], base, floor, summary, ENTROPY_ADVICE)

    ready = [n >= config.window for n in _streaks(holds)]
    return _episodes(ENTROPY, sampler, [s for s, _ in rows], holds, ready, config, figures)


REWARD_ADVICE = (
    "Rewards barely vary within prompt groups, so policy-gradient updates carry little signal relative to "
    "noise: the low-SNR regime that drives template collapse. Enable SNR-aware filtering (RAGEN's rollout "
    "filter: strategy top_p, linear, value 0.9) to train on the groups with the most reward spread; if it "
    "is on, lower its value (e.g. 0.7)."
)


def _reward_episodes(run: str, series: Series, config: AlertSettings) -> list[Episode]:
    std_name, zero_name = "rollout/in_group_reward_std", "zero_variance_group_ratio"
    rows = _aligned(series, std_name, zero_name)
    base = _baseline(series.get(std_name, []), config.baseline_steps)
    if not rows or base is None:
        return []
    low_std = [std < config.reward_std_fraction * base for _, (std, _) in rows]
    many_zero = [zero > config.zero_variance_ratio for _, (_, zero) in rows]
    holds = [a or b for a, b in zip(low_std, many_zero, strict=True)]
    ready = [
        a >= config.reward_window or b >= config.window
        for a, b in zip(_streaks(low_std), _streaks(many_zero), strict=True)
    ]
    values = dict(rows)
    kept = dict(series.get("rollout/filter_kept_ratio", []))

    def figures(span: _Span) -> _Figures:
        std, zero = values[span.last]
        summary = (
            f"{REWARD} on run {run} at step {span.last}: mean in-group reward std {std:.4g} "
            f"(baseline {base:.4g}), {zero:.0%} of prompt groups without reward variance (since step {span.onset})"
        )
        advice = (
            f" On step {span.last} a top_p 0.9 filter would keep {kept[span.last]:.0%} of the groups."
            if span.last in kept
            else ""
        )
        return _Figures(std, base, config.reward_std_fraction * base, summary, REWARD_ADVICE + advice)

    return _episodes(REWARD, "all", [s for s, _ in rows], holds, ready, config, figures)


NO_REASONING_ADVICE = (
    "The run's batches carry no reasoning under its reasoning_extraction, so no collapse metric can be computed. "
    "If the model writes no <think> tags, create the run with reasoning_extraction auto (the default) or "
    "whole_response; if its think blocks are cut by the length limit (truncated_think_ratio), raise the "
    "maximum completion length; or send each turn's reasoning explicitly (reasoning or reasoning_token_ids)."
)


def _no_reasoning_episodes(run: str, series: Series, config: AlertSettings) -> list[Episode]:
    rows = series.get("valid_thinking_rate", [])
    if not rows:
        return []
    holds = [value == 0 for _, value in rows]
    truncated = dict(series.get("truncated_think_ratio", []))

    def figures(span: _Span) -> _Figures:
        streak = sum(1 for s, value in rows if span.onset <= s <= span.last and value == 0)
        cut = (
            f"; {truncated[span.last]:.0%} of the last batch's turns opened a think block and never closed it"
            if truncated.get(span.last)
            else ""
        )
        summary = (
            f"{NO_REASONING} on run {run} at step {span.last}: no turn carried reasoning to score in {streak} "
            f"batches in a row (since step {span.onset}){cut}"
        )
        return _Figures(0.0, 0.0, 0.0, summary, NO_REASONING_ADVICE)

    ready = [n >= config.window for n in _streaks(holds)]
    return _episodes(NO_REASONING, "all", [s for s, _ in rows], holds, ready, config, figures)


def needed_series(config: AlertSettings) -> tuple[str, ...]:
    """The stored names the rules read."""
    return (
        *((config.signal,) if config.signal != CUSUM else ()),
        "mi_estimate",
        "mi_estimate_se",
        "mi_estimate_ci_high",
        "conditional_entropy_est",
        config.entropy_signal,
        "rollout/in_group_reward_std",
        "zero_variance_group_ratio",
        "rollout/filter_kept_ratio",
        "valid_thinking_rate",
        "truncated_think_ratio",
    )


def settings_table() -> str:
    """The defaults table of docs/alerts.md, generated from ``AlertSettings`` (a test keeps them equal)."""
    lines = ["| setting | default | meaning |", "| --- | --- | --- |"]
    for name, field in AlertSettings.model_fields.items():
        default = field.default
        shown = (
            "per signal" if default is None else f"`{str(default).lower() if isinstance(default, bool) else default}`"
        )
        meaning = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | {shown} | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(settings_table())
