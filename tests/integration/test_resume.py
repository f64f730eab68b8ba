"""Resumed training: a step below one already scored starts a new segment that the series, gauges and alerts follow."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.ingest import matrices
from service.storage import queue
from service.storage.tables import Batch
from tests.fixtures import dependence_matrix, trajectories, wait_for

pytestmark = pytest.mark.integration


def feed(client, dependences: list[float], start: int = 1, key: str = "a") -> None:
    for i, dependence in enumerate(dependences):
        body = dependence_matrix(start + i, dependence) | {"sampler": "matrix", "batch_id": f"{key}-{start + i}"}
        assert client.post("/v1/runs/r/matrices", json=body).status_code == 201


def series(client, **params) -> list[dict]:
    params = {"names": "mi_estimate", "sampler": "matrix"} | params
    points: list[dict] = client.get("/v1/runs/r/metrics", params=params).json()["points"]
    return points


def gauge(client, name: str) -> dict[str, float]:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == name:
            return {s.labels.get("sampler", ""): s.value for s in family.samples if s.labels["run"] == "r"}
    return {}


@pytest.fixture
def client(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    assert client.post("/v1/runs", json={"name": "r"}).status_code == 201
    return client


def test_a_resumed_run_replaces_its_series_from_the_resume_step_and_the_gauges_follow(client):
    feed(client, [2.0] * 6)  # steps 1..6
    feed(client, [0.5, 0.5], start=4, key="b")  # resumed from a checkpoint at step 3
    points = series(client)
    assert [(p["step"], p["segment"]) for p in points] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1)]
    everything = series(client, segments="all")
    assert [(p["step"], p["segment"]) for p in everything] == [
        (1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0), (5, 1), (6, 0)
    ]  # fmt: skip
    assert gauge(client, "collapse_monitor_last_step") == {"": 5}
    assert gauge(client, "collapse_monitor_mi_estimate_nats")["matrix"] == pytest.approx(points[-1]["value"])
    assert client.get("/v1/runs/r").json()["last_step"] == 5
    csv = client.get("/v1/runs/r/metrics", params={"names": "mi_estimate", "format": "csv", "segments": "all"}).text
    assert csv.splitlines()[0].endswith(",segment")


def test_a_run_rerun_from_scratch_shows_only_the_new_run(client):
    feed(client, [2.0] * 5)
    feed(client, [1.0] * 2, key="rerun")  # steps 1, 2 again
    assert [(p["step"], p["segment"]) for p in series(client)] == [(1, 1), (2, 1)]


def test_alerts_follow_the_newest_segment_and_fire_again_after_a_resume(client):
    feed(client, [2.0] * 6 + [0.0] * 5)  # collapse from step 7
    (alert,) = client.get("/v1/runs/r/alerts").json()
    assert (alert["rule"], alert["state"]) == ("TemplateCollapse", "firing")
    feed(client, [2.0] * 4, start=3, key="b")  # resumed at step 3, healthy again
    (superseded,) = client.get("/v1/runs/r/alerts").json()
    assert superseded["state"] == "resolved"
    assert "superseded: the run resumed" in superseded["summary"]
    assert gauge(client, "collapse_monitor_alerts") == {}
    feed(client, [0.0] * 4, start=7, key="b")  # collapses again
    states = {(a["state"], a["onset_step"]) for a in client.get("/v1/runs/r/alerts").json()}
    assert ("firing", 7) in states


def started(client) -> dict[str, float]:
    """``collapse_monitor_segments_started_total`` by stream."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "collapse_monitor_segments_started":
            return {s.labels["stream"]: s.value for s in family.samples if s.name.endswith("_total")}
    return {}


def test_a_matrix_step_that_went_back_is_answered_with_its_new_segment_a_warning_and_counted(client, caplog):
    feed(client, [2.0] * 6)  # steps 1..6
    assert started(client) == {"rollouts": 0, "matrix": 0}
    body = dependence_matrix(3, 0.5) | {"sampler": "matrix", "batch_id": "b-3"}
    with caplog.at_level(logging.WARNING, logger="collapse_monitor.api"):
        answer = client.post("/v1/runs/r/matrices", json=body).json()
    assert (answer["segment"], answer["resumed"]) == (1, True)
    (warning,) = answer["warnings"]
    assert warning.startswith("step 3 went back below step 6, the newest of sampler 'matrix': run 'r' starts segment 1")
    assert "segments=all" in warning
    assert "send a run's steps from one uploader, in step order" in warning
    assert started(client) == {"rollouts": 0, "matrix": 1}
    assert [r.getMessage() for r in caplog.records] == [f"run 'r', matrix: {warning}"]
    replay = client.post("/v1/runs/r/matrices", json=body).json()  # the answer to a replay started nothing
    assert (replay["replayed"], replay["segment"], replay["resumed"], replay["warnings"]) == (True, 1, False, [])
    after = client.post("/v1/runs/r/matrices", json=dependence_matrix(4, 0.5) | {"batch_id": "b-4"}).json()
    assert (after["segment"], after["resumed"]) == (1, False)
    assert started(client) == {"rollouts": 0, "matrix": 1}


def test_a_rollouts_step_below_the_one_taken_for_scoring_is_answered_with_its_new_segment_a_warning_and_counted(
    database_url, client_for, caplog
):
    client = client_for(database_url, scoring_paused=True)
    client.post("/v1/runs", json={"name": "r", "sampler": {"num_samples": 4, "samplers": ["first_turn"]}})
    sessions = client.app.state.monitor.sessions
    for step in (1, 2, 3):
        answer = client.post("/v1/runs/r/batches", json={"step": step, "trajectories": trajectories()}).json()
        assert (answer["segment"], answer["resumed"]) == (0, False)
        with sessions.begin() as session:  # a worker takes the step for scoring
            claimed = queue.claim_batch(session, "w#1", 60, max_attempts=3)
            assert claimed is not None
            assert claimed.step == step
            queue.finish_batch(session, claimed.id, "w#1", status="done")
    resumed = {"step": 2, "trajectories": trajectories(per_group=2)}  # other rollouts
    with caplog.at_level(logging.WARNING, logger="collapse_monitor.api"):
        answer = client.post("/v1/runs/r/batches", json=resumed)
    assert answer.status_code == 202
    assert (answer.json()["segment"], answer.json()["resumed"]) == (1, True)
    (warning,) = answer.json()["warnings"]
    assert warning.startswith("step 2 went back below step 3, already taken for scoring: run 'r' starts segment 1 here")
    assert "reads show segment 1 from step 2 on" in warning
    assert "two uploaders are sending this run's steps" in warning
    assert started(client) == {"rollouts": 1, "matrix": 0}
    assert [r.getMessage() for r in caplog.records] == [f"run 'r', rollouts: {warning}"]
    with sessions() as session:
        assert session.get_one(Batch, answer.json()["batch_id"]).segment == 1
    # The steps after it go on in the new segment, silently: nothing of it has been taken yet.
    after = client.post("/v1/runs/r/batches", json={"step": 3, "trajectories": trajectories(per_group=2)}).json()
    assert (after["segment"], after["resumed"], after["warnings"]) == (1, False, [])
    assert started(client) == {"rollouts": 1, "matrix": 0}


def wait_points(client, n: int, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        points: list[dict] = client.get("/v1/runs/r/metrics", params={"names": "reward_mean"}).json()["points"]
        if len(points) >= n:
            return points
        time.sleep(0.05)
    raise AssertionError(f"{n} points did not arrive: {points}")


def test_rollouts_sent_out_of_order_before_scoring_stay_in_one_segment(database_url, client_for):
    paused = client_for(database_url, scoring_paused=True)
    paused.post("/v1/runs", json={"name": "r", "sampler": {"num_samples": 4, "samplers": ["first_turn"]}})
    for step in (3, 1, 2):
        assert paused.post("/v1/runs/r/batches", json={"step": step, "trajectories": trajectories()}).status_code == 202
    scoring = client_for(database_url)  # a second process that scores
    points = wait_points(scoring, 3)
    assert [(p["step"], p["segment"]) for p in points] == [(1, 0), (2, 0), (3, 0)]
    # Once step 3 was scored, a step 1 is a resume: the new segment replaces the series from step 1 on.
    resumed = scoring.post("/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories(n_groups=3)})
    assert wait_for(scoring, resumed.json()["batch_id"])["status"] == "done"
    points = scoring.get("/v1/runs/r/metrics", params={"names": "reward_mean"}).json()["points"]
    assert [(p["step"], p["segment"]) for p in points] == [(1, 1)]


def test_the_overview_shows_a_resumed_run_as_its_newest_segment(client):
    feed(client, [2.0] * 6)
    feed(client, [0.5] * 2, start=1, key="b")
    (run,) = client.get("/v1/overview").json()["runs"]
    assert run["last_step"] == 2


def test_a_matrix_under_its_own_sampler_never_starts_a_segment_for_the_rollouts(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    client.post("/v1/runs", json={"name": "mixed", "sampler": {"num_samples": 4, "samplers": ["first_turn"]}})
    sessions = client.app.state.monitor.sessions

    def rollouts(step: int) -> str:
        response = client.post("/v1/runs/mixed/batches", json={"step": step, "trajectories": trajectories()})
        assert response.status_code == 202
        batch_id: str = response.json()["batch_id"]
        return batch_id

    def segment_of(batch_id: str):
        with sessions() as session:
            return session.get_one(Batch, batch_id).segment

    for step in (1, 2, 3):  # taken for scoring (claimed) up to step 3
        rollouts(step)
        with sessions.begin() as session:
            claimed = queue.claim_batch(session, "w#1", 60, max_attempts=3)
            assert claimed is not None
            queue.finish_batch(session, claimed.id, "w#1", status="done")
    far = dependence_matrix(1_000_000_000, 2.0) | {"sampler": "custom", "batch_id": "far"}
    assert client.post("/v1/runs/mixed/matrices", json=far).status_code == 201
    assert segment_of(rollouts(4)) == 0  # the rollouts' next step: still their segment
    assert client.get("/v1/runs/mixed").json()["last_step"] == 1_000_000_000  # the newest figures are the matrix's
    # The matrix stream is compared with itself: its next step below 1,000,000,000 is a resume of its own,
    # which starts a segment for the whole run; the rollouts then go on in it.
    near = dependence_matrix(5, 2.0) | {"sampler": "custom", "batch_id": "near"}
    assert segment_of(client.post("/v1/runs/mixed/matrices", json=near).json()["batch_id"]) == 1
    assert segment_of(rollouts(5)) == 1


@pytest.mark.parametrize("fmt", ["json", "csv", "columns"])
@pytest.mark.parametrize("segments", ["current", "all"])
def test_every_read_format_draws_a_run_whose_steps_went_back(client, fmt, segments):
    feed(client, [2.0] * 6)  # steps 1..6
    feed(client, [0.5], start=3, key="b")  # step 3 again, other values: a resume
    params = {"names": "mi_estimate", "sampler": "matrix", "format": fmt, "segments": segments}
    response = client.get("/v1/runs/r/metrics", params=params)
    assert response.status_code == 200, response.text
    wanted = [1, 2, 3] if segments == "current" else [1, 2, 3, 3, 4, 5, 6]
    if fmt == "columns":
        (column,) = response.json()["series"]
        assert column["steps"] == wanted
    elif fmt == "csv":
        assert [int(line.split(",")[0]) for line in response.text.splitlines()[1:]] == wanted
    else:
        assert [p["step"] for p in response.json()["points"]] == wanted


def test_a_matrix_step_that_went_back_while_a_later_one_was_stored_is_refused_naming_the_step(
    database_url, client_for, monkeypatch
):
    first = client_for(database_url, scoring_paused=True)
    second = client_for(database_url, scoring_paused=True)  # another uploader, another process
    assert first.post("/v1/runs", json={"name": "r"}).status_code == 201
    feed(first, [2.0] * 3)  # steps 1..3
    real_score = matrices.score_matrix
    uploaded: list[int] = []

    def score_while_step_5_arrives(payload, *args, **kwargs):
        if payload.step == 4 and not uploaded:  # the other uploader's step 5 lands while step 4 is being scored
            body = dependence_matrix(5, 2.0) | {"sampler": "matrix", "batch_id": "other-5"}
            uploaded.append(second.post("/v1/runs/r/matrices", json=body).status_code)
        return real_score(payload, *args, **kwargs)

    monkeypatch.setattr(matrices, "score_matrix", score_while_step_5_arrives)
    step_4 = dependence_matrix(4, 2.0) | {"sampler": "matrix", "batch_id": "a-4"}
    refused = first.post("/v1/runs/r/matrices", json=step_4)
    assert uploaded == [201]
    assert refused.status_code == 409
    assert refused.json()["error"] == "step_conflict"
    assert refused.json()["field"] == "step"
    assert "step 4 of sampler 'matrix'" in refused.json()["detail"]
    assert "step 5" in refused.json()["detail"]
    assert [(p["step"], p["segment"]) for p in series(first)] == [(1, 0), (2, 0), (3, 0), (5, 0)]  # no new segment
    # Sent again on its own, a step that goes back is a resume, and said to be one.
    resent = first.post("/v1/runs/r/matrices", json=step_4)
    assert resent.status_code == 201
    assert (resent.json()["segment"], resent.json()["resumed"]) == (1, True)
    assert [(p["step"], p["segment"]) for p in series(first)] == [(1, 0), (2, 0), (3, 0), (4, 1)]
