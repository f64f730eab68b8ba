"""Alert settings (a run's rules, thresholds, baseline) and the alerts the API answers with.

The rules themselves are in ``service.alerts.rules``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from service.schemas.rows import IsoTime

# Alert settings and names (the rules themselves: service.alerts.rules) ------------------------

RuleName = Literal["TemplateCollapse", "EntropyCollapse", "LowRewardSignal", "NoReasoning"]
# dropped: a pending episode whose condition broke before it fired, kept as a record (listed only when asked).
AlertState = Literal["pending", "firing", "resolved", "dropped"]
Severity = Literal["critical", "warning"]
MAX_WINDOW = 1000  # scored steps; a replay's saved state holds up to baseline_steps values per series


@dataclass(frozen=True)
class SignalSpec:
    """A signal TemplateCollapse can watch: a stored series that falls as input dependence goes."""

    threshold: float  # the absolute level it must stay above (the relative drop may set a higher one)
    unit: str
    entropy: str = "conditional_entropy_est"  # the H(Z|X) whose band the rule checks: of the same tokens


# Distinct prompts a scored batch needs for TemplateCollapse to see a collapse before it is near-total: on
# the zoo of real runs the default rule caught every collapse within 2 steps with 4 or more, fewer with 2-3,
# and false-alarmed with 2 (docs/alerts.md, Enough rows to see; bench/real_run/signals.py measures it).
PROMPTS_TO_SEE = 4
CUSUM = "mi_cusum"  # not a stored series: the rule's CUSUM of mi_estimate and mi_estimate_se
HEAD_ENTROPY = "conditional_entropy_head_est"
# The one registry of signals (``Signal`` names them for the schema; a test keeps the two equal).
SIGNALS = {
    "mi_zscore_ema": SignalSpec(0.0, "z"),
    "retrieval_above_chance": SignalSpec(0.02, "share of rows"),
    "mi_estimate": SignalSpec(0.01, "nats per token"),
    CUSUM: SignalSpec(0.0, "standard errors (a level it rises above: cusum_threshold)"),
    "mi_head_estimate": SignalSpec(0.01, "nats per token", HEAD_ENTROPY),
    "mi_head_excess": SignalSpec(0.01, "nats per token", HEAD_ENTROPY),
    "mi_excess": SignalSpec(0.01, "nats per token"),
    "mi_seq_normalized": SignalSpec(0.01, "share of ln N"),
    "retrieval_chance_corrected": SignalSpec(0.02, "share of the way from chance to every row"),
    "retrieval_mrr": SignalSpec(0.0, "mean reciprocal rank"),
    "nearest_log_ratio": SignalSpec(0.1, "nats a reasoning, own prompt over its 3 most similar prompts"),
}
Signal = Literal[
    "mi_zscore_ema",
    "retrieval_above_chance",
    "mi_estimate",
    "mi_cusum",
    "mi_head_estimate",
    "mi_head_excess",
    "mi_excess",
    "mi_seq_normalized",
    "retrieval_chance_corrected",
    "retrieval_mrr",
    "nearest_log_ratio",
]


class AlertSettings(BaseModel):
    """Alert thresholds of one run (``alerts`` in ``POST /v1/runs``); docs/alerts.md's table is generated
    from these fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = Field(True, description="Evaluate alert rules for this run.")
    signal: Signal = Field(
        "retrieval_chance_corrected",
        description="The input-dependence signal TemplateCollapse watches. The default was chosen on the zoo of real "
        "trained runs (docs/alerts.md, Choosing the signal): chance-corrected retrieval, (accuracy - chance) / "
        "(1 - chance), which neither follows length nor saturates, and means the same whatever the number of "
        "prompts. mi_cusum: a one-sided CUSUM of mi_estimate standardized by its standard error against its "
        "baseline (scoring.estimators.cusum), which fires when it exceeds cusum_threshold; the others: a level "
        "(threshold, drop_fraction).",
    )
    threshold: float | None = Field(
        None,
        ge=-1e6,
        le=1e6,
        allow_inf_nan=False,
        description="Absolute level the signal must stay above; default per signal: "
        + ", ".join(f"{name} {spec.threshold}" for name, spec in SIGNALS.items() if name != CUSUM)
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
    baseline_steps: int = Field(
        3,
        ge=1,
        le=MAX_WINDOW,
        description="Scored steps whose median is the baseline. 3 on the zoo of real runs: a run whose learning "
        "rate is too high loses input dependence by its third step, before a 5-step baseline exists.",
    )
    window: int = Field(
        2,
        ge=1,
        le=MAX_WINDOW,
        description="Consecutive scored steps a condition must hold to fire (NoReasoning: batches).",
    )
    resolve_window: int = Field(2, ge=1, le=MAX_WINDOW, description="Consecutive scored steps without it to resolve.")
    release_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="TemplateCollapse (level signals): while firing, a step counts towards resolving only when the "
        "signal is back above its level plus this share of the way from the level to the baseline (0.5: halfway), "
        "so a partial recovery while the cause stands does not resolve the episode; 0: resolve at the level.",
    )
    min_prompts: int = Field(
        PROMPTS_TO_SEE,
        ge=2,
        le=MAX_WINDOW,
        description="TemplateCollapse does not judge a step whose scored rows come from fewer distinct prompts "
        "(distinct_prompts): retrieval there moves by a third of its range on one miss (docs/alerts.md, Enough "
        "rows to see). The step is neither a hold nor a miss, and does not enter the baseline.",
    )
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
    entropy_band_while_firing: bool = Field(
        False,
        description="TemplateCollapse: a firing episode's steps, too, count as held only within the band (the rule "
        "frozen on 2026-12-06). Off: the band judges until the episode fires, then only the signal's recovery "
        "(release_fraction) resolves it, so an episode does not resolve mid-collapse because H(Z|X) rose with a "
        "blow-up (docs/evaluation.md).",
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
        return self.threshold if self.threshold is not None else SIGNALS[self.signal].threshold


# Integers stored in 32-bit columns (steps, seeds, counts) are bounded where they enter, so both
# databases refuse them alike (Postgres would answer an out-of-range value with an error).


class AlertDocument(BaseModel):
    """An alert episode as receivers (webhooks) and the API see it."""

    rule: RuleName
    severity: Severity
    run: str
    sampler: str
    state: AlertState
    onset_step: int
    fired_step: int | None
    resolved_step: int | None
    step: int = Field(description="The last scored step the episode was evaluated at.")
    value: float | None
    baseline: float | None
    threshold: float | None
    summary: str
    description: str


class DeliveryStatus(BaseModel):
    """A notification owed to a receiver. A receiver's URL is a credential: only its kind and host are shown."""

    receiver: Literal["webhook", "slack", "alertmanager"]
    url: str = Field(
        description="The receiver's scheme and host, e.g. `https://hooks.slack.com/…`: its path (a webhook's "
        "secret), query and credentials are never shown."
    )
    event: Literal["firing", "resolved"]
    status: Literal["pending", "delivering", "delivered", "failed"]
    attempts: int
    last_error: str | None = Field(
        description="The last try's status and a short reason (at most 200 characters), with URLs and token-like "
        "strings cut out."
    )
    delivered_at: IsoTime | None


class AlertResponse(AlertDocument):
    id: int
    created_at: IsoTime | None
    updated_at: IsoTime | None
    deliveries: list[DeliveryStatus]
