"""The HTTP contract on SQLite and Postgres: status codes, whole error bodies, nothing written on rejection."""

from __future__ import annotations

import json

import pytest

from service.storage.tables import Batch, Checkpoint, MetricPoint
from tests.fixtures import error_body, row_count, trajectories, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def paused(database_url, client_for):
    """An app that accepts but does not score, with one run named demo."""
    client = client_for(database_url, scoring_paused=True, max_trajectories=20, max_queue_depth=3)
    assert client.post("/v1/runs", json={"name": "demo"}).status_code == 201
    return client


def test_runs_are_created_once_and_fetched_by_name(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    first = client.post("/v1/runs", json={"name": "ppo-1", "metadata": {"algorithm": "PPO", "tags": ["a"]}})
    assert first.status_code == 201
    body = first.json()
    assert body["scorer"] == "tiny-random"
    assert body["sampler"] == {"samplers": ["first_turn", "trajectory"], "num_samples": 64, "seed": 0}
    again = client.post("/v1/runs", json={"name": "ppo-1", "metadata": {"algorithm": "PPO", "tags": ["a"]}})
    assert again.status_code == 200
    assert again.json()["id"] == body["id"]
    assert [r["name"] for r in client.get("/v1/runs").json()] == ["ppo-1"]
    assert client.get("/v1/runs/ppo-1").json()["metadata"]["algorithm"] == "PPO"


def test_a_run_name_with_other_settings_is_a_conflict(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    client.post("/v1/runs", json={"name": "r"})
    response = client.post("/v1/runs", json={"name": "r", "temperature": 0.7, "schedule": {"every": 5}})
    assert response.status_code == 409
    assert response.json() == error_body(
        "run_conflict",
        "run 'r' exists with different settings (schedule, temperature); use a new name for new settings",
        field="schedule",
    )


def test_unknown_scorer_and_bad_run_names_are_refused(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    response = client.post("/v1/runs", json={"name": "r", "scorer": "/etc/passwd"})
    assert response.status_code == 400
    assert response.json() == error_body(
        "invalid_request", "scorer must be one of smollm2-135m, tiny-random, got '/etc/passwd'", field="scorer"
    )
    bad_name = client.post("/v1/runs", json={"name": "../x"})
    assert bad_name.status_code == 422
    assert bad_name.json()["detail"][0]["field"] == "name"


def test_a_batch_is_accepted_before_scoring_and_replays_answer_the_same(paused, database_url):
    body = {"step": 3, "batch_id": "k-3", "trajectories": trajectories()}
    accepted = paused.post("/v1/runs/demo/batches", json=body)
    assert accepted.status_code == 202
    first = accepted.json()
    assert first == {
        "batch_id": first["batch_id"],
        "status": "queued",
        "status_url": f"/v1/batches/{first['batch_id']}",
        "replayed": False,
        "segment": 0,
        "resumed": False,
        "warnings": [],
    }
    # Same content, keys in another order and other spacing: the original batch.
    replay = paused.post(
        "/v1/runs/demo/batches",
        content=json.dumps({"trajectories": body["trajectories"], "batch_id": "k-3", "step": 3}, indent=2),
        headers={"content-type": "application/json"},
    )
    assert replay.status_code == 202
    assert replay.json() == first | {"replayed": True}
    assert row_count(database_url, Batch) == 1
    status = paused.get(first["status_url"]).json()
    assert status["status"] == "queued"
    assert status["run"] == "demo"
    assert status["step"] == 3


def test_a_batch_id_reused_for_other_content_is_a_conflict_and_writes_nothing(paused, database_url):
    paused.post("/v1/runs/demo/batches", json={"step": 1, "batch_id": "k", "trajectories": trajectories()})
    response = paused.post("/v1/runs/demo/batches", json={"step": 2, "batch_id": "k", "trajectories": trajectories()})
    assert response.status_code == 409
    body = response.json()
    assert body["error"] == "batch_id_conflict"
    assert body["field"] == "batch_id"
    assert body["detail"].startswith("batch_id 'k' was already used for different content")
    assert row_count(database_url, Batch) == 1


@pytest.mark.parametrize(
    ("mutate", "field", "message"),
    [
        (lambda b: b["trajectories"][3]["turns"][0].pop("response"), "trajectories[3].turns[0]", "give exactly one of"),
        (lambda b: b["trajectories"][3]["turns"][1].update(reasoning="x"), "trajectories[3].turns[1]", "give exactly"),
        (lambda b: b["trajectories"][0].update(reward="high"), "trajectories[0].reward", "valid number"),
        (lambda b: b["trajectories"][0].update(turns=[]), "trajectories[0].turns", "at least 1 item"),
        (lambda b: b.update(step=-1), "step", "greater than or equal to 0"),
        (lambda b: b.update(trajectories=[]), "trajectories", "at least 1 item"),
        (
            lambda b: b["trajectories"][1]["turns"][0].update(prompt_token_ids=[-4]),
            "trajectories[1].turns[0].prompt_token_ids[0]",
            "greater than or equal to 0",
        ),
        (lambda b: b.update(extra=1), "extra", "Extra inputs are not permitted"),
    ],
)
def test_an_invalid_batch_is_refused_naming_the_field_and_writes_no_row(paused, database_url, mutate, field, message):
    body = {"step": 1, "trajectories": trajectories()}
    mutate(body)
    response = paused.post("/v1/runs/demo/batches", json=body)
    assert response.status_code == 422
    error = response.json()
    assert error["error"] == "validation"
    assert any(d["field"] == field and message in d["msg"] for d in error["detail"]), error
    assert row_count(database_url, Batch) == 0


def test_malformed_json_is_a_422_naming_the_position(paused, database_url):
    response = paused.post(
        "/v1/runs/demo/batches", content=b'{"step": 1,', headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["type"] == "json_invalid"
    assert row_count(database_url, Batch) == 0


def test_unknown_runs_and_batches_are_404(paused):
    response = paused.post("/v1/runs/nope/batches", json={"step": 1, "trajectories": trajectories()})
    assert response.status_code == 404
    assert response.json() == error_body(
        "not_found", "run 'nope' does not exist; create it with POST /v1/runs", field="run"
    )
    assert paused.get("/v1/batches/0123").json() == error_body(
        "not_found", "batch '0123' does not exist", field="batch_id"
    )


def test_batches_over_the_limits_are_413_and_write_nothing(paused, database_url):
    too_many = paused.post("/v1/runs/demo/batches", json={"step": 1, "trajectories": trajectories(n_groups=7)})
    assert too_many.status_code == 413
    assert too_many.json() == error_body(
        "too_large", "a batch may hold at most 20 trajectories, got 21", field="trajectories"
    ) | {"limit": "max_trajectories", "allowed": 20, "got": 21}
    assert row_count(database_url, Batch) == 0


def test_a_run_is_answered_with_the_batch_limits_its_service_enforces(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, max_text_chars=50, max_token_ids=7, max_body_bytes=200_000)
    limits = {
        "max_body_bytes": 200_000,
        "max_trajectories": 4096,
        "max_turns": 256,
        "max_text_chars": 50,
        "max_token_ids": 7,
    }
    assert client.post("/v1/runs", json={"name": "r"}).json()["limits"] == limits  # created
    assert client.post("/v1/runs", json={"name": "r"}).json()["limits"] == limits  # attached
    long_text = [{"group_id": 0, "reward": 1.0, "turns": [{"prompt": "p" * 51, "response": "r"}]}]
    refused = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": long_text})
    assert refused.status_code == 413
    assert refused.json() == {
        "error": "too_large",
        "detail": "prompt may hold at most 50 characters, got 51",
        "field": "trajectories[0].turns[0].prompt",
        "index": 0,
        "limit": "max_text_chars",
        "allowed": 50,
        "got": 51,
    }
    ids = [{"group_id": 0, "reward": 1.0, "turns": [{"prompt_token_ids": [1] * 8, "reasoning_token_ids": [2]}]}]
    refused = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": ids})
    assert {k: refused.json()[k] for k in ("limit", "allowed", "got")} == {
        "limit": "max_token_ids",
        "allowed": 7,
        "got": 8,
    }


def test_bodies_over_the_byte_limit_are_413_declared_or_streamed(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, max_body_bytes=2048)
    client.post("/v1/runs", json={"name": "demo"})
    big = json.dumps({"step": 1, "trajectories": trajectories(n_groups=4)}).encode()
    declared = client.post("/v1/runs/demo/batches", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413
    assert declared.json() == error_body("too_large", f"request bodies may hold at most 2048 bytes, got {len(big)}") | {
        "limit": "max_body_bytes",
        "allowed": 2048,
        "got": len(big),
    }

    def chunks():
        for i in range(0, len(big), 500):
            yield big[i : i + 500]

    streamed = client.post("/v1/runs/demo/batches", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert streamed.json()["detail"].startswith("request bodies may hold at most 2048 bytes")
    assert (streamed.json()["limit"], streamed.json()["allowed"]) == ("max_body_bytes", 2048)
    assert row_count(database_url, Batch) == 0


def test_a_full_queue_answers_503_with_retry_after(paused, database_url):
    for step in range(3):
        assert (
            paused.post("/v1/runs/demo/batches", json={"step": step, "trajectories": trajectories()}).status_code == 202
        )
    response = paused.post("/v1/runs/demo/batches", json={"step": 9, "trajectories": trajectories()})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert response.json()["error"] == "queue_full"
    assert row_count(database_url, Batch) == 3


def test_rejections_are_counted_by_reason(paused):
    paused.post("/v1/runs/nope/batches", json={"step": 1, "trajectories": trajectories()})
    paused.post("/v1/runs/demo/batches", json={"step": "x"})
    text = paused.get("/metrics").text
    assert 'collapse_monitor_rejections_total{reason="not_found"} 1.0' in text
    assert 'collapse_monitor_rejections_total{reason="validation"} 1.0' in text


def test_filter_advice_is_synchronous(paused):
    response = paused.post("/v1/filter", json={"rewards": [[1, 0, 1], [1, 1, 1], [0, 0.5, 1], [3]]})
    assert response.status_code == 200
    body = response.json()
    assert body["selected_groups"] == [0, 2]
    assert body["single_sample_groups"] == [3]
    bad = paused.post("/v1/filter", json={"rewards": [[1], []]})
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["field"] == "rewards[1]"


def test_matrices_become_metric_points_at_once(paused, database_url):
    matrix = {
        "step": 4,
        "batch_id": "m-4",
        "sampler": "verl",
        "row_group_ids": [0, 0, 1, 1],
        "reasoning_lengths": [3, 4, 2, 5],
        "L_seq": [[-3, -9], [-4, -10], [-8, -2], [-12, -5]],
    }
    response = paused.post("/v1/runs/demo/matrices", json=matrix)
    assert response.status_code == 201
    metrics = response.json()["results"]["samplers"]["verl"]["metrics"]
    assert metrics["mi_estimate"] == pytest.approx(0.5438106679304657)
    assert paused.post("/v1/runs/demo/matrices", json=matrix).json()["replayed"] is True
    series = paused.get("/v1/runs/demo/metrics", params={"names": "mi_estimate", "sampler": "verl"}).json()
    assert [(p["step"], p["value"]) for p in series["points"]] == [(4, pytest.approx(0.5438106679304657))]
    bad = paused.post("/v1/runs/demo/matrices", json=matrix | {"batch_id": "m-5", "reasoning_lengths": [1]})
    assert bad.status_code == 400
    assert bad.json() == error_body(
        "invalid_request", "must hold one length per row (4), got 1", field="reasoning_lengths"
    )
    assert row_count(database_url, MetricPoint) == len(paused.get("/v1/runs/demo/metrics").json()["points"])


def test_checkpoints_must_lie_under_the_root(database_url, client_for, tmp_path):
    root = tmp_path / "ckpts"
    (root / "step-10").mkdir(parents=True)
    (root / "step-10" / "config.json").write_text("{}")
    client = client_for(database_url, scoring_paused=True, checkpoint_root=root)
    client.post("/v1/runs", json={"name": "demo", "scorer_mode": "policy"})
    ok = client.post("/v1/runs/demo/checkpoints", json={"path": "step-10", "step": 10})
    assert ok.status_code == 201
    assert ok.json()["path"] == str((root / "step-10").resolve())
    escape = client.post("/v1/runs/demo/checkpoints", json={"path": "../../etc"})
    assert escape.status_code == 400
    assert escape.json()["detail"].startswith("path must lie under the checkpoint root")
    missing = client.post("/v1/runs/demo/checkpoints", json={"path": "step-10", "kind": "lora"})
    assert missing.status_code == 400
    assert "must contain adapter_config.json" in missing.json()["detail"]
    assert row_count(database_url, Checkpoint) == 1


def test_checkpoints_are_refused_when_no_root_is_configured(paused):
    response = paused.post("/v1/runs/demo/checkpoints", json={"path": "x"})
    assert response.status_code == 400
    assert response.json()["detail"].startswith("checkpoints are disabled on this server")


def test_health_and_readiness(paused):
    assert paused.get("/healthz").json() == {"status": "ok"}
    ready = paused.get("/readyz")
    assert ready.status_code == 200, ready.json()
    assert ready.json()["database"] == "ok"


def test_openapi_documents_the_batch_example(paused):
    spec = paused.get("/openapi.json").json()
    batch = spec["paths"]["/v1/runs/{run}/batches"]["post"]
    assert "two groups" in batch["requestBody"]["content"]["application/json"]["examples"]
    assert {"202", "404", "409", "413", "422", "503"} <= set(batch["responses"])


def test_a_scored_batch_is_visible_with_its_results(database_url, client_for):
    client = client_for(database_url)
    client.post("/v1/runs", json={"name": "demo", "sampler": {"num_samples": 8}})
    accepted = client.post("/v1/runs/demo/batches", json={"step": 1, "trajectories": trajectories()}).json()
    status = wait_for(client, accepted["batch_id"])
    assert status["status"] == "done", status
    assert status["scorer"] == "tiny-random"
    samplers = status["results"]["samplers"]
    assert samplers["first_turn"]["rows"] == 8
    assert samplers["trajectory"]["columns"] == 8
    assert len(samplers["first_turn"]["per_prompt"]) == 4
    assert status["results"]["rewards"]["group_ids"] == [0, 1, 2, 3]
    assert status["results"]["figures"]["zero_variance_group_ratio"] == 0.25
