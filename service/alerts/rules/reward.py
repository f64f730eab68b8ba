"""LowRewardSignal: the mean in-group reward std stays below ``reward_std_fraction`` of its baseline for
``reward_window`` steps (RAGEN's early-stop rule), or the share of zero-variance groups exceeds
``zero_variance_ratio`` for ``window`` steps. Must not import fastapi or touch the database."""

from __future__ import annotations

from dataclasses import dataclass

from service.alerts.rules.machine import Figures, NoState, Records, Rule, Span
from service.schemas.alerts import AlertSettings

REWARD_ADVICE = (
    "Rewards barely vary within prompt groups, so policy-gradient updates carry little signal relative to "
    "noise: the low-SNR regime that drives template collapse. Enable SNR-aware filtering (RAGEN's rollout "
    "filter: strategy top_p, linear, value 0.9) to train on the groups with the most reward spread; if it "
    "is on, lower its value (e.g. 0.7)."
)
STD, ZERO, KEPT = "rollout/in_group_reward_std", "zero_variance_group_ratio", "rollout/filter_kept_ratio"


@dataclass(frozen=True)
class RewardRow:
    std: float  # mean in-group reward std
    zero: float  # share of groups without reward variance
    kept: float | None  # share of groups a top_p 0.9 filter would keep


class LowRewardSignal(Rule[RewardRow, NoState]):
    name = "LowRewardSignal"
    severity = "warning"
    advice = REWARD_ADVICE
    Row = RewardRow
    State = NoState

    @staticmethod
    def needs(_config: AlertSettings) -> tuple[str, ...]:
        return (STD, ZERO, KEPT)

    def absorb(self, records: Records) -> list[tuple[int, RewardRow]]:
        rows: list[tuple[int, RewardRow]] = []
        for step, values in records:
            if STD in values:
                self.m.head(STD, values[STD], self.config)
                if ZERO in values:
                    rows.append((step, RewardRow(values[STD], values[ZERO], values.get(KEPT))))
        return rows

    def ready_to_judge(self) -> bool:
        return self.m.baseline(STD, self.config) is not None

    def _threshold(self) -> float:
        base = self.m.baseline(STD, self.config)
        assert base is not None
        return self.config.reward_std_fraction * base

    def judge(self, row: RewardRow) -> tuple[bool, bool]:
        low_std, many_zero = row.std < self._threshold(), row.zero > self.config.zero_variance_ratio
        ready = self.streak(0, low_std) >= self.config.reward_window
        ready = self.streak(1, many_zero) >= self.config.window or ready
        return low_std or many_zero, ready

    def figures(self, span: Span, row: RewardRow) -> Figures:
        base = self.m.baseline(STD, self.config)
        assert base is not None
        summary = (
            f"{self.name} on run {self.run} at step {span.last}: mean in-group reward std {row.std:.4g} "
            f"(baseline {base:.4g}), {row.zero:.0%} of prompt groups without reward variance (since step {span.onset})"
        )
        kept = row.kept
        advice = (
            f" On step {span.last} a top_p 0.9 filter would keep {kept:.0%} of the groups." if kept is not None else ""
        )
        return Figures(row.std, base, self._threshold(), summary, self.advice + advice)
