"""Acting on a run's alerts: the monitor's one alert watcher, which turns the service's alert list into events.

A ``Monitor`` has at most one ``AlertWatcher``: it polls ``GET /v1/runs/{run}/alerts`` from its own
thread and hands each alert state change once (``AlertEvent``) to every callback subscribed with
``Monitor.on_alert``, each with its own rules and states. ``AlertActions`` (save and stop decisions),
``collapse_monitor.engagement.FilterEngagement`` (when the SNR filter acts) and the TRL rollback's
checkpoint keeper are such callbacks: they queue the events, and the training thread reads them.

An alert is an episode of one rule on one sampler: ``pending`` when its condition starts to hold,
``firing`` once it held ``window`` scored steps, ``resolved`` when it stopped holding (docs/alerts.md).
A pending alert whose condition breaks before it fires leaves the service's list (it keeps it as a
``dropped`` record, listed only when asked for): the watcher delivers ``dropped`` for a pending alert
it saw that is gone at the next answered poll. A poll that finds an alert in a later state than last
seen also delivers the states it passed through meanwhile (a pending alert that fired between two
polls gives ``pending`` then ``firing``); an alert that fired at its first step (``window`` 1) was
never pending. Must not import the monitor or the integrations.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from collapse_monitor.sender import backoff_delay
from collapse_monitor.transport import Transport

logger = logging.getLogger("collapse_monitor")

STATES = ("pending", "firing", "resolved", "dropped")
OPEN_STATES = ("pending", "firing")
# The rules of the service this client was written against; a newer service may have more, so an
# unknown name is warned about, not refused.
KNOWN_RULES = frozenset({"TemplateCollapse", "EntropyCollapse", "LowRewardSignal", "NoReasoning"})
MAX_POLL_BACKOFF_SECONDS = 60.0


@dataclass(frozen=True)
class AlertEvent:
    """One alert state change, as the watcher delivers it.

    ``step`` is the run's step at which the alert entered ``state`` (its onset for ``pending``,
    ``fired_step`` for ``firing``, ``resolved_step`` for ``resolved``, the last step seen pending for
    ``dropped``); ``onset_step`` the first step of the episode; ``last_step`` the latest scored step it
    was evaluated at when seen. ``is_open_at_start``: the alert was already open (pending or firing)
    when its subscriber first looked, before this monitor delivered any batch: it began before this
    process (a restarted job). ``alert`` is the service's whole alert document.
    """

    rule: str
    sampler: str
    state: str
    step: int
    onset_step: int
    fired_step: int | None
    last_step: int
    alert_id: int
    severity: str
    summary: str
    alert: Mapping[str, Any] = field(repr=False, compare=False)
    is_open_at_start: bool = False

    @property
    def episode(self) -> tuple[int, str, str, int]:
        """What the alert is known by: its id, rule, sampler and onset (SQLite may give a deleted alert's id
        to the next one, so the id alone is not enough)."""
        return (self.alert_id, self.rule, self.sampler, self.onset_step)

    def describe(self) -> str:
        return f"{self.rule} on sampler {self.sampler} ({self.severity}) {self.state} at step {self.step}"


def transitions(alert: Mapping[str, Any]) -> list[AlertEvent]:
    """The states an alert document has gone through, in order, each as an event.

    ``pending`` unless it fired at its onset step; ``firing`` once it has a ``fired_step``;
    ``resolved`` when resolved.
    """
    onset, fired, resolved = alert["onset_step"], alert.get("fired_step"), alert.get("resolved_step")
    steps: list[tuple[str, int]] = []
    if fired is None or onset < fired:
        steps.append(("pending", onset))
    if fired is not None:
        steps.append(("firing", fired))
    if alert["state"] == "resolved":
        steps.append(("resolved", resolved if resolved is not None else alert["step"]))
    return [
        AlertEvent(
            rule=str(alert["rule"]),
            sampler=str(alert["sampler"]),
            state=state,
            step=int(step),
            onset_step=int(onset),
            fired_step=None if fired is None else int(fired),
            last_step=int(alert["step"]),
            alert_id=int(alert["id"]),
            severity=str(alert.get("severity", "")),
            summary=str(alert.get("summary", "")),
            alert=alert,
        )
        for state, step in steps
    ]


def check_filters(rules: Iterable[str] | None, states: Iterable[str]) -> tuple[frozenset[str] | None, frozenset[str]]:
    """The rule and state filters as sets; raises ValueError for an unknown state."""
    wanted_states = frozenset((states,) if isinstance(states, str) else states)
    unknown = sorted(wanted_states - set(STATES))
    if unknown:
        raise ValueError(f"states must be among {', '.join(STATES)}, got {', '.join(unknown)}")
    if rules is None:
        return None, wanted_states
    if isinstance(rules, str):
        rules = (rules,)  # a single name, not its letters
    wanted_rules = frozenset(rules)
    for rule in sorted(wanted_rules - KNOWN_RULES):
        logger.warning("collapse-monitor: alert rule %r is not one this client knows (%s)", rule, sorted(KNOWN_RULES))
    return wanted_rules, wanted_states


@dataclass(eq=False)  # stateful: equal only to itself
class _Subscriber:
    callback: Callable[[AlertEvent], object]
    rules: frozenset[str] | None
    states: frozenset[str]
    has_looked: bool = False

    def wants(self, event: AlertEvent) -> bool:
        return event.state in self.states and (self.rules is None or event.rule in self.rules)


@dataclass(eq=False)  # stateful: equal only to itself
class AlertWatcher:
    """Polls one run's alerts from a background thread and hands each new state change to its subscribers.

    Created by the monitor's first ``Monitor.on_alert``; later calls subscribe to the same watcher
    (``subscribe``). A subscriber's first answered poll delivers the alerts open then (pending or
    firing: each state they went through, once, ``is_open_at_start`` when this monitor had delivered
    no batch yet); closed ones are history and are not delivered, unless this monitor delivered a
    batch before (then they happened while it trained). After that every state change seen is
    delivered once: a state change is known by its alert's ``episode`` and its state and step, so a
    reconnect after an outage delivers only what happened meanwhile. Callbacks run in turn on the
    watcher's thread: a slow one delays the others and the next poll (queue the work, as
    ``AlertActions`` does). A callback that raises is logged and counted (``alert_callback_errors``);
    later events still come. Poll failures are counted (``alert_poll_errors``) and retried with backoff.
    """

    transport: Transport
    run: str
    interval: float
    count: Callable[[str], None]
    has_delivered: Callable[[], bool]

    def __post_init__(self) -> None:
        self._subscribers: list[_Subscriber] = []
        self._lock = threading.Lock()
        self._seen: set[tuple[Any, ...]] = set()
        self._last_state: dict[tuple[Any, ...], int] = {}
        self._open: dict[tuple[Any, ...], list[AlertEvent]] = {}  # the open alerts' events, as last seen
        self._failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"AlertWatcher(run={self.run!r}, subscribers={len(self._subscribers)})"

    def subscribe(
        self, callback: Callable[[AlertEvent], object], rules: frozenset[str] | None, states: frozenset[str]
    ) -> None:
        with self._lock:
            self._subscribers.append(_Subscriber(callback, rules, states))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"collapse-monitor-alerts-{self.run}", daemon=True)
        self._thread.start()

    def stop(self, grace_seconds: float = 1.0) -> None:
        """Stops polling; no callback is called afterwards. A request in flight finishes on its own."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(grace_seconds)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    ok = self.poll()
                except Exception:  # a bug here must not end the watching silently
                    logger.exception("collapse-monitor: the alert watcher of run %r failed; retrying", self.run)
                    self.count("alert_poll_errors")
                    self._failures += 1
                    ok = False
                if ok:
                    delay = self.interval
                else:
                    delay = backoff_delay(self._failures, self.interval, max(self.interval, MAX_POLL_BACKOFF_SECONDS))
                self._stop.wait(delay)
        finally:
            self.transport.close()  # by its own thread: never under a request in flight

    def poll(self) -> bool:
        """One look at the run's alerts; delivers what is new. Returns whether the service answered."""
        delivered_before = self.has_delivered()  # read before the request: see the class docstring
        with self._lock:
            subscribers = list(self._subscribers)  # one subscribed meanwhile looks at the next poll
        try:
            alerts = self._fetch()
        except (httpx.HTTPError, ValueError) as e:
            self.count("alert_poll_errors")
            self._failures += 1
            if self._failures == 1:
                logger.warning("collapse-monitor: cannot read the alerts of run %r: %s; retrying", self.run, e)
            return False
        if self._failures:
            logger.warning("collapse-monitor: the alerts of run %r can be read again", self.run)
        self._failures = 0
        self.count("alert_polls")
        new = self._new_events(alerts)
        at_start = [
            event if delivered_before else replace(event, is_open_at_start=True)
            for events in self._open.values()
            for event in events
        ]
        for subscriber in subscribers:
            if subscriber.has_looked:
                events = new
            elif delivered_before:  # what is open now and what happened since this monitor delivered
                events = at_start + [e for e in new if e.episode not in self._open]
            else:
                events = at_start
            subscriber.has_looked = True
            for event in events:
                if self._stop.is_set():
                    return True
                if subscriber.wants(event):
                    self._deliver(subscriber.callback, event)
        return True

    def _fetch(self) -> list[Mapping[str, Any]]:
        try:
            answer = self.transport.get(f"/v1/runs/{self.run}/alerts")
        except httpx.HTTPStatusError as e:
            if e.response.status_code == 404:
                return []  # the run is not created yet: it has no alerts
            raise
        if not isinstance(answer, list):
            raise ValueError(f"expected a list of alerts, got {type(answer).__name__}")
        return [a for a in answer if isinstance(a, Mapping)]

    def _new_events(self, alerts: Iterable[Mapping[str, Any]]) -> list[AlertEvent]:
        """State changes not seen before, oldest alert first, each alert's in order; updates the open alerts."""
        out = []
        listed: set[tuple[Any, ...]] = set()
        for alert in alerts:
            try:
                events = transitions(alert)
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("collapse-monitor: ignored an alert the client cannot read (%r): %s", alert, e)
                continue
            if not events:
                continue
            identity = events[0].episode
            listed.add(identity)
            order = STATES.index(events[-1].state)
            if order < self._last_state.get(identity, -1):
                # The same row went back (a resumed run whose new history repeats the episode): a new episode.
                self._seen = {key for key in self._seen if key[0] != identity}
            self._last_state[identity] = order
            if events[-1].state in OPEN_STATES:
                self._open[identity] = events
            else:
                self._open.pop(identity, None)
            for event in events:
                key = (identity, event.state, event.step)
                if key not in self._seen:
                    self._seen.add(key)
                    out.append(event)
        for identity in [i for i in self._open if i not in listed]:
            last = self._open.pop(identity)[-1]
            if last.state == "pending":  # its condition broke before it fired: the service lists it no more
                self._last_state[identity] = STATES.index("dropped")
                self._seen.add((identity, "dropped", last.last_step))
                out.append(replace(last, state="dropped", step=last.last_step))
        return out

    def _deliver(self, callback: Callable[[AlertEvent], object], event: AlertEvent) -> None:
        self.count("alert_events")
        try:
            callback(event)
        except Exception:  # the callback is the user's code: it must not stop the watcher
            self.count("alert_callback_errors")
            logger.exception("collapse-monitor: the alert callback %r failed on %s", callback, event.describe())


@dataclass(frozen=True)
class Decision:
    """What the training loop should do at this step, and the alert events behind it."""

    save: bool = False
    stop: bool = False
    events: tuple[AlertEvent, ...] = ()


class AlertActions:
    """Alert events in, save and stop decisions out, taken on the training thread.

    Subscribe it with ``monitor.act_on_alerts`` (or ``monitor.on_alert(actions, rules=actions.rules,
    states=actions.states)``): the watcher's thread only queues events, and ``take(step)`` (or
    ``should_stop`` / ``should_save``), called by the training loop, reads the queue without any
    network call. An event of a rule in ``rules`` (None: every rule) whose state is in ``save_on``
    asks for a checkpoint, once; one whose state is in ``stop_on`` asks to stop, for good. Each
    decision is logged with its rule, sampler, state and steps, and kept in ``history``. An alert
    already open when this process started watching (``is_open_at_start``: a restarted job) asks for
    nothing, logged once: a job resumed from a checkpoint before the collapse would otherwise stop at
    its first step, before the service has seen its new history (the SNR filter's engagement does act
    on it).
    """

    def __init__(
        self,
        *,
        save_on: Collection[str] = ("pending",),
        stop_on: Collection[str] = ("firing",),
        rules: Iterable[str] | None = ("TemplateCollapse",),
    ) -> None:
        self.rules, self.save_on = check_filters(rules, save_on)
        _, self.stop_on = check_filters(None, stop_on)
        self.states = self.save_on | self.stop_on
        self.history: list[tuple[int, Decision]] = []  # (training step, decision) of every save or stop asked
        self._queue: deque[AlertEvent] = deque()  # appended by the watcher thread, read by the training thread
        self._save_due = False
        self._stop_due = False
        self._events: list[AlertEvent] = []

    def __call__(self, event: AlertEvent) -> None:
        self._queue.append(event)

    def take(self, step: int) -> Decision:
        """What the alerts asked since the last ``take`` (a trainer that stopped and trains again starts clean)."""
        self._drain(step)
        decision = Decision(save=self._save_due, stop=self._stop_due, events=tuple(self._events))
        self._save_due = self._stop_due = False
        self._events = []
        return decision

    def should_stop(self, step: int) -> bool:
        """Whether an alert asked to stop; once asked, it stays asked (a save waits for ``should_save``)."""
        self._drain(step)
        return self._stop_due

    def should_save(self, step: int) -> bool:
        """Whether an alert asked for a checkpoint since the last time this returned True."""
        self._drain(step)
        save, self._save_due = self._save_due, False
        return save

    def _drain(self, step: int) -> None:
        while self._queue:
            event = self._queue.popleft()
            if self.rules is not None and event.rule not in self.rules:
                continue
            save = event.state in self.save_on
            stop = event.state in self.stop_on
            if not (save or stop):
                continue
            if event.is_open_at_start:
                logger.warning(
                    "collapse-monitor: %s (alert %d, onset step %d) was open before this process watched: "
                    "not acted on at training step %d (a restarted job)",
                    event.describe(),
                    event.alert_id,
                    event.onset_step,
                    step,
                )
                continue
            what = " and ".join(w for w, asked in (("saving a checkpoint", save), ("stopping training", stop)) if asked)
            logger.warning(
                "collapse-monitor: %s (alert %d, onset step %d): %s at training step %d",
                event.describe(),
                event.alert_id,
                event.onset_step,
                what,
                step,
            )
            self._save_due = self._save_due or save
            self._stop_due = self._stop_due or stop
            self._events.append(event)
            self.history.append((step, Decision(save=save, stop=stop, events=(event,))))
