"""A run whose steps arrive faster than they are scored says so: in the 202 answer and in the run's read."""

from __future__ import annotations

import pytest

from service.reads.pace import Pace
from tests.fixtures import long_batch, wait_for

pytestmark = pytest.mark.integration


def test_a_backlog_growing_faster_than_it_is_scored_is_reported_with_the_figures_to_change(database_url, client_for):
    # Whole 2,000-token reasonings: a step of 8 rows x 4 prompts takes the tiny scorer seconds, while
    # the posts below take milliseconds each.
    client = client_for(database_url, max_reasoning_tokens=0)
    client.post("/v1/runs", json={"name": "fast-trainer", "sampler": {"samplers": ["first_turn"]}})
    first = client.post("/v1/runs/fast-trainer/batches", json=long_batch(2000, step=1)).json()
    assert first["warnings"] == []  # nothing is known of the pace yet
    for step in range(2, 12):
        assert client.post("/v1/runs/fast-trainer/batches", json=long_batch(2000, step=step)).status_code == 202
    assert wait_for(client, first["batch_id"], timeout=300)["status"] == "done"

    lag = client.get("/v1/runs/fast-trainer").json()["scoring_lag"]
    assert lag is not None
    assert lag.startswith("scoring falls behind run 'fast-trainer': ")
    for remedy in ("schedule.every", "sampler.num_samples", "max_reasoning_tokens", "schedule.budget_seconds"):
        assert remedy in lag
    answer = client.post("/v1/runs/fast-trainer/batches", json=long_batch(2000, step=12)).json()
    assert any(w.startswith("scoring falls behind run 'fast-trainer'") for w in answer["warnings"])


def test_a_run_scored_as_fast_as_its_steps_arrive_reports_no_lag(database_url, client_for):
    client = client_for(database_url)
    client.post("/v1/runs", json={"name": "steady", "sampler": {"samplers": ["first_turn"]}})
    for step in range(1, 4):
        accepted = client.post("/v1/runs/steady/batches", json=long_batch(20, step=step)).json()
        assert wait_for(client, accepted["batch_id"])["status"] == "done"
        assert accepted["warnings"] == []
    assert client.get("/v1/runs/steady").json()["scoring_lag"] is None


@pytest.mark.parametrize(
    ("pace", "lagging"),
    [
        (Pace(waiting=5, seconds_per_step=40.0, seconds_between_steps=10.0), True),
        (Pace(waiting=2, seconds_per_step=40.0, seconds_between_steps=10.0), False),  # a short queue drains
        (Pace(waiting=9, seconds_per_step=5.0, seconds_between_steps=10.0), False),  # keeps up: it will drain
        (Pace(waiting=9, seconds_per_step=None, seconds_between_steps=10.0), False),  # nothing scored yet
    ],
)
def test_lag_needs_a_backlog_and_steps_costlier_than_their_interval(pace, lagging):
    assert pace.is_lagging is lagging
    warning = pace.warning("r")
    assert (warning is not None) is lagging
    if lagging:
        assert "a step takes ~40 s to score and steps arrive every ~10 s" in str(warning)
        assert "Score every 4th step or more (schedule.every)" in str(warning)
        assert "a per-step scoring budget below the step interval (schedule.budget_seconds, e.g. 8:" in str(warning)
