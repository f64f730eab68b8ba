"""When the SNR filter acts: from the start, or while a chosen alert state holds; and when an acting filter that
keeps no group stops training.

``FilterEngagement`` is an alert callback on the monitor's one alert watcher (``Monitor.on_alert``;
``FilterEngagement.watch`` subscribes it): the watcher's thread only queues events, and the training
thread reads the queue (no network call there). It carries the run's ``EmptySelections``, which TRL's
and verl's integrations both report to. Must not import the integrations, numpy or torch.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import TYPE_CHECKING

from collapse_monitor.alerts import AlertEvent
from collapse_monitor.snr_filter import SNRFilter

if TYPE_CHECKING:
    from collapse_monitor.monitor import Monitor

logger = logging.getLogger("collapse_monitor")

ENDS = ("resolved", "dropped")  # the states that end an episode


class EmptySelections:
    """The training steps an engaged filter kept no group for, one run's: each warned, counted, and training
    stopped after ``max_skipped_in_a_row`` of them in a row (RAGEN's trainer stops after 5).

    ``n_skipped``: all of them; ``n_in_a_row``: the current run of them (0 after a step that kept a group).
    """

    def __init__(self, snr_filter: SNRFilter) -> None:
        self.snr_filter = snr_filter
        self.n_skipped = 0
        self.n_in_a_row = 0

    def record(self, step: int, is_empty: bool, update: str) -> None:
        """Counts training ``step``; ``update`` says what became of its update, for the warning.

        Raises:
            RuntimeError: the ``max_skipped_in_a_row``-th empty selection in a row, naming the setting.
        """
        if not is_empty:
            self.n_in_a_row = 0
            return
        self.n_skipped += 1
        self.n_in_a_row += 1
        f = self.snr_filter
        limit = f.max_skipped_in_a_row
        logger.warning(
            "collapse-monitor: SNR filter kept no group for step %d: %s (%d in a row, training stops at %d)",
            step,
            update,
            self.n_in_a_row,
            limit,
        )
        if self.n_in_a_row >= limit:
            raise RuntimeError(
                f"collapse-monitor: the SNR filter kept no group for {self.n_in_a_row} steps in a row "
                f"(up to step {step}; max_skipped_in_a_row={limit}): every group's rewards spread too little "
                f"for {f.variant} {f.strategy} {f.value:g}; lower selection_eps, keep zero-spread groups "
                "(include_zero), use a strategy that keeps a count (top_k_abs) or variant 'vagen', which keeps "
                "every group when none spreads"
            )


class FilterEngagement:
    """Whether the filter acts now: from the start, or from the step after a chosen alert state.

    With ``engage="on_alert"`` it is an alert callback (``watch``): ``update(step)``, on the training
    thread, reads what the watcher queued and engages the filter at the first event of the filter's
    ``rules`` in one of its ``states`` (default: TemplateCollapse firing), an alert already open when
    the job started (a restarted job) included. With ``disengage="on_resolve"`` it disengages when
    every episode that engaged it resolved or was dropped; by default it stays engaged: the filter
    is the remedy, and an episode that resolved under it would come back when it stops (RAGEN runs
    it for the whole training). Each change is logged and kept in ``history`` as ``(training step,
    event)``. ``empty``: the steps it kept no group for (``EmptySelections``).
    """

    def __init__(self, snr_filter: SNRFilter) -> None:
        self.snr_filter = snr_filter
        self.empty = EmptySelections(snr_filter)
        self.engaged = snr_filter.engage == "always"
        self.history: list[tuple[int, AlertEvent]] = []
        self._queue: deque[AlertEvent] = deque()  # appended by the watcher thread, read by the training thread
        self._episodes: set[tuple[int, str, str, int]] = set()  # the open episodes that engaged it
        self._is_pinned = False  # engaged for good (a rollback), whatever the episodes do

    @classmethod
    def watch(cls, monitor: Monitor, snr_filter: SNRFilter, interval: float = 10.0) -> FilterEngagement:
        """An engagement fed by ``monitor``'s alert watcher (none needed for ``engage="always"``).

        Warns when ``engage="on_alert"`` gets no watcher (a disabled monitor, a forked process): the
        filter would never engage.
        """
        engagement = cls(snr_filter)
        if snr_filter.engage == "on_alert":
            engagement.subscribe(monitor, interval)
        return engagement

    def subscribe(self, monitor: Monitor, interval: float = 10.0) -> None:
        """Feeds this engagement from ``monitor``'s alerts; warns when there are none to feed it."""
        f = self.snr_filter
        states = {*f.states, *(ENDS if f.disengage == "on_resolve" else ())}
        if monitor.on_alert(self, rules=f.rules, states=states, interval=interval) is None:
            why = "the monitor is disabled" if not monitor.enabled else f"process {os.getpid()} cannot use it"
            logger.warning(
                "collapse-monitor: SNRFilter engage='on_alert' has no alert watcher (%s): the filter never "
                "engages here; with several processes only the main one watches, the others follow it",
                why,
            )

    def __call__(self, event: AlertEvent) -> None:
        self._queue.append(event)

    def wants(self, event: AlertEvent) -> bool:
        rules = self.snr_filter.rules
        return event.state in self.snr_filter.states and (rules is None or event.rule in rules)

    def update(self, step: int) -> bool:
        """Reads what the watcher queued; returns whether the filter is engaged now."""
        while self._queue:
            event = self._queue.popleft()
            if self.wants(event):
                self._episodes.add(event.episode)
                if not self.engaged:
                    self.engage(step, event)
            elif event.state in ENDS and self.snr_filter.disengage == "on_resolve":
                self._episodes.discard(event.episode)
                if self.engaged and not self._episodes and not self._is_pinned:
                    self._disengage(step, event)
        return self.engaged

    def engage(self, step: int, event: AlertEvent | None, *, is_pinned: bool = False) -> None:
        """Engages the filter from the next generation batch on, because of ``event`` (None: another rank's);
        ``is_pinned``: for good, whatever the episodes do (a rollback resumes with the filter engaged)."""
        self._is_pinned = self._is_pinned or is_pinned
        if self.engaged:
            return
        self.engaged = True
        if event is None:
            return
        self.history.append((step, event))
        self._log(step, event, "engaged")

    def _disengage(self, step: int, event: AlertEvent) -> None:
        self.engaged = False
        self.history.append((step, event))
        self._log(step, event, "disengaged")

    def _log(self, step: int, event: AlertEvent, what: str) -> None:
        f = self.snr_filter
        logger.warning(
            "collapse-monitor: %s (alert %d): SNR filter %s at training step %d (%s %s %g)",
            event.describe(),
            event.alert_id,
            what,
            step,
            f.variant,
            f.strategy,
            f.value,
        )
