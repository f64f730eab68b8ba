"""Deleting a run and purging old payloads, on SQLite and Postgres: what goes, what stays."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, func, select, update

from bench.serving import wait_until
from service.access import issue_token
from service.storage.tables import Alert, Base, Batch, Run, utcnow
from tests.fixtures import dependence_matrix, error_body, trajectories

pytestmark = pytest.mark.integration

# Five healthy steps, then three without input dependence: TemplateCollapse fires (as tests/docker).
DEPENDENCE = [1.5] * 5 + [0.0] * 3
TABLES = Base.metadata.tables
# Every table that holds rows of a run: the runs, the tables with a run_id, and the deliveries of its alerts.
OWNED = {"runs", "alert_deliveries"} | {name for name, table in TABLES.items() if "run_id" in table.c}


def test_every_table_is_either_owned_by_a_run_or_listed_as_shared():
    shared = {"scorer_limits", "scorer_outages", "api_tokens", "access_state"}  # per scorer or service, no run data
    assert set(TABLES) - OWNED == shared


def rows_per_table(url: str, run_name: str) -> dict[str, int]:
    engine = create_engine(url)
    counts = {}
    with engine.connect() as connection:
        run_id = connection.execute(select(Run.id).where(Run.name == run_name)).scalar()
        owners = {
            "runs": TABLES["runs"].c.id == run_id,
            "alert_deliveries": TABLES["alert_deliveries"].c.alert_id.in_(
                select(Alert.id).where(Alert.run_id == run_id)
            ),
            **{name: TABLES[name].c.run_id == run_id for name in OWNED - {"runs", "alert_deliveries"}},
        }
        for name, owner in owners.items():
            counts[name] = connection.execute(select(func.count()).select_from(TABLES[name]).where(owner)).scalar_one()
    engine.dispose()
    return counts


JSON = {"content-type": "application/json"}


def matrix_body(step: int, dependence: float) -> bytes:
    return json.dumps(dependence_matrix(step, dependence)).encode()


def collapse(client, run: str) -> None:
    assert client.post("/v1/runs", json={"name": run, "alerts": {"signal": "mi_estimate"}}).status_code == 201
    for step, dependence in enumerate(DEPENDENCE, start=1):
        response = client.post(f"/v1/runs/{run}/matrices", content=matrix_body(step, dependence), headers=JSON)
        assert response.status_code == 201, response.text


def test_deleting_a_run_removes_everything_it_owns_and_its_prometheus_series(database_url, client_for, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-8").mkdir(parents=True)
    (checkpoints / "step-8" / "config.json").write_text("{}")
    client = client_for(
        database_url,
        scoring_paused=True,
        checkpoint_root=checkpoints,
        alert_webhooks=["http://127.0.0.1:9/hook"],
        token_cache_seconds=0,
    )
    for run in ("doomed", "kept"):
        collapse(client, run)
        assert client.post(f"/v1/runs/{run}/checkpoints", json={"path": "step-8", "step": 8}).status_code == 201
        queued = client.post(f"/v1/runs/{run}/batches", json={"step": 9, "trajectories": trajectories()})
        assert queued.status_code == 202
    before = rows_per_table(database_url, "doomed")
    assert all(before.values()), before  # every table holds something of the run
    kept = rows_per_table(database_url, "kept")
    assert 'run="doomed"' in client.get("/metrics").text

    with client.app.state.monitor.sessions.begin() as session:
        ingest, admin = issue_token(session, "ingest").secret, issue_token(session, "admin").secret
    refused = client.delete("/v1/runs/doomed", headers={"Authorization": f"Bearer {ingest}"})
    assert refused.status_code == 403
    assert refused.json()["detail"] == "deleting a run needs an admin token, got a ingest token"
    assert client.delete("/v1/runs/doomed").status_code == 401
    assert rows_per_table(database_url, "doomed") == before

    deleted = client.delete("/v1/runs/doomed", headers={"Authorization": f"Bearer {admin}"})
    assert deleted.status_code == 204
    assert deleted.content == b""
    assert set(rows_per_table(database_url, "doomed").values()) == {0}
    assert rows_per_table(database_url, "kept") == kept
    metrics = client.get("/metrics").text
    assert 'run="doomed"' not in metrics
    assert 'run="kept"' in metrics
    assert client.get("/v1/runs/doomed").status_code == 404
    unknown = client.delete("/v1/runs/doomed", headers={"Authorization": f"Bearer {admin}"})
    assert unknown.status_code == 404
    assert unknown.json() == error_body(
        "not_found", "run 'doomed' does not exist; create it with POST /v1/runs", field="run"
    )
    # The name is free again: a new run under it starts from nothing.
    assert (
        client.post("/v1/runs", json={"name": "doomed"}, headers={"Authorization": f"Bearer {admin}"}).json()["batches"]
        == {}
    )


def test_without_tokens_a_run_is_deleted_without_one(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    collapse(client, "r")
    assert client.delete("/v1/runs/r").status_code == 204
    assert client.get("/v1/runs").json() == []


def batches_of(url: str, run: str) -> dict[str, tuple[str, str]]:
    """client key -> (batch id, stored payload) of a run's batches."""
    engine = create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(
            select(Batch.idempotency_key, Batch.id, Batch.payload)
            .join(Run, Run.id == Batch.run_id)
            .where(Run.name == run)
        ).all()
    engine.dispose()
    return {str(key): (batch_id, payload) for key, batch_id, payload in rows}


def backdate_batches(url: str, days: float) -> None:
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(update(Batch).values(created_at=utcnow() - timedelta(days=days)))
    engine.dispose()


def test_the_server_purges_old_payloads_and_keeps_points_results_alerts_and_replays(database_url, client_for):
    first = client_for(database_url, scoring_paused=True)
    collapse(first, "old")
    queued_body = {"step": 9, "batch_id": "old-9", "trajectories": trajectories()}
    assert first.post("/v1/runs/old/batches", json=queued_body).status_code == 202
    series = first.get("/v1/runs/old/metrics").json()["points"]
    alerts = first.get("/v1/runs/old/alerts").json()
    backdate_batches(database_url, 10)
    collapse(first, "recent")

    old = batches_of(database_url, "old")
    client = client_for(database_url, scoring_paused=True, payload_retention_days=5)
    statuses: dict[str, dict] = {}

    def purged() -> bool:
        for key, (batch_id, _) in old.items():
            statuses[key] = client.get(f"/v1/batches/{batch_id}").json()
        return all(s["payload_purged_at"] for key, s in statuses.items() if key != "old-9")

    wait_until(purged, 30, "the background purge")
    assert statuses.pop("old-9")["payload_purged_at"] is None  # still queued: a worker needs it
    assert all(s["status"] == "done" and s["results"]["scored"] for s in statuses.values())
    assert client.get("/v1/runs/old/metrics").json()["points"] == series
    assert client.get("/v1/runs/old/alerts").json() == alerts
    missing = client.get("/v1/runs/old/matrix", params={"step": 8})
    assert missing.status_code == 404
    assert "purged" in missing.json()["detail"]
    assert client.get("/v1/runs/recent/matrix", params={"step": 8}).status_code == 200

    payloads = {key: payload for key, (_, payload) in batches_of(database_url, "old").items()}
    assert payloads.pop("old-9") != ""
    assert set(payloads.values()) == {""}
    assert "" not in {payload for _, payload in batches_of(database_url, "recent").values()}

    # The hash stays: a byte-identical replay is recognised; other bytes under the key cannot be compared any more.
    body = matrix_body(3, DEPENDENCE[2])
    replay = client.post("/v1/runs/old/matrices", content=body, headers=JSON)
    assert replay.status_code == 201
    assert replay.json()["replayed"] is True
    respaced = client.post(
        "/v1/runs/old/matrices",
        content=json.dumps(json.loads(body), indent=1),
        headers={"content-type": "application/json"},
    )
    assert respaced.status_code == 409
    assert "its payload was purged, so only a byte-identical replay is recognised" in respaced.json()["detail"]
