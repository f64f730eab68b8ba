"""Workers stop promptly on SIGTERM (``docker stop``, compose scaling down), mid-scoring included,
and a worker killed mid-scoring takes its batch back when it restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from bench.serving import BIN, wait_until
from service.storage.tables import MetricPoint
from tests.e2e.conftest import service_env, start_service
from tests.e2e.test_service_e2e import heavy_batch

pytestmark = pytest.mark.e2e


def test_a_worker_exits_cleanly_within_seconds_of_sigterm(processes, tmp_path, postgres_url):
    worker = processes.start("worker", [str(BIN / "collapse-monitor"), "worker"], service_env(tmp_path, postgres_url))
    wait_until(lambda: " started" in processes.log("worker"), 120, "the worker to start")
    asked = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, processes.log("worker")
    # Its alert dispatcher used to be joined without being told to stop: 30 s, past compose's grace period.
    assert time.monotonic() - asked < 10


# Forwards of 512 tokens at most: long_run's batch then takes many of them (the tiny model ran it whole in 3 s).
LONG_RUN_LIMIT = {"COLLAPSE_MONITOR_MAX_BATCH_TOKENS": "512"}


def long_run(base: str) -> str:
    """A run and one batch whose scoring takes many forwards: 48 groups, 9 times the pairs of 16, scored
    in forwards of 512 tokens (``LONG_RUN_LIMIT``): ~13 s beside other work here, and a SIGTERM 3 s in
    must find it mid-scoring (in forwards of the default size, 3 s in all on an idle machine)."""
    with httpx.Client(base_url=base, timeout=30) as http:
        run = {"name": "long", "sampler": {"num_samples": None, "samplers": ["trajectory"]}}
        assert http.post("/v1/runs", json=run).status_code == 201
        response = http.post("/v1/runs/long/batches", json=heavy_batch(1, groups=48))
        assert response.status_code == 202, response.json()
        return str(response.json()["batch_id"])


def status_of(base: str, batch_id: str) -> dict:
    return dict(httpx.get(f"{base}/v1/batches/{batch_id}").json())


def points_once(url: str) -> bool:
    engine = create_engine(url)
    with engine.connect() as connection:
        total, distinct = connection.execute(
            select(func.count(), func.count(func.distinct(MetricPoint.sampler + MetricPoint.name)))
        ).one()
    engine.dispose()
    return bool(total) and total == distinct


def worker_scoring_long_run(
    processes, tmp_path, postgres_url
) -> tuple[dict[str, str], str, str, subprocess.Popen[bytes]]:
    """A service without a worker and ``worker-1`` scoring ``long_run``'s batch under a 300 s lease:
    (the environment, the service's URL, the batch id, worker-1)."""
    env = service_env(tmp_path, postgres_url, COLLAPSE_MONITOR_LEASE_SECONDS="300", **LONG_RUN_LIMIT)
    base = start_service(processes, env, "--no-worker")
    batch_id = long_run(base)
    worker = processes.start("worker-1", [str(BIN / "collapse-monitor"), "worker"], env)
    wait_until(lambda: status_of(base, batch_id)["status"] == "scoring", 120, "scoring to start")
    return env, base, batch_id, worker


def test_sigterm_mid_scoring_exits_within_seconds_and_another_worker_scores_the_batch_once(
    processes, tmp_path, postgres_url
):
    env, base, batch_id, first = worker_scoring_long_run(processes, tmp_path, postgres_url)
    time.sleep(3)  # past the model's load (interruptible too), into the forwards
    asked = time.monotonic()
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0, processes.log("worker-1")
    assert time.monotonic() - asked < 10
    assert f"batch {batch_id} is back in the queue" in processes.log("worker-1")  # it was mid-scoring
    assert (status_of(base, batch_id)["status"], status_of(base, batch_id)["attempts"]) == ("queued", 0)
    processes.start("worker-2", [str(BIN / "collapse-monitor"), "worker"], env)
    wait_until(lambda: status_of(base, batch_id)["status"] == "done", 280, "the other worker to score it")
    assert status_of(base, batch_id)["attempts"] == 1  # the shutdown did not count as an attempt
    assert points_once(postgres_url)


def test_serve_with_its_embedded_worker_exits_within_seconds_of_sigterm_mid_scoring(processes, tmp_path):
    env = service_env(tmp_path, COLLAPSE_MONITOR_LEASE_SECONDS="300", **LONG_RUN_LIMIT)
    base = start_service(processes, env)
    batch_id = long_run(base)
    wait_until(lambda: status_of(base, batch_id)["status"] == "scoring", 120, "scoring to start")
    serve = processes.running[-1]
    asked = time.monotonic()
    serve.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal once its shutdown is complete (a shell sees 143, systemd a clean stop).
    assert serve.wait(timeout=60) in (0, -signal.SIGTERM), processes.log("serve")
    assert "Application shutdown complete" in processes.log("serve")
    assert time.monotonic() - asked < 10
    assert f"batch {batch_id} is back in the queue" in processes.log("serve")
    base = start_service(processes, env)
    wait_until(lambda: status_of(base, batch_id)["status"] == "done", 280, "the restarted server to score it")
    assert status_of(base, batch_id)["attempts"] == 1


def test_a_worker_killed_mid_scoring_and_restarted_takes_its_batch_back_without_waiting_out_the_lease(
    processes, tmp_path, postgres_url
):
    env, base, batch_id, killed = worker_scoring_long_run(processes, tmp_path, postgres_url)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert status_of(base, batch_id)["status"] == "scoring"  # leased for 300 s to a dead process
    processes.start("worker-1-restarted", [str(BIN / "collapse-monitor"), "worker"], env)
    # Well inside the 300 s lease: only taking the batch back at start can finish it in time.
    wait_until(lambda: status_of(base, batch_id)["status"] == "done", 240, "the restarted worker to score it")
    assert status_of(base, batch_id)["attempts"] == 2  # the crash counted
    assert "scoring it again" in processes.log("worker-1-restarted")
    assert points_once(postgres_url)


def test_a_worker_takes_no_batch_while_scoring_is_paused_and_one_started_without_it_scores_it(
    processes, tmp_path, postgres_url
):
    env = service_env(tmp_path, postgres_url, **LONG_RUN_LIMIT)
    base = start_service(processes, env, "--no-worker")
    batch_id = long_run(base)
    paused = processes.start(
        "paused", [str(BIN / "collapse-monitor"), "worker"], {**env, "COLLAPSE_MONITOR_SCORING_PAUSED": "true"}
    )
    wait_until(lambda: "scoring is paused" in processes.log("paused"), 120, "the paused worker to start")
    time.sleep(3)  # it polls every 0.05 s when it scores: 60 chances to take the batch
    assert (status_of(base, batch_id)["status"], status_of(base, batch_id)["attempts"]) == ("queued", 0)
    paused.send_signal(signal.SIGTERM)
    assert paused.wait(timeout=60) == 0, processes.log("paused")
    processes.start("worker", [str(BIN / "collapse-monitor"), "worker"], env)
    wait_until(lambda: status_of(base, batch_id)["status"] == "done", 280, "the unpaused worker to score it")
