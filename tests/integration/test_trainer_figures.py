"""Figures a trainer computed itself, sent with its batch or in a post after it: stored as series of sampler
``trainer`` beside the step's batch, once, on SQLite and Postgres; refused with the field named; exported where
the catalogue has them; never a sampler of the run's switch nor an input of the alert rules."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures import error_body, trajectories, wait_for

pytestmark = pytest.mark.integration

FILTER = {
    "rollout/filter_engaged": 1.0,
    "rollout/filter_kept_ratio": 0.5,
    "rollout/filter_kept_count": 2.0,
    "rollout/filter_kept_rows": 6.0,
    "rollout/chosen_in_group_reward_std": 0.577,
    "rollout/dropped_in_group_reward_std": 0.0,
}


@pytest.fixture
def client(database_url, client_for):
    """The API with no worker: a scheduled batch stays queued, so what is stored at ingest shows alone."""
    client = client_for(database_url, embedded_worker=False)
    assert client.post("/v1/runs", json={"name": "r"}).status_code == 201
    return client


def post_batch(client, step: int, figures: dict | None = None, **extra) -> dict:
    body = {"step": step, "trajectories": trajectories()} | extra | ({"figures": figures} if figures else {})
    response = client.post("/v1/runs/r/batches", json=body)
    assert response.status_code == 202, response.text
    answer: dict = response.json()
    return answer


def trainer_series(client, names: str | None = None) -> dict[str, dict[int, float]]:
    params = {"sampler": "trainer"} | ({"names": names} if names else {})
    out: dict[str, dict[int, float]] = {}
    for point in client.get("/v1/runs/r/metrics", params=params).json()["points"]:
        out.setdefault(point["name"], {})[point["step"]] = point["value"]
    return out


def test_figures_sent_with_a_batch_are_stored_at_once_while_the_batch_waits_for_scoring(client):
    accepted = post_batch(client, 1, FILTER)
    assert accepted["status"] == "queued"
    assert trainer_series(client) == {name: {1: value} for name, value in FILTER.items()}
    # One batch, whatever the figures: they are not a batch of their own.
    assert client.get("/v1/runs/r").json()["batches"] == {"queued": 1}


def test_figures_posted_after_their_batch_join_its_step_and_a_replay_stores_nothing(client):
    post_batch(client, 1, FILTER)
    logged = {"actor/entropy": 1.25, "loss": 0.03, "rewards/accuracy/mean": 0.5}
    batch_id = post_batch(client, 2)["batch_id"]  # the step's batch, even with a later step sent meanwhile
    first = client.post("/v1/runs/r/figures", json={"step": 1, "figures": logged})
    assert first.status_code == 201, first.text
    assert first.json()["batch_id"] != batch_id
    assert first.json() == {"batch_id": first.json()["batch_id"], "step": 1, "stored": 3, "replayed": False}
    again = client.post("/v1/runs/r/figures", json={"step": 1, "figures": logged})
    assert again.status_code == 200
    assert again.json() == first.json() | {"stored": 0, "replayed": True}
    series = trainer_series(client)
    assert series["actor/entropy"] == {1: 1.25}
    assert series["rollout/filter_kept_ratio"] == {1: 0.5}
    assert len(series) == len(FILTER) + 3


def test_a_figure_sent_again_with_another_value_is_refused_and_nothing_of_its_post_is_stored(client):
    post_batch(client, 1, {"actor/entropy": 1.25})
    clash = client.post("/v1/runs/r/figures", json={"step": 1, "figures": {"actor/entropy": 2.0, "loss": 0.1}})
    assert clash.status_code == 409
    assert clash.json() == error_body(
        "figure_conflict",
        "1 figures of step 1 were stored already with other values: actor/entropy (1.25, now 2.0); "
        "a step's figure is sent once",
        "figures.actor/entropy",
    )
    assert trainer_series(client) == {"actor/entropy": {1: 1.25}}  # not the loss either
    metrics = client.get("/metrics").text
    assert 'collapse_monitor_rejections_total{reason="figure_conflict"} 1.0' in metrics


def test_figures_of_a_step_without_a_batch_are_refused_naming_the_step(client):
    missing = client.post("/v1/runs/r/figures", json={"step": 4, "figures": {"loss": 0.1}})
    assert missing.status_code == 404
    assert missing.json() == error_body(
        "not_found",
        "run 'r' has no batch of step 4 (in its current segment): a step's figures follow its batch, so send the "
        "batch first",
        "step",
    )
    unknown_run = client.post("/v1/runs/nope/figures", json={"step": 1, "figures": {"loss": 0.1}})
    assert unknown_run.status_code == 404
    assert unknown_run.json()["field"] == "run"


@pytest.mark.parametrize(
    ("figures", "field", "message"),
    [
        ({"has space": 1.0}, "figures.has space.[key]", "String should match pattern"),
        ({"x" * 81: 1.0}, "figures." + "x" * 81 + ".[key]", "String should match pattern"),
        ({"loss": 1e16}, "figures.loss", "Input should be less than or equal to 1000000000000000"),
        ({"loss": "high"}, "figures.loss", "Input should be a valid number"),
        ({}, "figures", "Dictionary should have at least 1 item after validation, not 0"),
    ],
)
def test_bad_figures_are_refused_with_the_field_named_and_nothing_is_stored(client, figures, field, message):
    post_batch(client, 1)
    for url, body in (
        ("/v1/runs/r/figures", {"step": 1, "figures": figures}),
        ("/v1/runs/r/batches", {"step": 2, "trajectories": trajectories(), "figures": figures}),
    ):
        refused = client.post(url, json=body)
        assert refused.status_code == 422, refused.text
        detail = refused.json()["detail"]
        assert any(d["field"] == field and message in d["msg"] for d in detail), detail
    assert trainer_series(client) == {}
    assert client.get("/v1/runs/r").json()["batches"] == {"queued": 1}


def test_figures_past_256_are_refused_413_before_parsing_with_the_field_named(client):
    # counted on the body's bytes (service/api/json_shape.py), so the model's own 256-item check is never reached
    post_batch(client, 1)
    figures = {f"f{i}": 1.0 for i in range(257)}
    for url, body in (
        ("/v1/runs/r/figures", {"step": 1, "figures": figures}),
        ("/v1/runs/r/batches", {"step": 2, "trajectories": trajectories(), "figures": figures}),
    ):
        refused = client.post(url, json=body)
        assert refused.status_code == 413, refused.text
        assert refused.json()["field"] == "figures"
        assert "at most 256 keys" in refused.json()["detail"]
    assert trainer_series(client) == {}
    assert client.get("/v1/runs/r").json()["batches"] == {"queued": 1}


def test_a_non_finite_figure_is_refused(client):
    post_batch(client, 1)
    raw = b'{"step": 1, "figures": {"loss": NaN}}'
    refused = client.post("/v1/runs/r/figures", content=raw, headers={"content-type": "application/json"})
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["field"] == "figures.loss"
    assert trainer_series(client) == {}


def test_the_trainer_sampler_is_no_matrix_sampler_nor_a_sampler_to_switch_to(client):
    post_batch(client, 1, FILTER)
    (overview,) = client.get("/v1/overview", params={"runs": "r"}).json()["runs"]
    assert "trainer" not in overview["samplers"]
    assert overview["last_step"] == 1
    matrix = {
        "step": 2,
        "sampler": "trainer",
        "row_group_ids": [0, 1],
        "reasoning_lengths": [1, 1],
        "L_seq": [[-1.0, -2.0], [-2.0, -1.0]],
    }
    refused = client.post("/v1/runs/r/matrices", json=matrix)
    assert refused.status_code == 422
    message = refused.json()["detail"][0]["msg"]
    assert "must not be one of first_turn, trajectory, per_turn, all, trainer or turn_<k>" in message


def test_catalogued_trainer_figures_are_exported_and_others_only_stored(client):
    post_batch(client, 1, FILTER | {"actor/entropy": 1.25, "loss": 0.03})
    found = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}

    def value(family: str) -> float:
        [sample] = [s for s in found[family].samples if s.labels == {"run": "r", "sampler": "trainer"}]
        return float(sample.value)

    assert value("collapse_monitor_filter_kept_ratio") == 0.5
    assert value("collapse_monitor_filter_kept_rows") == 6.0
    assert value("collapse_monitor_filter_engaged") == 1.0
    assert value("collapse_monitor_filter_kept_reward_std") == 0.577
    assert value("collapse_monitor_filter_dropped_reward_std") == 0.0
    assert value("collapse_monitor_policy_token_entropy_nats") == 1.25
    assert not any("loss" in name for name in found)  # stored, readable through the API, not exported
    assert trainer_series(client, "loss") == {"loss": {1: 0.03}}


def test_figures_follow_the_batch_of_their_step_in_a_resumed_runs_current_segment(database_url, client_for):
    client = client_for(database_url)  # with a worker: a resume is a step below one taken for scoring
    assert client.post("/v1/runs", json={"name": "r", "sampler": {"num_samples": 4}}).status_code == 201
    for step in (1, 2):
        wait_for(client, post_batch(client, step, {"actor/entropy": float(step)})["batch_id"])
    resumed = post_batch(client, 2, {"actor/entropy": 20.0}, idempotency_key="resumed-2")  # the trainer resumed at 1
    wait_for(client, resumed["batch_id"])
    posted = client.post("/v1/runs/r/figures", json={"step": 2, "figures": {"loss": 0.5}})
    assert posted.status_code == 201
    assert posted.json()["batch_id"] == resumed["batch_id"]
    assert trainer_series(client) == {"actor/entropy": {1: 1.0, 2: 20.0}, "loss": {2: 0.5}}


def test_a_failed_step_evaluates_the_alerts_after_it_without_reading_the_trainers_figures(
    database_url, client_for, settings_for
):
    from sqlalchemy import create_engine, select

    from service.jobs.scorers import ScorerPool
    from service.jobs.worker import Worker
    from service.storage.database import make_engine, make_sessions
    from service.storage.tables import AlertCheckpoint

    client = client_for(database_url, embedded_worker=False)
    run = {"name": "r", "schedule": {"every": 3}, "sampler": {"num_samples": 4, "samplers": ["first_turn"]}}
    assert client.post("/v1/runs", json=run).status_code == 201
    unscorable = trajectories()
    for trajectory in unscorable:
        trajectory["turns"] = [{"prompt_token_ids": [1, 2], "reasoning_token_ids": [1, 99999]}]
    failing = post_batch(client, 1, {"loss": 1.0}, **{"trajectories": unscorable})
    for step in (2, 4):
        assert post_batch(client, step, {"loss": float(step)})["status"] == "done"
    engine = make_engine(database_url)
    settings = settings_for(database_url)
    assert Worker(make_sessions(engine), settings, ScorerPool(settings)).run_once()
    engine.dispose()
    assert client.get(f"/v1/batches/{failing['batch_id']}").json()["status"] == "failed"
    reader = create_engine(database_url)
    with reader.connect() as connection:
        samplers = set(connection.execute(select(AlertCheckpoint.sampler)).scalars())
    reader.dispose()
    assert "all" in samplers  # the steps after the failed one were evaluated...
    assert "trainer" not in samplers  # ... and the trainer's figures were not read by the rules
    assert trainer_series(client) == {"loss": {1: 1.0, 2: 2.0, 4: 4.0}}


def test_concurrent_posts_of_a_steps_figures_store_one_and_refuse_the_others_with_409(client):
    """Conflicting posts racing each other (a trainer's retries, two ranks logging): one stored, the others a
    409 naming the figure, never a 500; new names racing across steps all stored (their latest value once)."""
    for step in range(1, 9):
        post_batch(client, step)
    with ThreadPoolExecutor(8) as pool:
        same_step = list(
            pool.map(lambda i: client.post("/v1/runs/r/figures", json={"step": 1, "figures": {"loss": i}}), range(16))
        )
        across_steps = list(
            pool.map(
                lambda step: client.post("/v1/runs/r/figures", json={"step": step, "figures": {"actor/entropy": step}}),
                range(1, 9),
            )
        )
    codes = sorted(r.status_code for r in same_step)
    assert codes == [201] + [409] * 15, [r.text for r in same_step if r.status_code not in (201, 409)]
    assert all(r.json()["field"] == "figures.loss" for r in same_step if r.status_code == 409)
    assert [r.status_code for r in across_steps] == [201] * 8, [r.text for r in across_steps]
    series = trainer_series(client)
    assert len(series["loss"]) == 1
    assert series["actor/entropy"] == {step: float(step) for step in range(1, 9)}
