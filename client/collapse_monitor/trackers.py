"""The service's scored figures, fetched off the training thread, for the trainer's own tracker.

Scoring lags training: the figures of step ``s`` are there some steps later. ``ScoredFigures``
polls the run's metric points on a daemon thread of its own; ``take()`` hands the training thread,
without waiting on the network, the figures of the steps scored since the last call, each under
``collapse/`` and with the step it belongs to. When the service is down the poll fails, is logged
once, and ``take()`` returns nothing: the trainer's own logging never waits or breaks.

Must not import the trainers.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from collapse_monitor.monitor import Monitor

logger = logging.getLogger("collapse_monitor")

PREFIX = "collapse/"
STEP = f"{PREFIX}step"  # the step axis of the trackers whose own step only grows (W&B, Trackio)
NAMES = ("mi_estimate", "retrieval_chance_corrected", "conditional_entropy_est")
# Scored only from batches whose turns carry the trainer's log-probs (reasoning_logprobs): there when present.
WHEN_SENT = ("trainer_scorer_logprob_gap",)
STATE_CODES = {"resolved": 0.0, "pending": 1.0, "firing": 2.0}  # an alert state as a plottable number


@dataclass(eq=False)
class ScoredFigures:
    """Polls ``monitor``'s scored figures every ``poll_seconds`` on a daemon thread (``start()``)."""

    monitor: Monitor
    poll_seconds: float = 10.0
    sampler: str | None = None  # None: every sampler the service ran, each as collapse/<sampler>/<name>
    next_step: int = 0  # the first step not fetched yet (a resumed trainer starts past its checkpoint)
    _new: dict[int, dict[str, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _failing: bool = False

    def start(self) -> ScoredFigures:
        threading.Thread(target=self._loop, name="collapse-monitor-figures", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()

    def take(self) -> dict[int, dict[str, float]]:
        """The figures of the steps scored since the last call, ``{step: {"collapse/...": value}}``, in step order."""
        with self._lock:
            new, self._new = self._new, {}
        return dict(sorted(new.items()))

    def poll(self) -> None:
        """One fetch (what the thread does every ``poll_seconds``); errors are logged, never raised."""
        try:
            points = self.monitor.metrics((*NAMES, *WHEN_SENT), sampler=self.sampler, from_step=self.next_step)
            alerts = self.monitor.alerts()
        except Exception as e:  # a tracker feed must never take the trainer down
            if not self._failing:
                logger.warning("collapse-monitor: scored figures not fetched (%s); retrying", e)
            self._failing = True
            return
        self._failing = False
        found: dict[int, dict[str, float]] = {}
        for point in points:
            name = str(point["name"]) if self.sampler else f"{point['sampler']}/{point['name']}"
            found.setdefault(int(point["step"]), {})[PREFIX + name] = float(point["value"])
        for alert in alerts:  # the state an alert reached, at the step it reached it
            step = alert.get("step")
            if step is not None and int(step) in found and alert.get("state") in STATE_CODES:
                found[int(step)][f"{PREFIX}alert/{alert['rule']}"] = STATE_CODES[alert["state"]]
        if found:
            with self._lock:
                for step, figures in found.items():
                    self._new.setdefault(step, {}).update(figures)
            self.next_step = max(found) + 1  # figures arrive in step order: never send a step twice

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.poll()


def merge_newest(figures: ScoredFigures, metrics: dict[str, Any]) -> None:
    """Puts the newest scored step's figures into ``metrics`` (and ``collapse/step``: the step they belong to).

    For loggers that take one step per call (verl's ``Tracking.log``): the figures land at the
    current step, and ``collapse/step`` says which training step they describe.
    """
    new = figures.take()
    if new:
        step, newest = max(new.items())
        metrics.update(newest)
        metrics[STEP] = float(step)


def write_wandb(step: int, figures: dict[str, float]) -> None:
    """One row of ``figures`` in the current W&B run, plotted against ``collapse/step`` = ``step``.

    ``wandb.log`` only moves its own step forward, and scoring lags training, so the figures of step
    ``s`` go in a row of their own with ``collapse/step``, and ``define_metric`` gives each name that
    axis (as transformers plots the trainer's figures against ``train/global_step`` and slime its
    rollout's against ``rollout/step``). Nothing without a current run; raises what W&B raises.
    """
    run = importlib.import_module("wandb").run
    if run is None:
        return
    # Each name defined exactly, not as a glob: wandb-core tries the globs that match a name in no set
    # order, and transformers defines "*" against train/global_step.
    for name in (STEP, *figures):
        if (run.id, name) not in _WANDB_DEFINED:
            run.define_metric(name, step_metric=STEP if name != STEP else None)
            _WANDB_DEFINED.add((run.id, name))
    run.log({**figures, STEP: step})


_WANDB_DEFINED: set[tuple[str, str]] = set()  # (W&B run id, name): the names given their axis in each run
