"""When the SNR filter acts: from the start, or from the step after a chosen alert state.

``FilterEngagement`` is an alert callback (``Monitor.on_alert``): the watcher's thread only queues
events, and the training thread reads the queue (no network call there). ``fan_out`` and
``union_filters`` let one watcher serve several such callbacks (the TRL integration's save, stop and
filter decisions). Must not import the integrations, numpy or torch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from collapse_monitor.alerts import AlertEvent
from collapse_monitor.snr_filter import SNRFilter

if TYPE_CHECKING:
    from collapse_monitor.alerts import AlertWatcher
    from collapse_monitor.monitor import Monitor

logger = logging.getLogger("collapse_monitor")


class FilterEngagement:
    """Whether the filter acts now: from the start, or from the step after a chosen alert state.

    With ``engage="on_alert"`` it is an alert callback (``Monitor.on_alert``, or ``watch``): the
    watcher's thread only queues events; ``update(step)``, on the training thread, reads the queue
    (no network call) and engages the filter at the first event of the filter's ``rules`` in one of
    its ``states``. Once engaged it stays engaged. Each engagement is logged and kept in ``history``
    as ``(training step, event)``.
    """

    def __init__(self, snr_filter: SNRFilter) -> None:
        self.snr_filter = snr_filter
        self.engaged = snr_filter.engage == "always"
        self.history: list[tuple[int, AlertEvent]] = []
        self.watcher: AlertWatcher | None = None
        self._queue: deque[AlertEvent] = deque()  # appended by the watcher thread, read by the training thread

    @classmethod
    def watch(cls, monitor: Monitor, snr_filter: SNRFilter, interval: float = 10.0) -> FilterEngagement:
        """An engagement fed by its own watcher of ``monitor``'s alerts (none for ``engage="always"``)."""
        engagement = cls(snr_filter)
        if snr_filter.engage == "on_alert":
            engagement.watcher = monitor.on_alert(
                engagement, rules=snr_filter.rules, states=snr_filter.states, interval=interval
            )
        return engagement

    def __call__(self, event: AlertEvent) -> None:
        self._queue.append(event)

    def wants(self, event: AlertEvent) -> bool:
        rules = self.snr_filter.rules
        return event.state in self.snr_filter.states and (rules is None or event.rule in rules)

    def update(self, step: int) -> AlertEvent | None:
        """Reads what the watcher queued; returns the event that engaged the filter now, if one did."""
        engaging = None
        while self._queue:
            event = self._queue.popleft()
            if self.engaged or not self.wants(event):
                continue
            self.engage(step, event)
            engaging = event
        return engaging

    def engage(self, step: int, event: AlertEvent) -> None:
        """Engages the filter from the next generation batch on, because of ``event``."""
        self.engaged = True
        self.history.append((step, event))
        f = self.snr_filter
        logger.warning(
            "collapse-monitor: %s (alert %d): SNR filter engaged at training step %d (%s %s %g)",
            event.describe(),
            event.alert_id,
            step,
            f.variant,
            f.strategy,
            f.value,
        )

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


def fan_out(*callbacks: Callable[[AlertEvent], object]) -> Callable[[AlertEvent], None]:
    """One alert callback calling each of ``callbacks``: one watcher serves them all."""

    def deliver(event: AlertEvent) -> None:
        for callback in callbacks:
            callback(event)

    return deliver


def union_filters(
    *filters: tuple[Iterable[str] | None, Iterable[str]],
) -> tuple[frozenset[str] | None, frozenset[str]]:
    """The (rules, states) a shared watcher must deliver for every ``(rules, states)`` pair (rules None: all)."""
    rules: set[str] | None = set()
    states: set[str] = set()
    for wanted_rules, wanted_states in filters:
        states |= set(wanted_states)
        if wanted_rules is None or rules is None:
            rules = None
        else:
            rules |= set(wanted_rules)
    return (None if rules is None else frozenset(rules)), frozenset(states)
