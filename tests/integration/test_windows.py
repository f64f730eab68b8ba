"""Long reasoning is windowed, never failed: the batch ends done, says what was cut, and stores it as a series."""

from __future__ import annotations

import pytest

from tests.fixtures import long_batch, wait_for

pytestmark = pytest.mark.integration


def test_reasoning_past_the_window_is_scored_on_its_opening_and_the_cut_is_stored(database_url, client_for):
    client = client_for(database_url, max_reasoning_tokens=32)
    client.post("/v1/runs", json={"name": "long", "sampler": {"samplers": ["first_turn"]}})
    accepted = client.post("/v1/runs/long/batches", json=long_batch(reasoning_tokens=100))
    assert accepted.status_code == 202, accepted.text
    status = wait_for(client, accepted.json()["batch_id"])
    assert status["status"] == "done", status
    sampler = status["results"]["samplers"]["first_turn"]
    assert (sampler["rows"], sampler["columns"], sampler["skipped_reason"]) == (8, 4, None)
    assert "mi_estimate" in sampler["metrics"]
    assert sampler["window"] == {
        "max_reasoning_tokens": 32,
        "truncated_reasoning_ratio": 1.0,
        "reasoning_tokens_cut": 8 * (100 - 32),
        "prompt_tokens_cut": 0,
        "merged_columns": 0,
    }
    series = client.get("/v1/runs/long/metrics", params={"names": "truncated_reasoning_ratio"}).json()
    assert [(p["sampler"], p["step"], p["value"]) for p in series["points"]] == [("first_turn", 1, 1.0)]


def test_a_pair_past_the_forward_budget_is_windowed_to_fit_instead_of_failing(database_url, client_for):
    # Before windowing: "row 0: its longest (prompt, reasoning) pair needs 339 tokens in one forward, more than
    # max_batch_tokens=256" and the batch failed.
    client = client_for(database_url, max_reasoning_tokens=0, max_batch_tokens=256)
    client.post("/v1/runs", json={"name": "budget", "sampler": {"samplers": ["first_turn"]}})
    accepted = client.post("/v1/runs/budget/batches", json=long_batch(reasoning_tokens=300, prompt_tokens=40))
    status = wait_for(client, accepted.json()["batch_id"])
    assert status["status"] == "done", status
    window = status["results"]["samplers"]["first_turn"]["window"]
    assert window["max_reasoning_tokens"] == 256 - 40 + 1  # the prompts fit whole: they keep what they need
    assert window["truncated_reasoning_ratio"] == 1.0
    assert window["prompt_tokens_cut"] == 0
