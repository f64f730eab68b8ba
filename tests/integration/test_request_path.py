"""The body routes on SQLite and Postgres: access is decided from the headers before the body is read,
bodies are parsed off the event loop with FastAPI's own error shapes, and the OpenAPI document is unchanged."""

from __future__ import annotations

import json

import pytest

from service.access import issue_token
from tests.fixtures import dependence_matrix, trajectories
from tests.integration.test_tokens import bearer, rejections

pytestmark = pytest.mark.integration
JSON = {"content-type": "application/json"}
# The body routes and the model each documents (FastAPI's own description of a declared body).
BODY_ROUTES = {
    ("/v1/runs", "post"): "RunCreate",
    ("/v1/runs/{run}/batches", "post"): "BatchIn",
    ("/v1/runs/{run}/matrices", "post"): "MatrixBatchIn",
    ("/v1/runs/{run}/checkpoints", "post"): "CheckpointIn",
    ("/v1/filter", "post"): "FilterRequest",
}


def issue(client, scope: str, run_prefix: str = "") -> str:
    with client.app.state.monitor.sessions.begin() as session:
        return issue_token(session, scope, run_prefix).secret


@pytest.fixture
def guarded(database_url, client_for):
    """A server with tokens and reads that need one: every body route refuses an anonymous caller."""
    client = client_for(database_url, scoring_paused=True, token_cache_seconds=0, require_token_for_reads=True)
    admin = issue(client, "admin")
    assert client.post("/v1/runs", json={"name": "r"}, headers=bearer(admin)).status_code == 201
    return client, admin


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/runs/r/batches", "/v1/runs/r/matrices", "/v1/filter"])
def test_an_anonymous_malformed_json_body_is_a_401_counted_as_unauthorized_not_a_422(guarded, path):
    client, admin = guarded
    before = rejections(client, admin)
    refused = client.post(path, content=b'{"step": 1, "trajectories": [' + b"7," * 10_000, headers=JSON)
    assert (refused.status_code, refused.json()["error"]) == (401, "unauthorized")
    after = rejections(client, admin)
    assert after["unauthorized"] == before["unauthorized"] + 1
    assert after["validation"] == before["validation"]


def test_a_token_of_the_wrong_scope_is_refused_before_its_body_is_parsed(guarded):
    client, _ = guarded
    reader = issue(client, "read")
    ingest = issue(client, "ingest", "team-a")
    malformed = b'{"step": 1,'
    assert client.post("/v1/runs/r/batches", content=malformed, headers=JSON | bearer(reader)).status_code == 403
    outside = client.post("/v1/runs/r/matrices", content=malformed, headers=JSON | bearer(ingest))
    assert (outside.status_code, outside.json()["field"]) == (403, "run")
    made_up = client.post("/v1/runs/r/batches", content=malformed, headers=JSON | bearer("cm_made-up"))
    assert (made_up.status_code, made_up.json()["error"]) == (401, "invalid_token")


def test_an_authorised_body_gets_the_same_answers_as_before(guarded):
    client, admin = guarded
    auth = bearer(admin)
    invalid = client.post("/v1/runs/r/batches", content=b'{"step": 1,', headers=JSON | auth)
    assert invalid.status_code == 422
    assert invalid.json() == {
        "error": "validation",
        "detail": [
            {
                "loc": ["body", 11],
                "field": "body",
                "msg": "JSON decode error: Expecting property name enclosed in double quotes (at character 11)",
                "type": "json_invalid",
            }
        ],
        "n_errors": 1,
    }
    missing = client.post(
        "/v1/runs/r/batches", json={"step": 1, "trajectories": [{"group_id": 0, "reward": 1}]}, headers=auth
    )
    assert [(d["loc"], d["field"], d["type"]) for d in missing.json()["detail"]] == [
        (["body", "trajectories", 0, "turns"], "trajectories[0].turns", "missing")
    ]
    not_json = client.post("/v1/runs/r/batches", content=b"step=1", headers={"content-type": "text/plain"} | auth)
    assert (not_json.status_code, not_json.json()["detail"][0]["loc"]) == (422, ["body"])
    empty = client.post("/v1/runs/r/batches", content=b"", headers=JSON | auth)
    assert (empty.status_code, empty.json()["detail"][0]["type"]) == (422, "missing")
    huge_number = client.post("/v1/runs/r/batches", content=b'{"step": ' + b"9" * 5000 + b"}", headers=JSON | auth)
    assert (huge_number.status_code, huge_number.json()["field"]) == (400, "body")
    body = {"step": 1, "trajectories": trajectories()}
    accepted = client.post("/v1/runs/r/batches", content=json.dumps(body).encode(), headers=JSON | auth)
    assert accepted.status_code == 202
    replayed = client.post("/v1/runs/r/batches", content=json.dumps(body).encode(), headers=JSON | auth)
    assert replayed.json()["replayed"] is True
    assert client.post("/v1/runs/r/matrices", json=dependence_matrix(2, 1.0), headers=auth).status_code == 201
    advice = client.post("/v1/filter", json={"rewards": [[1.0, 0.0], [1.0, 1.0]]}, headers=auth)
    assert advice.status_code == 200
    assert client.app.state.monitor.bodies.in_use == 0  # every share given back


def test_every_body_route_documents_its_model_as_before(database_url, client_for):
    spec = client_for(database_url, scoring_paused=True).get("/openapi.json").json()
    for (path, method), model in BODY_ROUTES.items():
        operation = spec["paths"][path][method]
        body = operation["requestBody"]
        assert body["required"] is True, path
        assert body["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{model}", path
        assert "422" in operation["responses"], path
        assert model in spec["components"]["schemas"], model
