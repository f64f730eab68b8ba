"""End to end: uvicorn in a subprocess, real HTTP, a real Prometheus scraping it, workers killed mid-scoring."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from bench.serving import BIN, wait_until
from service.storage.tables import Batch, MetricPoint
from tests.e2e.conftest import need, service_env, start_prometheus, start_service
from tests.fixtures import trajectories

pytestmark = pytest.mark.e2e


def wait_done(base: str, batch_id: str, timeout: float = 120) -> dict:
    result: dict = {}

    def finished() -> bool:
        result.update(httpx.get(f"{base}/v1/batches/{batch_id}").json())
        return result["status"] in ("done", "failed")

    wait_until(finished, timeout, f"batch {batch_id}")
    return result


def test_ingest_score_scrape_with_a_real_prometheus(processes, tmp_path):
    need("prometheus")  # skipped (or failed under CI) before anything starts
    base = start_service(processes, service_env(tmp_path))
    with httpx.Client(base_url=base) as http:
        assert http.post("/v1/runs", json={"name": "e2e", "sampler": {"num_samples": 6}}).status_code == 201
        ids = [
            http.post("/v1/runs/e2e/batches", json={"step": s, "trajectories": trajectories()}).json()["batch_id"]
            for s in (1, 2)
        ]
        statuses = [wait_done(base, b) for b in ids]
    assert [s["status"] for s in statuses] == ["done", "done"]

    target = base.removeprefix("http://")
    api = start_prometheus(
        processes, tmp_path, f"  - job_name: collapse-monitor\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    found: dict = {}

    def scraped() -> bool:
        data = httpx.get(api, params={"query": 'collapse_monitor_mi_estimate_nats{run="e2e"}'}).json()["data"]
        found.update({r["metric"]["sampler"]: float(r["value"][1]) for r in data["result"]})
        return len(found) == 2

    wait_until(scraped, 60, "Prometheus to scrape the service")
    expected = statuses[1]["results"]["samplers"]
    assert found == {
        "first_turn": pytest.approx(expected["first_turn"]["metrics"]["mi_estimate"], rel=1e-12),
        "trajectory": pytest.approx(expected["trajectory"]["metrics"]["mi_estimate"], rel=1e-12),
    }
    step = httpx.get(api, params={"query": 'collapse_monitor_last_step{run="e2e"}'}).json()["data"]["result"]
    assert float(step[0]["value"][1]) == 2
    up = httpx.get(api, params={"query": 'up{job="collapse-monitor"}'}).json()["data"]["result"]
    assert float(up[0]["value"][1]) == 1


PUSH = "I push the box to the goal. " * 4


def heavy_batch(step: int, groups: int = 16) -> dict:
    """Enough distinct prompts and reasonings that the tiny model needs about a second on 2 cores (16 groups).

    Every row's reasoning is its own: the kernel scores a reasoning several rows carry once, so rows that
    differed only by their group's 3 rewards made a batch of 48 groups as cheap as one of 3 rows.
    """
    out = []
    for g in range(groups):
        for k in range(3):
            out.append(
                {
                    "group_id": g,
                    "reward": float(k),
                    "turns": [
                        {
                            "prompt": f"Step {step}. Board {g}-{t}: " + "wall floor box goal " * 12,
                            "response": f"<think>{PUSH}{g}-{k}</think><answer>Up</answer>",
                        }
                        for t in range(2)
                    ],
                }
            )
    return {"step": step, "trajectories": out}


def test_a_worker_killed_mid_scoring_loses_nothing_and_scores_once(processes, tmp_path, request):
    url = request.getfixturevalue("postgres_url")
    env = service_env(tmp_path, url, COLLAPSE_MONITOR_LEASE_SECONDS="2")
    base = start_service(processes, env, "--no-worker")
    worker_args = [str(BIN / "collapse-monitor"), "worker"]
    with httpx.Client(base_url=base, timeout=30) as http:
        run = {"name": "crash", "sampler": {"num_samples": None, "samplers": ["trajectory"]}}
        assert http.post("/v1/runs", json=run).status_code == 201
        ids = [http.post("/v1/runs/crash/batches", json=heavy_batch(s)).json()["batch_id"] for s in range(3)]
    first = processes.start("worker-1", worker_args, env)
    wait_until(lambda: httpx.get(f"{base}/v1/batches/{ids[0]}").json()["status"] == "scoring", 60, "scoring to start")
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert httpx.get(f"{base}/v1/batches/{ids[0]}").json()["status"] == "scoring"  # killed before finishing
    time.sleep(2.5)  # the lease runs out
    processes.start("worker-2", worker_args, env)
    statuses = [wait_done(base, b, timeout=300) for b in ids]
    assert [s["status"] for s in statuses] == ["done"] * 3, [s["error"] for s in statuses]
    assert statuses[0]["attempts"] == 2
    engine = create_engine(url)
    with engine.connect() as connection:
        per_batch = connection.execute(
            select(
                MetricPoint.batch_id, func.count(), func.count(func.distinct(MetricPoint.sampler + MetricPoint.name))
            ).group_by(MetricPoint.batch_id)
        ).all()
        queued = connection.execute(select(func.count()).select_from(Batch).where(Batch.status != "done")).scalar()
    engine.dispose()
    assert len(per_batch) == 3
    assert all(total == distinct for _, total, distinct in per_batch)
    assert queued == 0
