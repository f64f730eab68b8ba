"""Monitor.on_alert against a real service: every alert state change once, in order, across outages.

The alerts are made by the service's own rules, on the matrices ``alert_matrices`` posts.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
from alert_matrices import ALERTS, polls_after, post_matrices, states, unjudged, wait_for
from bench.serving import free_port

from collapse_monitor import AlertEvent, Monitor
from collapse_monitor.alerts import Decision


def test_each_state_change_reaches_the_callback_once_in_order(service, run_name, tmp_path):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, alerts=ALERTS, strict=True)  # strict: run made now
    events: list[AlertEvent] = []
    watcher = monitor.on_alert(events.append, states=("pending", "firing", "resolved"), interval=0.1)
    assert watcher is not None
    polls_after(monitor, 1)

    post_matrices(service.url, run_name, {1: False, 2: True})
    wait_for(lambda: len(events) == 1, what="the pending event")
    post_matrices(service.url, run_name, {3: True})
    wait_for(lambda: len(events) == 2, what="the firing event")
    post_matrices(service.url, run_name, {4: False})
    wait_for(lambda: len(events) == 3, what="the resolved event")
    polls_after(monitor, 3)  # later polls see the same alert: nothing more

    assert states(events) == [
        ("TemplateCollapse", "matrix", "pending", 2),
        ("TemplateCollapse", "matrix", "firing", 3),
        ("TemplateCollapse", "matrix", "resolved", 4),
    ]
    [stored] = monitor.alerts()
    assert {e.alert_id for e in events} == {stored["id"]}
    assert events[1].onset_step == 2
    assert events[1].fired_step == 3
    assert events[1].severity == "critical"
    assert events[2].summary == stored["summary"]
    assert monitor.stats().alert_events == 3

    monitor.close()
    assert not watcher.is_running


def test_alerts_open_at_the_first_poll_are_delivered_once_and_closed_ones_are_history(service, run_name, tmp_path):
    """A restarted job: one episode resolved and one pending before this monitor watched."""
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, alerts=ALERTS, strict=True)
    # pending at 2, firing at 3, resolved at 4; pending again at 5: all before watching
    post_matrices(service.url, run_name, {1: False, 2: True, 3: True, 4: False, 5: True})
    first: list[AlertEvent] = []
    monitor.on_alert(first.append, states=("pending", "firing", "resolved"), interval=0.1)
    polls_after(monitor, 2)
    later: list[AlertEvent] = []
    monitor.on_alert(later.append, interval=0.1)  # subscribed after the first poll: its own first look
    polls_after(monitor, 2)
    assert [(*s, e.is_open_at_start) for s, e in zip(states(first), first)] == [
        ("TemplateCollapse", "matrix", "pending", 5, True)
    ]
    assert states(later) == states(first)
    post_matrices(service.url, run_name, {6: True})
    wait_for(lambda: len(first) == 2 and len(later) == 2, what="the firing event")
    assert (first[1].state, first[1].step, first[1].is_open_at_start) == ("firing", 6, False)
    monitor.close()


def test_a_pending_alert_whose_condition_breaks_is_delivered_as_dropped(service, run_name, tmp_path):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, alerts=ALERTS, strict=True)
    events: list[AlertEvent] = []
    monitor.on_alert(events.append, states=("pending", "dropped"), interval=0.1)
    polls_after(monitor, 1)
    post_matrices(service.url, run_name, {1: False, 2: True})
    wait_for(lambda: len(events) == 1, what="the pending event")
    post_matrices(service.url, run_name, {3: False})  # the service keeps it as a dropped record, not listed
    wait_for(lambda: len(events) == 2, what="the dropped event")
    polls_after(monitor, 2)
    # dropped at the last step it was seen pending
    assert states(events) == [
        ("TemplateCollapse", "matrix", "pending", 2),
        ("TemplateCollapse", "matrix", "dropped", 2),
    ]
    assert events[0].episode == events[1].episode
    assert [a["state"] for a in monitor.alerts(state="dropped")] == ["dropped"]
    monitor.close()


def test_a_failing_or_blocking_callback_never_stops_the_watcher_nor_log(service, run_name, tmp_path, caplog):
    """Callbacks share the monitor's one watcher: a blocked one holds the others back, never ``log()``."""
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, alerts=ALERTS, schedule={"every": 1000}, strict=True)
    release = threading.Event()

    def failing(event: AlertEvent) -> None:
        raise RuntimeError(f"no handler for {event.state}")

    def blocking(_event: AlertEvent) -> None:
        release.wait(60)

    events: list[AlertEvent] = []
    watcher = monitor.on_alert(failing, interval=0.1)
    assert monitor.on_alert(blocking, interval=0.1) is watcher  # one watcher per monitor
    monitor.on_alert(events.append, rules=["TemplateCollapse"], interval=0.1)
    polls_after(monitor, 3)
    post_matrices(service.url, run_name, {1: False, 2: True, 3: True})
    wait_for(lambda: monitor.stats().alert_callback_errors >= 1, what="the first failure")
    for step in range(10, 20):  # the blocked callback holds the watcher's thread only
        monitor.log(step, unjudged(step))
    assert monitor.flush(30)
    release.set()
    wait_for(lambda: len(events) == 2, what="pending and firing")
    wait_for(lambda: monitor.stats().alert_callback_errors == 2, what="both failures counted")
    assert states(events) == [("TemplateCollapse", "matrix", "pending", 2), ("TemplateCollapse", "matrix", "firing", 3)]
    assert "the alert callback" in caplog.text
    assert "no handler for firing" in caplog.text
    assert monitor.stats().sent == 10
    monitor.close()


def test_alert_actions_turn_events_into_one_save_and_a_stop_on_the_calling_thread(service, run_name, tmp_path):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, alerts=ALERTS, strict=True)
    actions = monitor.act_on_alerts(interval=0.1)  # save on pending, stop on firing, TemplateCollapse
    polls_after(monitor, 1)
    assert actions.take(1) == Decision()  # nothing asked yet
    post_matrices(service.url, run_name, {1: False, 2: True})
    polls_after(monitor)
    first = actions.take(2)
    assert (first.save, first.stop, [e.state for e in first.events]) == (True, False, ["pending"])
    assert not actions.take(3).save  # a save is asked once
    post_matrices(service.url, run_name, {3: True})
    polls_after(monitor)
    assert not actions.should_save(4)
    assert actions.should_stop(4)
    assert actions.should_stop(5)  # stays asked
    assert [(step, d.save, d.stop) for step, d in actions.history] == [(2, True, False), (4, False, True)]
    monitor.close()


def test_bad_filters_are_refused_and_a_disabled_monitor_watches_nothing(tmp_path):
    monitor = Monitor("http://127.0.0.1:9", "r", spool_dir=tmp_path)
    with pytest.raises(ValueError, match="states must be among pending, firing, resolved, dropped, got fired"):
        monitor.on_alert(print, states=("fired",))
    with pytest.raises(ValueError, match="interval must be a positive number"):
        monitor.on_alert(print, interval=0)
    assert Monitor("http://127.0.0.1:9", "r", spool_dir=tmp_path, enabled=False).on_alert(print) is None


class Proxy:
    """A loopback TCP relay to the service that can go down and come back on the same port: an outage
    as the client sees it (connections refused, open ones cut), without restarting the service."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        assert self._listener is not None
        for s in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_an_outage_costs_no_event_and_repeats_none(service, run_name, tmp_path, caplog):
    proxy = Proxy(service.port)
    proxy.start()
    monitor = Monitor(proxy.url, run_name, spool_dir=tmp_path, alerts=ALERTS, strict=True, timeout=2)
    events: list[AlertEvent] = []
    monitor.on_alert(events.append, interval=0.1)
    polls_after(monitor, 1)
    post_matrices(service.url, run_name, {1: False, 2: True})
    wait_for(lambda: len(events) == 1, what="the pending event")

    proxy.stop()
    wait_for(lambda: monitor.stats().alert_poll_errors >= 3, what="failed polls")
    post_matrices(service.url, run_name, {3: True})  # fires while the client cannot see it
    proxy.start()
    wait_for(lambda: len(events) == 2, what="the firing event after the outage")
    polls_after(monitor, 2)
    assert states(events) == [("TemplateCollapse", "matrix", "pending", 2), ("TemplateCollapse", "matrix", "firing", 3)]
    assert "cannot read the alerts" in caplog.text
    assert "can be read again" in caplog.text
    monitor.close()
    proxy.stop()


def test_should_stop_next_to_log_batch_ends_the_loop_at_the_step_the_alert_is_seen_firing(service, run_name, tmp_path):
    """verl's fit, reduced to what the added line touches: ``is_last_step = is_last_step or monitor.should_stop()``."""
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, alerts=ALERTS, strict=True)
    monitor.act_on_alerts(interval=0.1)  # optional: the first should_stop() would start it with these defaults
    saved, last = [], None
    for step in range(1, 10):
        monitor.log(step, unjudged(step))  # log_batch(monitor, self.global_steps, batch, self.tokenizer)
        monitor.flush()
        post_matrices(service.url, run_name, {step: step > 1})  # the service scores: collapsed from step 2
        polls_after(monitor)  # a real step lasts longer than a poll
        if monitor.should_save():
            saved.append(step)  # the user's own self._save_checkpoint()
        is_last_step = step == 9 or monitor.should_stop()
        if is_last_step:  # verl saves, validates and returns as at its planned end
            last = step
            break
    assert saved == [2]  # TemplateCollapse became pending at step 2 ...
    assert last == 3  # ... and fired at step 3 (window 2): the loop ended there
    assert monitor.should_stop()  # stays asked
    with pytest.raises(ValueError, match="already acts on other alerts"):
        monitor.act_on_alerts(stop_on=("pending",))
    monitor.close()
    assert not Monitor(service.url, run_name, enabled=False).should_stop()  # a disabled monitor never asks
