"""Large bodies against a real `collapse-monitor serve`: refused on the headers before they are parsed, and
parsed within a bounded memory (RSS read from /proc of the server process)."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.serving import BIN, Memory, post_at_once, token_ids_body
from tests.e2e.conftest import service_env, start_service

pytestmark = pytest.mark.e2e
JSON = {"content-type": "application/json"}
MB = 1e6


def rejections(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "collapse_monitor_rejections"]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_an_anonymous_30_mb_malformed_body_is_refused_before_it_is_parsed(tmp_path, processes):
    """Issue 17: the body was json-decoded on the event loop before its 401 (or got a 422 instead)."""
    env = service_env(tmp_path, COLLAPSE_MONITOR_SCORING_PAUSED="true")
    subprocess.run([str(BIN / "collapse-monitor"), "tokens", "create", "--scope", "admin"], env=env, check=True)
    base = start_service(processes, env)
    body = b'{"step": 1, "trajectories": [' + b"7," * (15 * 1024 * 1024)  # 30 MB; the error is at its very end
    started = time.perf_counter()
    with pytest.raises(json.JSONDecodeError):
        json.loads(body)
    parse_seconds = time.perf_counter() - started  # what the old server spent before answering
    before = rejections(base)
    with httpx.Client(base_url=base, timeout=120) as client:
        started = time.perf_counter()
        refused = client.post("/v1/runs/r/batches", content=body, headers=JSON)
        answer_seconds = time.perf_counter() - started
        assert (refused.status_code, refused.json()["error"]) == (401, "unauthorized")
        assert client.get("/healthz").status_code == 200  # the same connection serves on
    assert answer_seconds < parse_seconds / 3, (answer_seconds, parse_seconds)
    after = rejections(base)
    assert after["unauthorized"] == before["unauthorized"] + 1
    assert after["validation"] == before["validation"]


def test_large_token_id_bodies_are_parsed_within_a_bounded_memory(tmp_path, processes):
    """Issue 17: one token-id body peaked at ~14x its size, and four concurrent 30 MB bodies at 1.5 GB."""
    env = service_env(
        tmp_path,
        COLLAPSE_MONITOR_SCORING_PAUSED="true",
        COLLAPSE_MONITOR_RATE_LIMIT_PER_SECOND="0",
        COLLAPSE_MONITOR_MAX_SCORING_COST=str(10**12),
    )
    base = start_service(processes, env)
    (server,) = processes.running
    memory = Memory(server.pid)
    assert httpx.post(f"{base}/v1/runs", json={"name": "r", "sampler": {"num_samples": 2}}).status_code == 201
    bodies = [token_ids_body(step, seed=step) for step in range(1, 6)]
    size = len(bodies[0])

    with httpx.Client(base_url=base, timeout=120) as client:
        warm = client.post("/v1/runs/r/batches", content=token_ids_body(100, 0)[: 2 * 1024], headers=JSON)
        assert warm.status_code == 422  # a first (cut) request: the server's lazy imports are loaded
        start = memory.reset()
        assert client.post("/v1/runs/r/batches", content=bodies[0], headers=JSON).status_code == 202
    one = (memory.peak() - start) / size
    assert one < 9, f"one {size / MB:.0f} MB body grew the server by {one:.1f}x its size"  # was 12.4x

    start = memory.reset()
    statuses = post_at_once(f"{base}/v1/runs/r/batches", bodies[1:], timeout=120)
    four = (memory.peak() - start) / size
    assert statuses == [202] * 4
    assert four < 20, f"four concurrent bodies grew the server by {four:.1f}x one body"  # was 28-38x
