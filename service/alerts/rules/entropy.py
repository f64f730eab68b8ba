"""EntropyCollapse: H(Z|X) (or the matched-pair token entropy) falls below ``entropy_floor`` of its
baseline: reasoning became deterministic per input. Must not import fastapi or touch the database."""

from __future__ import annotations

from dataclasses import dataclass

from service.alerts.rules.machine import Figures, NoState, Records, Rule, Span, recovering
from service.schemas.alerts import AlertSettings

ENTROPY_ADVICE = (
    "Reasoning became (nearly) deterministic for each input. Raise the rollout temperature or the "
    "entropy bonus, or lower the learning rate; watch whether MI follows."
)


@dataclass(frozen=True)
class EntropyRow:
    value: float  # the entropy signal at the step


class EntropyCollapse(Rule[EntropyRow, NoState]):
    name = "EntropyCollapse"
    severity = "warning"
    advice = ENTROPY_ADVICE
    Row = EntropyRow
    State = NoState

    @staticmethod
    def needs(config: AlertSettings) -> tuple[str, ...]:
        return (config.entropy_signal,)

    def absorb(self, records: Records) -> list[tuple[int, EntropyRow]]:
        name, rows = self.config.entropy_signal, list[tuple[int, EntropyRow]]()
        for step, values in records:
            if name in values:
                self.m.head(name, values[name], self.config)
                rows.append((step, EntropyRow(values[name])))
        return rows

    def ready_to_judge(self) -> bool:
        base = self.m.baseline(self.config.entropy_signal, self.config)
        if base is not None and base <= 0:
            self.m.pending = []  # no baseline to fall from: never judged, nothing kept
        return base is not None and base > 0

    def judge(self, row: EntropyRow) -> tuple[bool, bool]:
        hold = row.value < self._floor()
        return hold, self.streak(0, hold) >= self.config.window

    def _base(self) -> float:
        base = self.m.baseline(self.config.entropy_signal, self.config)
        assert base is not None  # judged only once it exists
        return base

    def _floor(self) -> float:
        return self.config.entropy_floor * self._base()

    def figures(self, span: Span, row: EntropyRow) -> Figures:
        change = "is back above" if row.value >= self._floor() else "fell below"
        summary = (
            f"{self.name} on run {self.run} ({self.sampler}) at step {span.last}: {self.config.entropy_signal} "
            f"{row.value:.4g} {change} {self.config.entropy_floor:.0%} of its baseline {self._base():.4g} (since step "
            f"{span.onset}{recovering(span, self.config)})"
        )
        return Figures(row.value, self._base(), self._floor(), summary, self.advice)
