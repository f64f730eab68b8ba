"""Steps off the schedule are finished at ingest (no worker), through the worker's own finish: figures,
points, alerts (in step order, behind a scheduled step still queued), counters, idempotency."""

from __future__ import annotations

import pytest

from service.jobs.scorers import ScorerPool
from service.jobs.worker import Worker
from service.storage.database import make_engine, make_sessions

pytestmark = pytest.mark.integration

# think_tags: a batch without tags carries no reasoning, so NoReasoning fires after `window` such batches.
RUN = {
    "name": "r",
    "schedule": {"every": 3},
    "reasoning_extraction": "think_tags",
    "sampler": {"num_samples": 4, "samplers": ["first_turn"]},
    "alerts": {"window": 2},
}


def batch(step: int, reasoning: bool, key: str | None = None) -> dict:
    response = "<think>left, then up</think>Up." if reasoning else "Up."
    trajectories = [
        {"group_id": g, "reward": float(k), "turns": [{"prompt": f"Room {g}: which way?", "response": response}]}
        for g in range(2)
        for k in range(2)
    ]
    return {"step": step, "trajectories": trajectories} | ({"idempotency_key": key} if key else {})


def post(client, step: int, reasoning: bool, key: str | None = None) -> dict:
    response = client.post("/v1/runs/r/batches", json=batch(step, reasoning, key))
    assert response.status_code == 202, response.json()
    answer: dict = response.json()
    return answer


def series(client, name: str) -> dict[int, float]:
    points = client.get("/v1/runs/r/metrics", params={"names": name, "sampler": "all"}).json()["points"]
    return {p["step"]: p["value"] for p in points}


def alerts(client) -> list[tuple[str, int, str]]:
    return sorted((a["rule"], a["onset_step"], a["state"]) for a in client.get("/v1/runs/r/alerts").json())


@pytest.fixture
def no_worker(database_url, client_for, settings_for):
    """The API with no worker anywhere, and a worker to run by hand on the same database."""
    client = client_for(database_url, embedded_worker=False)
    assert client.post("/v1/runs", json=RUN).status_code == 201
    engine = make_engine(database_url)
    settings = settings_for(database_url)
    yield client, Worker(make_sessions(engine), settings, ScorerPool(settings))
    engine.dispose()


def test_a_step_off_the_schedule_is_done_with_its_figures_and_alerts_without_a_worker(no_worker):
    client, _ = no_worker
    answers = [post(client, step, reasoning=False) for step in (2, 4)]
    assert [a["status"] for a in answers] == ["done", "done"]
    status = client.get(answers[0]["status_url"]).json()
    assert status["status"] == "done"
    assert status["results"]["scored"] is False
    assert "samplers" not in status["results"]
    assert status["results"]["figures"]["reward_mean"] == 0.5
    assert status["tokens_scored"] == 0
    assert series(client, "valid_thinking_rate") == {2: 0.0, 4: 0.0}
    assert alerts(client) == [("NoReasoning", 2, "firing")]
    metrics = client.get("/metrics").text
    assert 'collapse_monitor_batches_scored_total{status="done"} 2.0' in metrics
    assert "collapse_monitor_queue_depth 0.0" in metrics


def test_an_off_schedule_step_sent_again_is_a_replay_recorded_once(no_worker):
    client, _ = no_worker
    first = post(client, 2, reasoning=False, key="k-2")
    again = post(client, 2, reasoning=False, key="k-2")
    assert again == first | {"replayed": True}
    assert series(client, "reward_mean") == {2: 0.5}
    other = client.post("/v1/runs/r/batches", json=batch(2, reasoning=True, key="k-2"))
    assert other.status_code == 409
    assert other.json()["field"] == "batch_id"
    without_key = [post(client, 5, reasoning=False) for _ in range(2)]
    assert without_key[1] == without_key[0] | {"replayed": True}
    assert client.get("/v1/runs/r").json()["batches"] == {"done": 2}


def test_alerts_of_off_schedule_steps_wait_for_an_earlier_scheduled_step_and_come_out_in_step_order(no_worker):
    client, worker = no_worker
    # Steps 1 and 3 (scheduled) carry reasoning and wait for the worker; 2, 4 and 5 carry none and are done at
    # once. Evaluated as they arrived, 2 and 4 would make two batches in a row without reasoning and fire.
    queued = {step: post(client, step, reasoning=True)["batch_id"] for step in (1, 3)}
    for step in (2, 4, 5):
        assert post(client, step, reasoning=False)["status"] == "done"
    assert series(client, "valid_thinking_rate") == {2: 0.0, 4: 0.0, 5: 0.0}
    assert alerts(client) == []  # behind step 1, still queued
    assert worker.run_once()
    assert client.get(f"/v1/batches/{queued[1]}").json()["status"] == "done"
    assert alerts(client) == [("NoReasoning", 2, "pending")]  # 1 and 2 evaluated; 4 and 5 wait behind 3
    assert worker.run_once()
    assert client.get(f"/v1/batches/{queued[3]}").json()["status"] == "done"
    assert series(client, "valid_thinking_rate") == {1: 1.0, 2: 0.0, 3: 1.0, 4: 0.0, 5: 0.0}
    assert alerts(client) == [("NoReasoning", 4, "firing")]  # as in step order: 4 and 5, never 2


def test_a_scheduled_step_that_fails_lets_the_steps_after_it_be_evaluated(no_worker):
    client, worker = no_worker
    unknown_ids = batch(1, reasoning=True)
    for trajectory in unknown_ids["trajectories"]:
        trajectory["turns"] = [{"prompt_token_ids": [1, 2], "reasoning_token_ids": [1, 99999]}]
    failing = client.post("/v1/runs/r/batches", json=unknown_ids).json()["batch_id"]
    for step in (2, 3 + 1):
        post(client, step, reasoning=False)
    assert alerts(client) == []
    assert worker.run_once()
    assert client.get(f"/v1/batches/{failing}").json()["status"] == "failed"
    assert alerts(client) == [("NoReasoning", 2, "firing")]
