"""TRL: the scored figures in the trackers ``report_to`` names (TensorBoard, Trackio, W&B), at their steps.

``attach`` adds a ``TrackerFeed`` on the main process when ``report_to`` names one of them. A
``ScoredFigures`` thread fetches the run's scored figures (``collapse/<sampler>/<name>``, the alert
states; ``collapse_monitor.trackers``); at the end of each optimizer step the training thread takes
the steps scored since the last one, without a network call, and writes each step's figures, in step
order, through the tracker the trainer set up:

* **TensorBoard**: the trainer's own ``SummaryWriter`` (``TensorBoardCallback.tb_writer``), at the
  step the figures belong to: ``add_scalar(name, value, step)``.
* **W&B**: ``wandb.log`` can only move its step forward, so the figures go in a row of their own with
  ``collapse/step``, the step they belong to, and ``define_metric(name, step_metric="collapse/step")``
  plots each against it, as transformers plots the trainer's figures against ``train/global_step``
  (``trackers.write_wandb``, which slime's hook uses too).
* **Trackio**: the same as W&B. Trackio takes an explicit step, but transformers' ``TrackioCallback``
  logs without one (Trackio's step there counts the trainer's log calls; the training step is the
  ``train/global_step`` figure), and an explicit step past Trackio's counter would move that counter,
  and the trainer's later rows with it. So: ``trackio.log({..., "collapse/step": step})``, with
  ``train/global_step`` too: Trackio's page has one x-axis for all its plots, and set to
  ``train/global_step`` it puts the trainer's figures and these at the same training step.

Writing stays on the training thread (from the queue ``ScoredFigures`` fills) rather than the
fetching thread: Trackio's current run is a context variable of the thread that started it, and the
trainer closes the TensorBoard writer and finishes the Trackio and W&B runs at the end of training,
which a background write could race. A failing write is logged once per tracker and skipped; while
the service is down nothing is fetched and nothing is written: the trainer's own logging goes on.
The feed is the first callback, so that at the end of training it writes what was scored by then
before the trackers' own callbacks close them.

Must be imported only where ``transformers`` is installed.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from collapse_monitor.monitor import Monitor
from collapse_monitor.trackers import STEP, ScoredFigures, write_wandb

GLOBAL_STEP = "train/global_step"  # transformers' name for the training step in every row it logs

logger = logging.getLogger("collapse_monitor")


def _tensorboard(callback: Any, step: int, figures: dict[str, float]) -> None:
    writer = callback.tb_writer
    if writer is None:  # not opened yet (the trainer opens it at the start of training)
        return
    for name, value in figures.items():
        writer.add_scalar(name, value, step)
    writer.flush()  # the trainer flushes at its logs only: a step it does not log would wait for the next


def _trackio(_callback: Any, step: int, figures: dict[str, float]) -> None:
    importlib.import_module("trackio").log({**figures, STEP: step, GLOBAL_STEP: step})


def _wandb(_callback: Any, step: int, figures: dict[str, float]) -> None:
    write_wandb(step, figures)


# transformers' reporting callbacks, by class name (TrackioCallback is recent; no version is imported).
WRITERS: dict[str, Callable[[Any, int, dict[str, float]], None]] = {
    "TensorBoardCallback": _tensorboard,
    "TrackioCallback": _trackio,
    "WandbCallback": _wandb,
}


def feed_trackers(trainer: Any, monitor: Monitor, poll_seconds: float, flush_timeout: float) -> TrackerFeed | None:
    """Adds a ``TrackerFeed`` to ``trainer`` as its first callback; None when ``report_to`` names none of
    ``WRITERS``' trackers or this is not the main process (only it reports)."""
    if not trainer.accelerator.is_main_process:
        return None
    trackers = [
        (callback, WRITERS[kind])
        for callback in trainer.callback_handler.callbacks
        for kind in {cls.__name__ for cls in type(callback).__mro__} & WRITERS.keys()
    ]
    if not trackers:
        return None
    feed = TrackerFeed(monitor, trackers, poll_seconds, flush_timeout)
    trainer.callback_handler.callbacks.insert(0, feed)  # before the trackers' own on_train_end closes them
    return feed


class TrackerFeed(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
    """Writes each scored step's figures into the trainer's trackers, at the step they belong to."""

    def __init__(
        self,
        monitor: Monitor,
        trackers: list[tuple[Any, Callable[[Any, int, dict[str, float]], None]]],
        poll_seconds: float = 10.0,
        flush_timeout: float = 10.0,
    ) -> None:
        self.monitor = monitor
        self.trackers = trackers
        self.poll_seconds = poll_seconds
        self.flush_timeout = flush_timeout
        self.figures: ScoredFigures | None = None
        self._started = False
        self._failed: set[int] = set()  # trackers (by index) whose failure was logged

    def on_train_begin(self, _args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
        # A resumed train() starts past its checkpoint: the steps before were written by the train() that made them.
        self.figures = ScoredFigures(self.monitor, self.poll_seconds, next_step=state.global_step + 1)
        self._started = False

    def on_step_end(self, _args: Any, _state: Any, _control: Any, **_kwargs: Any) -> None:
        if self.figures is None:
            return
        if not self._started:  # polling from the first step on: before it sent a batch, the run may not exist
            self._started = True
            self.figures.start()
        self._write(self.figures.take())

    def on_train_end(self, _args: Any, _state: Any, _control: Any, **_kwargs: Any) -> None:
        """Writes what was scored by now; the service keeps the rest (its pages, ``monitor.metrics``)."""
        figures, self.figures = self.figures, None
        if figures is None:
            return
        figures.close()
        # One more fetch, off this thread so a service that does not answer holds training's end flush_timeout at most.
        last = threading.Thread(target=figures.poll, name="collapse-monitor-last-figures", daemon=True)
        last.start()
        last.join(self.flush_timeout)
        self._write(figures.take())

    def _write(self, scored: dict[int, dict[str, float]]) -> None:
        for step, figures in scored.items():  # in step order
            for index, (callback, write) in enumerate(self.trackers):
                try:
                    write(callback, step, figures)
                except Exception as e:  # a tracker's failure must not stop training or the other trackers
                    if index not in self._failed:
                        self._failed.add(index)
                        logger.warning(
                            "collapse-monitor: scored figures not written to %s (%s); later failures not logged",
                            type(callback).__name__,
                            e,
                        )
