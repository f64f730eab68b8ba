"""Whether scoring keeps pace with a run's trainer: its backlog, what a step costs, how often steps come.

Read by ingest (a warning in the 202 answer) and by the run's read (``GET /v1/runs/{run}``, the run
page). Must not import fastapi.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.storage.tables import Batch

RECENT = 10  # batches the averages are taken over: a few minutes of a fast run, a long run's last hour
BACKLOG = 3  # waiting batches before a run is said to lag (one queued behind one scoring is normal)


@dataclass(frozen=True)
class Pace:
    """A run's scoring pace.

    Attributes:
        waiting: its batches queued or being scored.
        seconds_per_step: mean scoring time of its last finished batches (off-schedule steps included,
            so that ``schedule.every`` counts).
        seconds_between_steps: mean time between its last accepted batches.
    """

    waiting: int
    seconds_per_step: float | None
    seconds_between_steps: float | None

    @property
    def is_lagging(self) -> bool:
        return (
            self.waiting >= BACKLOG
            and self.seconds_per_step is not None
            and self.seconds_between_steps is not None
            and self.seconds_per_step > self.seconds_between_steps
        )

    def warning(self, run: str) -> str | None:
        """What a user reads when scoring falls behind, with the figures to change; None when it keeps up."""
        if not self.is_lagging:
            return None
        assert self.seconds_per_step is not None
        assert self.seconds_between_steps is not None
        every = math.ceil(self.seconds_per_step / self.seconds_between_steps)
        # The kernel's share of a step, leaving the rest of the interval to the estimators and the writes.
        budget = max(1.0, 0.8 * self.seconds_between_steps)
        return (
            f"scoring falls behind run {run!r}: {self.waiting} of its batches wait, a step takes ~"
            f"{self.seconds_per_step:.0f} s to score and steps arrive every ~{self.seconds_between_steps:.0f} s, "
            f"so its figures come later at each step. Score every {every}th step or more (schedule.every), fewer "
            "rows (sampler.num_samples), less of each reasoning (max_reasoning_tokens), a per-step scoring budget "
            f"below the step interval (schedule.budget_seconds, e.g. {budget:.0f}: the worker then scores fewer rows "
            "or a shorter window and says so in each sampler's plan), or add a worker or a GPU "
            "(docs/benchmarks.md, capacity)"
        )


def run_pace(session: Session, run_id: int) -> Pace:
    """The run's pace, from its batches table rows (two small indexed reads)."""
    waiting = session.scalar(
        select(func.count()).select_from(Batch).where(Batch.run_id == run_id, Batch.status.in_(("queued", "scoring")))
    )
    seconds = session.scalars(
        select(Batch.scoring_seconds)
        .where(Batch.run_id == run_id, Batch.status == "done", Batch.scoring_seconds.is_not(None))
        .order_by(Batch.finished_at.desc())
        .limit(RECENT)
    ).all()
    created = session.scalars(
        select(Batch.created_at).where(Batch.run_id == run_id).order_by(Batch.created_at.desc()).limit(RECENT + 1)
    ).all()
    between = (created[0] - created[-1]).total_seconds() / (len(created) - 1) if len(created) >= 2 else None
    return Pace(
        waiting=int(waiting or 0),
        seconds_per_step=sum(s for s in seconds if s is not None) / len(seconds) if seconds else None,
        seconds_between_steps=between,
    )
