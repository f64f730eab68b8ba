"""A run as scoring and the alert rules see it, detached from any session, and the scoring schedule."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from scoring.partition import Extraction
from service.schemas.alerts import AlertSettings
from service.schemas.rows import from_row
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
    budget_seconds: float | None = None  # schedule.budget_seconds: None = the service's, 0 = none

    @classmethod
    def of(cls, run: Run) -> RunSnapshot:
        return from_row(cls, run, alerts=run.alert_rules, budget_seconds=run_budget(run.details))


# The run's schedule.budget_seconds is kept in its `details` JSON column beside the metadata, so that it
# needed no migration; these two functions are the only readers of that key.
BUDGET_KEY = "schedule_budget_seconds"


def run_metadata(details: dict[str, Any]) -> dict[str, Any]:
    """The run's metadata (``RunMetadata``) out of its ``details`` column."""
    return {key: value for key, value in details.items() if key != BUDGET_KEY}


def run_budget(details: dict[str, Any]) -> float | None:
    """The run's own scoring budget out of its ``details`` column; None when it uses the service's."""
    value = details.get(BUDGET_KEY)
    return None if value is None else float(value)


def step_budget(run: RunSnapshot, service_budget: float) -> float | None:
    """Kernel seconds a scored step of ``run`` may take: the run's budget, else the service's; None for none."""
    budget = service_budget if run.budget_seconds is None else run.budget_seconds
    return budget or None


def is_scheduled(step: int, every: int) -> bool:
    """RAGEN's compute_freq rule: step 1 and every multiple of ``every``; every step when it is 1."""
    return every == 1 or step == 1 or (step > 0 and step % every == 0)
