"""What the web pages read, on SQLite and Postgres: the overview, series as columns, the catalogue, the pages."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.estimators import prompt_posterior
from service.metrics import EXPORTED
from tests.fixtures import dependence_matrix, trajectories, wait_for

pytestmark = pytest.mark.integration


def feed(client, run: str, dependences: list[float], **body) -> list[dict]:
    assert client.post("/v1/runs", json={"name": run, **body}).status_code == 201
    out = []
    for step, dependence in enumerate(dependences, start=1):
        response = client.post(f"/v1/runs/{run}/matrices", json=dependence_matrix(step, dependence))
        assert response.status_code == 201, response.text
        out.append(response.json())
    return out


@pytest.fixture
def client(database_url, client_for):
    return client_for(database_url, scoring_paused=True)


def test_overview_gives_each_runs_status_latest_figures_and_sparklines(client):
    feed(client, "steady", [1.0] * 8, metadata={"model": "Qwen2.5-3B", "algorithm": "PPO"})
    feed(client, "collapsing", [1.0] * 6 + [0.0] * 10)
    client.post("/v1/runs", json={"name": "empty"})

    runs = {r["name"]: r for r in client.get("/v1/overview", params={"points": 5}).json()["runs"]}
    assert list(runs) == ["steady", "collapsing", "empty"]
    assert {name: r["status"] for name, r in runs.items()} == {
        "steady": "healthy",
        "collapsing": "firing",
        "empty": "waiting",
    }
    firing = client.get("/v1/alerts", params={"run": "collapsing", "state": "firing"}).json()
    assert runs["collapsing"]["alerts"] == {"pending": 0, "firing": len(firing)}
    assert firing

    steady = runs["steady"]
    assert steady["metadata"]["model"] == "Qwen2.5-3B"
    assert (steady["samplers"], steady["sampler"], steady["last_step"]) == (["matrix"], "matrix", 8)
    assert steady["batches"] == {"done": 8}
    stored = client.get("/v1/runs/steady/metrics", params={"names": "mi_estimate", "sampler": "matrix"}).json()
    points = stored["points"]
    assert steady["latest"]["mi_estimate"] == {"value": points[-1]["value"], "step": 8}
    assert steady["sparkline"]["steps"] == [4, 5, 6, 7, 8]
    assert steady["sparkline"]["mi_estimate"] == [p["value"] for p in points[-5:]]
    assert steady["last_batch_at"] >= points[-1]["time"][:19]

    assert runs["empty"]["sampler"] is None
    assert runs["empty"]["sparkline"] is None
    assert runs["empty"]["last_step"] is None
    assert runs["empty"]["latest"] == {}

    only = client.get("/v1/overview", params={"runs": "collapsing,nope", "points": 0}).json()["runs"]
    assert [r["name"] for r in only] == ["collapsing"]
    assert only[0]["sparkline"] is None


def test_series_as_columns_hold_exactly_the_points_of_the_json_format(client):
    feed(client, "r", [1.0, 0.5, 0.2, 0.0])
    names = "mi_estimate,retrieval_accuracy,mi_estimate_ci_low"
    points = client.get("/v1/runs/r/metrics", params={"names": names, "sampler": "matrix,all"}).json()["points"]
    body = client.get("/v1/runs/r/metrics", params={"names": names, "sampler": "matrix,all", "format": "columns"})
    series = body.json()["series"]
    assert [(s["sampler"], s["name"]) for s in series] == [
        ("matrix", "mi_estimate"),
        ("matrix", "mi_estimate_ci_low"),
        ("matrix", "retrieval_accuracy"),
    ]
    for s in series:
        expected = [(p["step"], p["value"]) for p in points if p["name"] == s["name"]]
        assert list(zip(s["steps"], s["values"], strict=True)) == expected
    assert body.json()["truncated"] is False
    later = client.get("/v1/runs/r/metrics", params={"names": "mi_estimate", "from_step": 3, "format": "columns"})
    assert later.json()["series"][0]["steps"] == [3, 4]

    def capped(limit):
        params = {"names": names, "sampler": "matrix", "format": "columns", "limit": limit}
        body = client.get("/v1/runs/r/metrics", params=params).json()
        return [len(s["steps"]) for s in body["series"]], body["truncated"]

    assert capped(12) == ([4, 4, 4], False)
    assert capped(5) == ([4, 1], True)
    assert capped(4) == ([4], True)


def test_the_catalogue_names_every_exported_metric_as_prometheus_shows_it(client):
    feed(client, "r", [1.0, 1.0])
    catalogue = client.get("/v1/catalogue").json()["metrics"]
    assert [m["stored"] for m in catalogue] == [e.stored for e in EXPORTED]
    exposition = client.get("/metrics").text
    mi = next(m for m in catalogue if m["stored"] == "mi_estimate")
    assert f'{mi["prometheus"]}{{run="r",sampler="matrix"}}' in exposition


def test_the_pages_and_their_static_files_are_served(client):
    for path, script in (("/", "runs.js"), ("/runs/any-run", "run.js"), ("/compare", "compare.js")):
        page = client.get(path)
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert page.headers["cache-control"] == "no-cache"
        assert f'src="/static/{script}"' in page.text
    chart = client.get("/static/vendor/uplot/uPlot.iife.min.js")
    assert chart.status_code == 200
    assert "javascript" in chart.headers["content-type"]
    assert "MIT" in client.get("/static/vendor/uplot/LICENSE").text
    assert client.get("/static/%2e%2e/api/pages.py").status_code == 404
    assert "/runs/{run}" not in client.get("/openapi.json").json()["paths"]


def test_a_scored_rollout_batch_stores_its_matrix_with_the_reasoning_of_each_prompt(database_url, client_for):
    client = client_for(database_url)
    client.post("/v1/runs", json={"name": "r", "sampler": {"samplers": ["first_turn", "trajectory"], "num_samples": 9}})
    response = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories(n_groups=4)})
    status = wait_for(client, response.json()["batch_id"])
    assert status["status"] == "done"

    for sampler in ("first_turn", "trajectory"):
        body = client.get("/v1/runs/r/matrix", params={"sampler": sampler}).json()
        result = status["results"]["samplers"][sampler]
        assert (body["step"], body["sampler"], body["batch_id"]) == (1, sampler, status["batch_id"])
        assert (body["rows"], body["columns"]) == (result["rows"], result["columns"])
        # Provenance: the tiny model run by our kernel, in float32 (the settings' dtype).
        assert body["scored_by"] == status["results"]["scored_by"]
        assert body["scored_by"] == {"engine": "kernel", "model": "tiny-random", "dtype": "float32", "server": None}
        L = np.array(body["L_tok"])
        assert L.shape == (body["rows"], body["columns"])
        assert body["row_columns"] == sorted(body["row_columns"])  # grouped by prompt
        np.testing.assert_allclose(body["row_normalized"], prompt_posterior(L), rtol=1e-12)
        assert [p["mi_term"] for p in body["per_prompt"]] == sorted(c["mi_term"] for c in result["per_prompt"])
        by_column = {c["column"]: c for c in result["per_prompt"]}
        for prompt in body["per_prompt"]:
            stored = by_column[prompt["column"]]
            assert prompt["conditional_entropy"] == -stored["matched_mean"]
            assert 1 <= len(prompt["excerpts"]) <= min(3, stored["n_rows"])
            assert all(e.startswith(f"Goal {prompt['group_id']}: option") for e in prompt["excerpts"])
    # The matrix holds what the batch's metrics were computed from: its retrieval accuracy follows.
    body = client.get("/v1/runs/r/matrix").json()
    assert body["sampler"] == "first_turn"
    hits = np.argmax(np.array(body["L_tok"]), axis=1) == np.array(body["row_columns"])
    assert hits.mean() == pytest.approx(body["metrics"]["retrieval_accuracy"], abs=1e-9)


def test_matrix_ingest_stores_its_matrix_and_unknown_steps_are_404(client):
    feed(client, "m", [1.0, 0.0])
    first = client.get("/v1/runs/m/matrix", params={"step": 1, "sampler": "matrix"}).json()
    sent = dependence_matrix(1, 1.0)
    lengths = np.array(sent["reasoning_lengths"])[:, None]
    np.testing.assert_allclose(first["L_tok"], np.array(sent["L_seq"]) / lengths, rtol=1e-6)
    assert first["column_group_ids"] == [0, 1, 2, 3]
    assert all(p["excerpts"] == [] for p in first["per_prompt"])
    assert first["row_sources"] is None
    assert client.get("/v1/runs/m/matrix").json()["step"] == 2

    missing = client.get("/v1/runs/m/matrix", params={"step": 7})
    assert missing.status_code == 404
    assert missing.json()["field"] == "step"
    assert client.get("/v1/runs/nope/matrix").status_code == 404
