"""/metrics: the exported families, their labels and values, and Prometheus naming conventions."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import EXPORTED
from tests.fixtures import trajectories, wait_for

pytestmark = pytest.mark.integration


def families(client) -> dict:
    return {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}


def test_scored_diagnostics_and_service_figures_are_exported(database_url, client_for):
    client = client_for(database_url)
    client.post("/v1/runs", json={"name": "run-a", "sampler": {"num_samples": 6}})
    status = wait_for(
        client,
        client.post("/v1/runs/run-a/batches", json={"step": 7, "trajectories": trajectories()}).json()["batch_id"],
    )
    found = families(client)
    for exported in EXPORTED:
        assert f"collapse_monitor_{exported.name}" in found, exported.name
    mi = {(s.labels["run"], s.labels["sampler"]): s.value for s in found["collapse_monitor_mi_estimate_nats"].samples}
    stored = status["results"]["samplers"]
    assert mi == {
        ("run-a", "first_turn"): pytest.approx(stored["first_turn"]["metrics"]["mi_estimate"]),
        ("run-a", "trajectory"): pytest.approx(stored["trajectory"]["metrics"]["mi_estimate"]),
    }
    reward_std = found["collapse_monitor_reward_std"].samples
    assert [(s.labels, s.value) for s in reward_std] == [
        ({"run": "run-a", "sampler": "all"}, pytest.approx(status["results"]["figures"]["rollout/in_group_reward_std"]))
    ]
    assert found["collapse_monitor_last_step"].samples[0].value == 7
    assert found["collapse_monitor_database_up"].samples[0].value == 1
    scored = {s.labels["status"]: s.value for s in found["collapse_monitor_batches_scored"].samples}
    assert scored == {"done": 1.0, "failed": 0.0}
    histogram = {
        s.name: s.value for s in found["collapse_monitor_scoring_duration_seconds"].samples if "le" not in s.labels
    }
    assert histogram["collapse_monitor_scoring_duration_seconds_count"] == 1
    assert histogram["collapse_monitor_scoring_duration_seconds_sum"] == pytest.approx(status["scoring_seconds"])
    assert found["collapse_monitor_scored_tokens"].samples[0].value == status["tokens_scored"] > 0
    assert found["collapse_monitor_scorer_tokens_per_second"].samples[0].value > 0
    assert found["collapse_monitor_queue_depth"].samples[0].value == 0


def test_names_follow_prometheus_conventions(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    client.get("/healthz")
    for family in families(client).values():
        assert re.fullmatch(r"collapse_monitor_[a-z0-9_]+", family.name), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        for sample in family.samples:
            labels = {"run", "sampler", "status", "reason", "method", "route", "stream", "le", "scorer"}
            assert set(sample.labels) <= labels
    requests = families(client)["collapse_monitor_requests"].samples
    assert any(s.labels["route"] == "/healthz" and s.labels["status"] == "200" for s in requests)
    # Every named scorer is up until a worker finds its server down (tests/integration/test_remote_scorer_outage).
    up = {s.labels["scorer"]: s.value for s in families(client)["collapse_monitor_scorer_up"].samples}
    assert up == {"tiny-random": 1.0, "smollm2-135m": 1.0}
