"""Outages of a real service (uvicorn subprocess, tiny-random scorer, SQLite): nothing lost, nothing twice.

Each test starts its own service, because each stops it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from rollouts import trajectories
from running_service import RunningService

from collapse_monitor import Monitor

# Long enough for the sender's backoff to double several times (0.5 s, 1, 2, 4 ...) and spool every step.
OUTAGE_SECONDS = 15.0
STEP_SECONDS = 0.5


@pytest.fixture
def own_service(tmp_path) -> Iterator[RunningService]:
    folder = tmp_path / "service"
    folder.mkdir()
    running = RunningService(folder)
    yield running
    running.stop()


def test_every_step_arrives_exactly_once_in_order_across_a_15_second_outage(own_service, tmp_path):
    own_service.start()
    monitor = Monitor(own_service.url, "outage", spool_dir=tmp_path / "spool", schedule={"every": 1000}, timeout=5)
    step = 0

    def train(seconds: float) -> None:
        nonlocal step
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            step += 1
            monitor.log(step, trajectories(step))
            time.sleep(STEP_SECONDS)

    train(5)
    own_service.kill()  # mid-run, possibly mid-request: the answer to a stored batch may be lost
    train(OUTAGE_SECONDS)
    during = monitor.stats()
    assert during.service_reachable is False
    assert during.spooled > 0
    assert during.dropped == 0
    assert during.queued <= 1  # the outage costs disk, not memory
    own_service.start()
    train(5)
    assert monitor.flush(60)

    arrived = own_service.batches("outage")
    assert [s for s, _ in arrived] == list(range(1, step + 1))
    assert len({key for _, key in arrived}) == step
    stats = monitor.stats()
    assert (stats.logged, stats.sent, stats.rejected, stats.dropped, stats.spooled) == (step, step, 0, 0, 0)
    assert stats.service_reachable is True
    monitor.close()


def test_a_full_queue_is_retried_after_retry_after_until_it_drains(own_service, tmp_path):
    own_service.env["COLLAPSE_MONITOR_SCORING_PAUSED"] = "true"
    own_service.env["COLLAPSE_MONITOR_MAX_QUEUE_DEPTH"] = "2"
    own_service.start()
    monitor = Monitor(own_service.url, "queue-full", spool_dir=tmp_path / "spool")
    for step in range(1, 5):
        monitor.log(step, trajectories(step))
    assert not monitor.flush(3)
    stats = monitor.stats()
    assert stats.sent == 2
    assert stats.spooled == 2
    assert stats.retries >= 1
    assert "503: queue_full" in (stats.last_error or "")

    own_service.stop()
    own_service.env["COLLAPSE_MONITOR_SCORING_PAUSED"] = "false"
    own_service.start()  # the worker now drains the queue, and the client's next retry gets in
    assert monitor.flush(120)
    assert [s for s, _ in own_service.batches("queue-full")] == [1, 2, 3, 4]
    assert monitor.stats().rejected == 0
    monitor.close()
