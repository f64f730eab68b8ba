"""A step over its scoring budget is scored within a plan (fewer rows, a shorter window) and says so."""

from __future__ import annotations

import pytest

from tests.fixtures import wait_for

pytestmark = pytest.mark.integration


def wide_batch(step: int, n_groups: int = 4, per_group: int = 8, reasoning_tokens: int = 100) -> dict:
    """``n_groups`` prompts x ``per_group`` rollouts of token ids."""
    return {
        "step": step,
        "trajectories": [
            {
                "group_id": g,
                "reward": float(k % 2),
                "turns": [
                    {
                        "prompt_token_ids": [10 + g] * 20,
                        "reasoning_token_ids": [(20 + 7 * g + k + t) % 200 for t in range(reasoning_tokens)],
                    }
                ],
            }
            for g in range(n_groups)
            for k in range(per_group)
        ],
    }


def test_a_step_over_its_budget_is_scored_at_the_floors_and_reports_its_plan(database_url, client_for):
    client = client_for(database_url)
    run = {"name": "hurried", "schedule": {"budget_seconds": 0.0001}, "sampler": {"num_samples": 32}}
    assert client.post("/v1/runs", json=run).status_code == 201
    assert client.get("/v1/runs/hurried").json()["schedule"] == {"every": 1, "budget_seconds": 0.0001}
    assert client.post("/v1/runs", json=run).status_code == 200  # a re-post of the same settings

    plans = []
    for step in (1, 2):
        accepted = client.post("/v1/runs/hurried/batches", json=wide_batch(step))
        status = wait_for(client, accepted.json()["batch_id"])
        assert status["status"] == "done", status
        plans.append({name: s["plan"] for name, s in status["results"]["samplers"].items()})
        first_turn = status["results"]["samplers"]["first_turn"]
        assert first_turn["rows"] == 16
        assert first_turn["columns"] == 4  # the prompts stay
        assert first_turn["window"]["max_reasoning_tokens"] == 64
        assert "mi_estimate" in first_turn["metrics"]

    first = plans[0]["first_turn"]
    assert (first["rows"], first["rows_available"], first["max_reasoning_tokens"]) == (16, 32, 64)
    assert first["is_within_budget"] is False
    assert first["reason"].startswith("even the floors")
    assert first["rate_source"] == "warm-up"  # the first budgeted step of this scorer in this worker
    assert first["tokens"] == first["predicted_tokens"]
    assert first["predicted_seconds"] > 0
    assert first["seconds"] > 0
    assert first["budget_seconds"] <= 0.0001
    assert plans[1]["first_turn"]["rate_source"] == "measured"
    trajectory = plans[0]["trajectory"]
    assert (trajectory["rows"], trajectory["rows_available"]) == (16, 32)  # each draw is its own column

    series = client.get("/v1/runs/hurried/metrics", params={"names": "planned_rows_ratio"}).json()["points"]
    assert sorted((p["sampler"], p["step"], p["value"]) for p in series) == [
        ("first_turn", 1, 0.5),
        ("first_turn", 2, 0.5),
        ("trajectory", 1, 0.5),
        ("trajectory", 2, 0.5),
    ]
    exposition = client.get("/metrics").text  # what a dashboard or an alert on the budget reads
    assert 'collapse_monitor_planned_rows_ratio{run="hurried",sampler="first_turn"} 0.5' in exposition


def test_a_run_without_a_budget_scores_every_row_under_a_service_budget(database_url, client_for):
    client = client_for(database_url, scoring_budget_seconds=0.0001)
    client.post("/v1/runs", json={"name": "patient", "schedule": {"budget_seconds": 0}, "sampler": {"num_samples": 32}})
    client.post("/v1/runs", json={"name": "default", "sampler": {"num_samples": 32, "samplers": ["first_turn"]}})
    for name in ("patient", "default"):
        accepted = client.post(f"/v1/runs/{name}/batches", json=wide_batch(1))
        status = wait_for(client, accepted.json()["batch_id"])
        assert status["status"] == "done", status
        plan = status["results"]["samplers"]["first_turn"]["plan"]
        if name == "patient":
            assert (plan["rows"], plan["budget_seconds"], plan["max_reasoning_tokens"]) == (32, None, 512)
            assert plan["reason"] == "no scoring budget: every row at the full window"
        else:  # the service's budget applies to a run that sets none
            assert plan["rows"] == 16
            assert plan["budget_seconds"] <= 0.0001


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (-1, "Input should be greater than or equal to 0"),
        (100_000, "Input should be less than or equal to 86400"),
        ("30", "Input should be a valid number"),
    ],
)
def test_a_budget_out_of_range_is_refused_naming_the_field(database_url, client_for, budget, message):
    client = client_for(database_url)
    answer = client.post("/v1/runs", json={"name": "bad-budget", "schedule": {"budget_seconds": budget}})
    assert answer.status_code == 422
    [error] = answer.json()["detail"]
    assert error["loc"] == ["body", "schedule", "budget_seconds"]
    assert error["msg"] == message
    assert client.get("/v1/runs/bad-budget").status_code == 404
