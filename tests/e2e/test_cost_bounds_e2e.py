"""A valid but expensive batch against a real `collapse-monitor serve` over real HTTP: answered at once,
and no other client waits for it (issue 17)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.e2e.conftest import service_env, start_service

pytestmark = pytest.mark.e2e


def test_a_batch_repeating_think_20000_times_is_answered_at_once_and_holds_no_other_request(processes, tmp_path):
    base = start_service(processes, service_env(tmp_path))
    assert httpx.post(f"{base}/v1/runs", json={"name": "tags"}).status_code == 201
    # 4 turns of 140k characters, 20,000 opening tags each: the lazy regex took 58 s on this batch and
    # held the event loop's thread pool and the interpreter; the worker then scanned it again.
    response = "<think>" * 20_000 + " and then" * 1_000
    batch = {
        "step": 1,
        "trajectories": [
            {"group_id": g, "reward": float(g), "turns": [{"prompt": f"Task {g}", "response": response}]}
            for g in range(4)
        ],
    }
    answer: dict = {}

    def post() -> None:
        start = time.monotonic()
        answer["response"] = httpx.post(f"{base}/v1/runs/tags/batches", json=batch, timeout=120)
        answer["seconds"] = time.monotonic() - start

    poster = threading.Thread(target=post)
    poster.start()
    waits: list[float] = []
    with httpx.Client(base_url=base, timeout=120) as other:
        while poster.is_alive() or len(waits) < 20:
            start = time.monotonic()
            assert other.get("/v1/runs").status_code == 200
            waits.append(time.monotonic() - start)
            # Under the default rate limit (50 per second, 200 burst): a tight loop would be answered 429.
            time.sleep(0.05)
        poster.join()
        accepted = answer["response"]
        assert accepted.status_code == 202, accepted.text
        assert answer["seconds"] < 10, answer
        # The worker reads the batch next (and refuses it: past the tiny scorer's context); meanwhile
        # the API keeps answering.
        deadline = time.monotonic() + 120
        while True:
            polled = other.get(f"/v1/batches/{accepted.json()['batch_id']}")
            assert polled.status_code == 200, polled.text
            if (status := polled.json())["status"] in ("done", "failed"):
                break
            start = time.monotonic()
            assert other.get("/v1/runs").status_code == 200
            waits.append(time.monotonic() - start)
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
    assert max(waits) < 5, sorted(waits)[-5:]
