"""NoReasoning: no turn of the run's batches carried reasoning to score for ``window`` batches in a row, so
no collapse metric can be computed (no baseline needed). Must not import fastapi or touch the database."""

from __future__ import annotations

from dataclasses import dataclass

from service.alerts.rules.machine import Figures, NoState, Records, Rule, Span
from service.schemas.alerts import AlertSettings

NO_REASONING_ADVICE = (
    "The run's batches carry no reasoning under its reasoning_extraction, so no collapse metric can be computed. "
    "If the model writes no <think> tags, create the run with reasoning_extraction auto (the default) or "
    "whole_response; if its think blocks are cut by the length limit (truncated_think_ratio), raise the "
    "maximum completion length; or send each turn's reasoning explicitly (reasoning or reasoning_token_ids)."
)
RATE, TRUNCATED = "valid_thinking_rate", "truncated_think_ratio"


@dataclass(frozen=True)
class ReasoningRow:
    rate: float  # share of turns carrying reasoning
    truncated: float | None  # share of turns whose think block never closed


class NoReasoning(Rule[ReasoningRow, NoState]):
    name = "NoReasoning"
    severity = "warning"
    advice = NO_REASONING_ADVICE
    Row = ReasoningRow
    State = NoState

    @staticmethod
    def needs(_config: AlertSettings) -> tuple[str, ...]:
        return (RATE, TRUNCATED)

    def absorb(self, records: Records) -> list[tuple[int, ReasoningRow]]:
        return [(step, ReasoningRow(v[RATE], v.get(TRUNCATED))) for step, v in records if RATE in v]

    def ready_to_judge(self) -> bool:
        return True  # no baseline

    def judge(self, row: ReasoningRow) -> tuple[bool, bool]:
        hold = row.rate == 0
        return hold, self.streak(0, hold) >= self.config.window

    def figures(self, span: Span, row: ReasoningRow) -> Figures:
        truncated = row.truncated
        cut = (
            f"; {truncated:.0%} of the last batch's turns opened a think block and never closed it" if truncated else ""
        )
        summary = (
            f"{self.name} on run {self.run} at step {span.last}: no turn carried reasoning to score in "
            f"{span.n_held} batches in a row (since step {span.onset}){cut}"
        )
        return Figures(0.0, 0.0, 0.0, summary, self.advice)
