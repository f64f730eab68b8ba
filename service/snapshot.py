"""A run as scoring and the alert rules see it, detached from any session, and the scoring schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from scoring.partition import Extraction
from service.schemas import AlertSettings
from service.storage.tables import Run


@dataclass(frozen=True)
class RunSnapshot:
    """What scoring and the alert rules need to know about a run, detached from any session."""

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
        return cls(
            id=run.id,
            name=run.name,
            scorer=run.scorer,
            scorer_mode=run.scorer_mode,
            score_every=run.score_every,
            samplers=tuple(run.samplers),
            num_samples=run.num_samples,
            seed=run.seed,
            temperature=run.temperature,
            filter=dict(run.filter),
            alerts=AlertSettings.model_validate(run.alert_rules),
            reasoning_extraction=cast(Extraction, run.reasoning_extraction),
        )


def is_scheduled(step: int, every: int) -> bool:
    """RAGEN's compute_freq rule: step 1 and every multiple of ``every``; every step when it is 1."""
    return every == 1 or step == 1 or (step > 0 and step % every == 0)
