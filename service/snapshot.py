"""A run as scoring and the alert rules see it, detached from any session, and the scoring schedule."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from scoring.partition import Extraction
from service.schemas import AlertSettings, from_row
from service.storage.tables import Run


class RunSnapshot(BaseModel):
    """What scoring and the alert rules need to know about a run, detached from any session."""

    model_config = ConfigDict(frozen=True, from_attributes=True)

    id: int
    name: str
    scorer: str
    scorer_mode: str
    score_every: int
    samplers: tuple[str, ...]
    num_samples: int | None
    seed: int
    temperature: float
    filter: dict[str, Any]
    alerts: AlertSettings
    reasoning_extraction: Extraction = "auto"

    @classmethod
    def of(cls, run: Run) -> RunSnapshot:
        return from_row(cls, run, alerts=run.alert_rules)


def is_scheduled(step: int, every: int) -> bool:
    """RAGEN's compute_freq rule: step 1 and every multiple of ``every``; every step when it is 1."""
    return every == 1 or step == 1 or (step > 0 and step % every == 0)
