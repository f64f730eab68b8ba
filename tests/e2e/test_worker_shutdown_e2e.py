"""A worker process stops promptly on SIGTERM (``docker stop``, compose scaling down), alert sender included."""

from __future__ import annotations

import signal
import time

import pytest

from tests.e2e.conftest import BIN, service_env, wait_until

pytestmark = pytest.mark.e2e


def test_a_worker_exits_cleanly_within_seconds_of_sigterm(processes, tmp_path, postgres_url):
    worker = processes.start("worker", [str(BIN / "collapse-monitor"), "worker"], service_env(tmp_path, postgres_url))
    wait_until(lambda: " started" in processes.log("worker"), 120, "the worker to start")
    asked = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, processes.log("worker")
    # Its alert dispatcher used to be joined without being told to stop: 30 s, past compose's grace period.
    assert time.monotonic() - asked < 10
