"""Edge input the reliability probe found: every case is a 4xx in the documented shape, alike on both databases.

Each request is refused naming the field, writes nothing, and leaves the connection usable.
"""

from __future__ import annotations

import json

import pytest

from service.storage import runs
from service.storage.database import make_engine, make_sessions
from service.storage.tables import Batch, Run
from tests.fixtures import row_count, trajectories

pytestmark = pytest.mark.integration
BIG = 2**31
JSON = {"content-type": "application/json"}


def rows(url: str) -> tuple[int, int]:
    return row_count(url, Run), row_count(url, Batch)


@pytest.fixture
def client(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    assert client.post("/v1/runs", json={"name": "r"}).status_code == 201
    return client


def refused(response, status: int, field: str) -> dict:
    """Asserts the documented shape and returns the body."""
    assert response.status_code == status, response.text
    body: dict = response.json()
    if status == 422:
        assert body["error"] == "validation"
        assert field in [d["field"] for d in body["detail"]], body
    else:
        assert set(body) - {"limit", "allowed", "got"} == {"error", "detail", "field", "index"}, body
        assert body["field"] == field, body
    return body


def post(client, path: str, body: dict):
    """POSTs ``body`` as ASCII JSON: lone surrogates travel as escapes, as any JSON client may send them."""
    return client.post(path, content=json.dumps(body).encode(), headers=JSON)


def batch(**changes) -> dict:
    return {"step": 1, "trajectories": trajectories()} | changes


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "a", "sampler": {"seed": BIG}}, "sampler.seed"),
        ({"name": "a", "sampler": {"num_samples": BIG}}, "sampler.num_samples"),
        ({"name": "a", "schedule": {"every": BIG}}, "schedule.every"),
        ({"name": "a", "temperature": 1e-300}, "temperature"),
        ({"name": "a", "temperature": 1.4e308}, "temperature"),
        ({"name": "a", "alerts": {"window": 12147}}, "alerts.window"),
        ({"name": "a", "alerts": {"threshold": 1e300}}, "alerts.threshold"),
        ({"name": "a", "sampler": {"samplers": ["first_turn", "first_turn"]}}, "sampler.samplers"),
        ({"name": "a\u0000b"}, "name"),
        ({"name": "a", "metadata": {"model": "qwen\u0000"}}, "metadata.model"),
        ({"name": "a", "project": "\ud800"}, "project"),
    ],
)
def test_run_settings_no_scorer_can_use_are_refused(client, database_url, body, field):
    before = rows(database_url)
    refused(post(client, "/v1/runs", body), 422, field)
    assert rows(database_url) == before


def test_infinity_is_refused_as_a_temperature(client):
    response = client.post("/v1/runs", content=b'{"name": "a", "temperature": Infinity}', headers=JSON)
    refused(response, 422, "temperature")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (batch(step=BIG), "step"),
        (batch(step=2**63), "step"),
        (batch(batch_id="k\u0000"), "batch_id"),
        ({**batch(), "trajectories": [{**trajectories()[0], "reward": 1.7e308}]}, "trajectories[0].reward"),
        ({**batch(), "trajectories": [{**trajectories()[0], "reward": -1e13}]}, "trajectories[0].reward"),
        ({**batch(), "trajectories": [{**trajectories()[0], "group_id": BIG}]}, "trajectories[0].group_id"),
        (
            {
                **batch(),
                "trajectories": [{"group_id": 0, "reward": 1, "turns": [{"prompt": "\udfff", "reasoning": "x"}]}],
            },
            "trajectories[0].turns[0].prompt",
        ),
        (
            {
                **batch(),
                "trajectories": [
                    {"group_id": 0, "reward": 1, "turns": [{"prompt_token_ids": [BIG], "reasoning_token_ids": [1]}]}
                ],
            },
            "trajectories[0].turns[0].prompt_token_ids[0]",
        ),
    ],
)
def test_batches_with_out_of_range_values_are_refused(client, database_url, body, field):
    before = rows(database_url)
    refused(post(client, "/v1/runs/r/batches", body), 422, field)
    assert rows(database_url) == before


@pytest.mark.parametrize(
    ("content", "status", "field"),
    [
        (json.dumps(batch()).encode("utf-16"), 400, "body"),
        (b"\xef\xbb\xbf" + json.dumps(batch()).encode(), 400, "body"),
        (b'{"step": 1, "trajectories": "\xff"}', 400, "body"),
        (b"[" * 10_000 + b"]" * 10_000, 400, "body"),  # nested past the recursion limit (65,536 [: 413 too_large)
        (b"", 422, "body"),
        (b"[]", 422, "body"),
        (b'{"step": 1,', 422, "body"),
    ],
)
def test_bodies_json_cannot_read_are_refused_in_the_documented_shape(client, database_url, content, status, field):
    before = rows(database_url)
    body = refused(client.post("/v1/runs/r/batches", content=content, headers=JSON), status, field)
    if status == 400:
        assert body["error"] == "invalid_request"
    assert rows(database_url) == before
    assert client.get("/v1/runs/r").status_code == 200  # the connection still serves


@pytest.mark.parametrize(
    ("path", "status", "field"),
    [
        ("/v1/runs/a%00b", 400, "path"),
        ("/v1/batches/%00", 400, "path"),
        ("/v1/runs/r/metrics?names=a%00", 400, "query"),
        ("/v1/runs/r/metrics?from_step=9223372036854775808", 422, "from_step"),
        ("/v1/runs/r/metrics?to_step=2147483648", 422, "to_step"),
        ("/v1/runs/r/metrics?segments=some", 422, "segments"),
        ("/v1/nothing-here", 404, None),
    ],
)
def test_paths_and_queries_out_of_range_are_refused(client, path, status, field):
    body = refused(client.get(path), status, field)
    if status == 404:
        assert body["error"] == "not_found"


def test_a_wrong_method_is_a_405_in_the_documented_shape(client):
    response = client.put("/v1/runs")
    assert response.status_code == 405
    assert response.json()["error"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"L_seq": [[-1e300, -9], [-4, -10], [-8, -2], [-12, -5]]}, "L_seq[0][0]"),
        ({"step": BIG}, "step"),
        ({"sampler": "first_turn"}, "sampler"),
        ({"sampler": "all"}, "sampler"),
        ({"row_group_ids": [0, 0, 1, BIG]}, "row_group_ids[3]"),
    ],
)
def test_matrices_out_of_range_or_under_a_reserved_sampler_are_refused(client, database_url, changes, field):
    matrix = {
        "step": 1,
        "row_group_ids": [0, 0, 1, 1],
        "reasoning_lengths": [3, 4, 2, 5],
        "L_seq": [[-3, -9], [-4, -10], [-8, -2], [-12, -5]],
    }
    before = rows(database_url)
    refused(client.post("/v1/runs/r/matrices", json=matrix | changes), 422, field)
    assert rows(database_url) == before


def test_a_group_whose_trajectories_start_from_different_prompts_is_refused(client, database_url):
    body = batch()
    body["trajectories"][2]["turns"][0]["prompt"] = "Another board altogether."
    before = rows(database_url)
    refused(client.post("/v1/runs/r/batches", json=body), 400, "trajectories[2].turns[0].prompt")
    assert rows(database_url) == before


def test_token_ids_the_scorer_cannot_score_are_refused_once_its_limits_are_known(client, database_url):
    def ids(prompt: list[int]) -> dict:
        turn = {"prompt_token_ids": prompt, "reasoning_token_ids": [1, 2]}
        return batch(trajectories=[{"group_id": 0, "reward": 1.0, "turns": [turn]}])

    assert client.post("/v1/runs/r/batches", json=ids([600])).status_code == 202  # limits not known yet
    engine = make_engine(database_url)
    with make_sessions(engine).begin() as session:
        runs.record_scorer_limits(session, "tiny-random", vocab_size=512, max_positions=64)
    engine.dispose()
    body = refused(client.post("/v1/runs/r/batches", json=ids([601])), 400, "trajectories[0].turns[0].prompt_token_ids")
    assert body["detail"] == "token id 601 is outside the vocabulary of scorer 'tiny-random' (512 tokens)"
    # Past the scorer's context: accepted, and windowed by the worker (tests/integration/test_windows.py).
    assert client.post("/v1/runs/r/batches", json=ids([5] * 63)).status_code == 202


def test_a_batch_too_costly_to_score_is_refused_naming_the_limit(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, max_scoring_cost=10_000)
    client.post("/v1/runs", json={"name": "r"})
    body = refused(client.post("/v1/runs/r/batches", json=batch()), 413, "trajectories")
    assert "more than max_scoring_cost=10000" in body["detail"]
    # the setting, its value and the batch's cost, for a client to refit the batch to (collapse_monitor.batches)
    assert (body["limit"], body["allowed"]) == ("max_scoring_cost", 10_000)
    assert f"cost about {body['got']} tokens" in body["detail"]
    assert body["got"] > 10_000
    small = client.post("/v1/runs", json={"name": "s", "sampler": {"num_samples": 2, "samplers": ["first_turn"]}})
    assert small.status_code == 201
    assert client.post("/v1/runs/s/batches", json=batch()).status_code == 202  # fewer rows fit the limit
    off_schedule = client.post("/v1/runs", json={"name": "t", "schedule": {"every": 5}})
    assert off_schedule.status_code == 201
    assert client.post("/v1/runs/t/batches", json=batch(step=2)).status_code == 202  # not scored: no cost


def test_one_run_filling_its_share_of_the_queue_gets_429_and_others_still_get_in(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, max_queued_per_run=2)
    client.post("/v1/runs", json={"name": "heavy"})
    client.post("/v1/runs", json={"name": "light"})
    for step in (1, 2):
        assert client.post("/v1/runs/heavy/batches", json=batch(step=step)).status_code == 202
    response = client.post("/v1/runs/heavy/batches", json=batch(step=3))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "5"
    assert response.json()["error"] == "run_queue_full"
    assert client.post("/v1/runs/light/batches", json=batch(step=1)).status_code == 202


def test_a_retry_without_a_key_is_recognised_as_a_replay(client, database_url):
    first = client.post("/v1/runs/r/batches", json=batch(step=4))
    again = client.post("/v1/runs/r/batches", json=batch(step=4))
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json() | {"replayed": True}
    assert rows(database_url)[1] == 1
    other_step = client.post("/v1/runs/r/batches", json=batch(step=5))
    assert other_step.json()["replayed"] is False


def test_every_rejection_reason_is_exported_from_zero(client):
    text = client.get("/metrics").text
    for reason in ("validation", "not_found", "too_large", "run_queue_full", "queue_full", "invalid_request"):
        assert f'collapse_monitor_rejections_total{{reason="{reason}"}} 0.0' in text
