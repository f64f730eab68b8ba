"""API tokens on SQLite and Postgres: who may write, read and scrape; whole error bodies; every refusal counted."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, func, select, text

from service.access import issue_token
from service.storage import tokens
from service.storage.database import make_sessions, migrate
from service.storage.tables import ApiToken, Run, utcnow
from tests.fixtures import dependence_matrix, error_body, trajectories

pytestmark = pytest.mark.integration

CHALLENGE = 'Bearer realm="collapse-monitor"'


def issue(client, scope: str, run_prefix: str = "") -> str:
    with client.app.state.monitor.sessions.begin() as session:
        return issue_token(session, scope, run_prefix).secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def rejections(client, token: str | None = None) -> dict[str, float]:
    text = client.get("/metrics", headers=bearer(token) if token else {}).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "collapse_monitor_rejections"]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


def runs_in(url) -> list[str]:
    engine = create_engine(url)
    with engine.connect() as connection:
        names = connection.execute(select(Run.name).order_by(Run.name)).scalars().all()
    engine.dispose()
    return list(names)


def test_without_tokens_everything_is_open_and_a_sent_token_is_ignored(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    assert client.post("/v1/runs", json={"name": "open"}, headers=bearer("cm_made-up")).status_code == 201
    assert client.get("/v1/runs", headers=bearer("cm_made-up")).status_code == 200
    assert client.get("/metrics").status_code == 200
    counted = rejections(client)
    for reason in ("unauthorized", "invalid_token", "revoked_token", "insufficient_scope", "run_limit"):
        assert counted[reason] == 0, reason  # exported from zero


def test_once_a_token_exists_writes_need_a_valid_one_with_the_right_scope(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, token_cache_seconds=0)
    assert client.post("/v1/runs", json={"name": "team-a-1"}).status_code == 201
    ingest, reader = issue(client, "ingest", "team-a-"), issue(client, "read")

    missing = client.post("/v1/runs/team-a-1/batches", json={"step": 1, "trajectories": trajectories()})
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == CHALLENGE
    assert missing.json() == error_body(
        "unauthorized",
        "this request needs an API token: send the header Authorization: Bearer <token> "
        "(an operator creates one with `collapse-monitor tokens create`)",
    )
    # Refused before the body is read: a malformed body without a token is a 401, not a 422.
    assert client.post("/v1/runs/team-a-1/batches", content=b"{").status_code == 401
    made_up = client.post("/v1/runs", json={"name": "team-a-2"}, headers=bearer("cm_made-up"))
    assert made_up.status_code == 401
    assert made_up.headers["www-authenticate"] == f'{CHALLENGE}, error="invalid_token"'
    assert made_up.json()["error"] == "invalid_token"
    basic = client.post("/v1/runs", json={"name": "team-a-2"}, headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert basic.json()["error"] == "unauthorized"

    read_only = client.post("/v1/runs", json={"name": "team-a-2"}, headers=bearer(reader))
    assert read_only.status_code == 403
    assert read_only.json() == error_body(
        "insufficient_scope",
        "a read token may not write; writes need an ingest token (for the run's name prefix) or an admin token",
    )
    elsewhere = client.post("/v1/runs", json={"name": "team-b-1"}, headers=bearer(ingest))
    assert elsewhere.status_code == 403
    assert elsewhere.json() == error_body(
        "insufficient_scope",
        "this ingest token may write runs whose name starts with 'team-a-', not 'team-b-1'",
        field="name",
    )
    other_run = client.post("/v1/runs", json={"name": "other"})  # created by nobody: tokens are needed now
    assert other_run.status_code == 401
    assert runs_in(database_url) == ["team-a-1"]

    assert client.post("/v1/runs", json={"name": "team-a-2"}, headers=bearer(ingest)).status_code == 201
    accepted = client.post(
        "/v1/runs/team-a-2/batches", json={"step": 1, "trajectories": trajectories()}, headers=bearer(ingest)
    )
    assert accepted.status_code == 202
    matrix = client.post("/v1/runs/team-a-2/matrices", json=dependence_matrix(1, 1.0), headers=bearer(ingest))
    assert matrix.status_code == 201
    admin = issue(client, "admin")
    assert client.post("/v1/runs", json={"name": "other"}, headers=bearer(admin)).status_code == 201
    outside = client.post("/v1/runs/other/matrices", json=dependence_matrix(1, 1.0), headers=bearer(ingest))
    assert (outside.status_code, outside.json()["field"]) == (403, "run")

    counted = rejections(client)
    assert counted["unauthorized"] == 4
    assert counted["invalid_token"] == 1
    assert counted["insufficient_scope"] == 3


def test_a_revoked_token_is_refused_once_the_cache_lets_go(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, token_cache_seconds=0.2)
    keep, old = issue(client, "admin"), issue(client, "ingest")
    assert client.post("/v1/runs", json={"name": "r"}, headers=bearer(old)).status_code == 201
    with client.app.state.monitor.sessions.begin() as session:
        (old_id,) = [t.id for t in tokens.list_tokens(session) if t.scope == "ingest"]
        tokens.revoke_token(session, old_id)
    time.sleep(0.3)
    refused = client.post("/v1/runs/r/matrices", json=dependence_matrix(1, 1.0), headers=bearer(old))
    assert refused.status_code == 401
    assert refused.json() == error_body(
        "revoked_token", f"the bearer token {old[:8]}... was revoked; ask an operator for a new one"
    )
    assert refused.headers["www-authenticate"] == f'{CHALLENGE}, error="invalid_token", error_description="revoked"'
    assert client.post("/v1/runs/r/matrices", json=dependence_matrix(1, 1.0), headers=bearer(keep)).status_code == 201
    assert rejections(client)["revoked_token"] == 1


def test_reads_and_metrics_need_a_token_only_when_the_settings_say_so(database_url, client_for):
    client = client_for(
        database_url,
        scoring_paused=True,
        token_cache_seconds=0,
        require_token_for_reads=True,
        require_token_for_metrics=True,
    )
    assert client.get("/v1/runs").status_code == 401  # also before any token exists
    admin, reader = issue(client, "admin"), issue(client, "read")
    ingest = issue(client, "ingest", "team-a-")
    for name in ("team-a-1", "team-b-1"):
        assert client.post("/v1/runs", json={"name": name}, headers=bearer(admin)).status_code == 201
    batch = client.post("/v1/runs/team-b-1/matrices", json=dependence_matrix(1, 1.0), headers=bearer(admin)).json()

    for path in ("/v1/runs", "/v1/runs/team-a-1", "/v1/overview", "/v1/alerts", "/v1/catalogue", "/metrics"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=bearer(reader)).status_code == 200, path
    assert client.get("/healthz").status_code == client.get("/readyz").status_code == 200
    assert client.get("/").status_code == 200  # the page itself holds no data; its /v1 calls carry the token

    # An ingest token reads the runs it writes, and nothing else.
    assert client.get("/v1/runs/team-a-1", headers=bearer(ingest)).status_code == 200
    assert client.get("/v1/runs/team-a-1/metrics", headers=bearer(ingest)).status_code == 200
    assert client.get("/v1/overview?runs=team-a-1", headers=bearer(ingest)).status_code == 200
    # A page cursor naming another team's run answers as a direct read of it (which of the token's runs
    # follow it would tell that the run exists and when it was made); a deleted one of its own, 404.
    cursor = client.get("/v1/overview?runs=team-a-1&after=team-b-1", headers=bearer(ingest))
    direct = client.get("/v1/runs/team-b-1", headers=bearer(ingest))
    assert (cursor.status_code, cursor.json()) == (403, direct.json())
    assert client.get("/v1/overview?runs=team-a-1&after=team-a-9", headers=bearer(ingest)).status_code == 404
    assert client.get("/v1/catalogue", headers=bearer(ingest)).status_code == 200
    refused = client.get("/v1/runs", headers=bearer(ingest))
    assert refused.status_code == 403
    assert refused.json()["detail"] == (
        "this ingest token may not read every run; reads need a read or admin token "
        "(an ingest token reads the runs whose name starts with 'team-a-')"
    )
    assert client.get("/v1/runs/team-b-1/matrix", headers=bearer(ingest)).status_code == 403
    assert client.get(f"/v1/batches/{batch['batch_id']}", headers=bearer(ingest)).status_code == 403
    assert client.get(f"/v1/batches/{batch['batch_id']}", headers=bearer(reader)).status_code == 200
    metrics = client.get("/metrics", headers=bearer(ingest))
    assert metrics.status_code == 403
    assert metrics.json()["detail"] == "/metrics needs a read or admin token, got an ingest token"


def test_an_ingest_token_creates_at_most_max_runs_per_token_runs(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, token_cache_seconds=0, max_runs_per_token=2)
    ingest, admin = issue(client, "ingest"), issue(client, "admin")
    for name in ("a", "b"):
        assert client.post("/v1/runs", json={"name": name}, headers=bearer(ingest)).status_code == 201
    assert client.post("/v1/runs", json={"name": "a"}, headers=bearer(ingest)).status_code == 200  # not a creation
    third = client.post("/v1/runs", json={"name": "c"}, headers=bearer(ingest))
    assert third.status_code == 403
    assert third.json() == error_body(
        "run_limit",
        f"this ingest token ({ingest[:8]}...) has created 2 runs, the limit (max_runs_per_token=2); an "
        "admin can delete old runs (DELETE /v1/runs/{run}) or raise the limit",
        field="name",
    )
    assert "www-authenticate" not in third.headers
    assert client.post("/v1/runs", json={"name": "c"}, headers=bearer(admin)).status_code == 201  # admins: no limit
    assert client.delete("/v1/runs/a", headers=bearer(admin)).status_code == 204
    assert client.post("/v1/runs", json={"name": "d"}, headers=bearer(ingest)).status_code == 201
    assert rejections(client)["run_limit"] == 1
    engine = create_engine(database_url)
    with engine.connect() as connection:
        created = connection.execute(select(func.count()).select_from(Run).where(Run.created_by_token.is_not(None)))
        assert created.scalar_one() == 3
    engine.dispose()


def revoke_all(client) -> None:
    with client.app.state.monitor.sessions.begin() as session:
        for token in tokens.list_tokens(session):
            tokens.revoke_token(session, token.id)


def test_revoking_every_token_keeps_anonymous_writes_and_deletes_refused(database_url, client_for):
    """Issue 17: with every token revoked, anonymous batches were accepted (202) and runs deleted (204)."""
    client = client_for(database_url, scoring_paused=True, token_cache_seconds=0)
    admin = issue(client, "admin")
    assert client.post("/v1/runs", json={"name": "r"}, headers=bearer(admin)).status_code == 201
    revoke_all(client)
    batch = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories()})
    assert (batch.status_code, batch.json()["error"]) == (401, "unauthorized")
    assert client.delete("/v1/runs/r").status_code == 401
    assert client.post("/v1/runs", json={"name": "s"}).status_code == 401
    assert (
        client.post(
            "/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories()}, headers=bearer(admin)
        ).json()["error"]
        == "revoked_token"
    )
    with client.app.state.monitor.sessions.begin() as session:  # an empty token table, as after a partial restore
        session.query(ApiToken).delete()
    assert client.delete("/v1/runs/r").status_code == 401
    assert runs_in(database_url) == ["r"]


def test_a_server_started_before_any_token_closes_writes_once_one_is_issued(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, token_cache_seconds=0)
    assert client.post("/v1/runs", json={"name": "open"}).status_code == 201  # open mode on loopback
    admin = issue(client, "admin")  # as `collapse-monitor tokens create` would, from another process
    assert client.post("/v1/runs", json={"name": "closed"}).status_code == 401
    assert client.post("/v1/runs", json={"name": "closed"}, headers=bearer(admin)).status_code == 201


def test_auth_on_needs_a_token_before_any_exists_and_off_never_does(database_url, client_for):
    closed = client_for(database_url, scoring_paused=True, auth="on")
    assert closed.post("/v1/runs", json={"name": "r"}).status_code == 401
    assert closed.get("/v1/runs").status_code == 200  # reads follow require_token_for_reads
    admin = issue(closed, "admin")
    assert closed.post("/v1/runs", json={"name": "r"}, headers=bearer(admin)).status_code == 201
    open_mode = client_for(database_url, scoring_paused=True, auth="off")
    assert open_mode.post("/v1/runs/r/matrices", json=dependence_matrix(1, 1.0)).status_code == 201
    assert open_mode.delete("/v1/runs/r").status_code == 204


def test_a_non_loopback_host_needs_tokens_for_writes_unless_insecure_binding_was_allowed(database_url, client_for):
    exposed = client_for(database_url, scoring_paused=True, host="0.0.0.0")
    assert exposed.post("/v1/runs", json={"name": "r"}).status_code == 401
    trusted = client_for(database_url, scoring_paused=True, host="0.0.0.0", allow_insecure_bind=True)
    assert trusted.post("/v1/runs", json={"name": "r"}).status_code == 201


def test_an_ingest_token_for_team_a_covers_team_a_runs_and_not_team_admin(database_url, client_for):
    """Issue 17: a token created with --run-prefix team-a created run team-admin-x (a raw startswith)."""
    client = client_for(database_url, scoring_paused=True, token_cache_seconds=0, require_token_for_reads=True)
    ingest = issue(client, "ingest", "team-a")
    for name in ("team-a", "team-a-grpo", "team-a_ppo"):
        assert client.post("/v1/runs", json={"name": name}, headers=bearer(ingest)).status_code == 201, name
    refused = client.post("/v1/runs", json={"name": "team-admin-x"}, headers=bearer(ingest))
    assert refused.status_code == 403
    assert refused.json() == error_body(
        "insufficient_scope",
        "this ingest token may write runs named 'team-a' or starting with 'team-a' and a separator "
        "(- _ . / :), not 'team-admin-x'",
        field="name",
    )
    admin = issue(client, "admin")
    assert client.post("/v1/runs", json={"name": "team-admin-x"}, headers=bearer(admin)).status_code == 201
    matrix = client.post("/v1/runs/team-admin-x/matrices", json=dependence_matrix(1, 1.0), headers=bearer(ingest))
    assert (matrix.status_code, matrix.json()["field"]) == (403, "run")
    assert client.get("/v1/runs/team-admin-x", headers=bearer(ingest)).status_code == 403
    assert client.get("/v1/runs/team-a-grpo", headers=bearer(ingest)).status_code == 200
    assert client.get("/v1/overview?runs=team-a,team-admin-x", headers=bearer(ingest)).status_code == 403


def test_a_database_that_held_tokens_before_the_kept_fact_existed_keeps_writes_closed(empty_database_url):
    migrate(empty_database_url, "0008")
    engine = create_engine(empty_database_url)
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO api_tokens (scope, run_prefix, secret_sha256, hint, created_at, revoked_at) "
                "VALUES ('admin', '', 'x', 'cm_x', :t, :t)"
            ),
            {"t": utcnow()},
        )
    migrate(empty_database_url)
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM api_tokens"))
    with make_sessions(engine)() as session:
        assert tokens.tokens_were_issued(session)
    engine.dispose()


def test_requests_without_a_token_create_at_most_max_runs_without_token_runs(database_url, client_for):
    """Issue 29 row 5: 10,000 runs created in open mode in 47.5 s made every run list take 12-28 s."""
    client = client_for(database_url, scoring_paused=True, max_runs_without_token=2)
    for name in ("a", "b"):
        assert client.post("/v1/runs", json={"name": name}).status_code == 201
    assert client.post("/v1/runs", json={"name": "a"}).status_code == 200  # a re-post is no creation
    third = client.post("/v1/runs", json={"name": "c"})
    assert third.status_code == 403
    assert third.json() == error_body(
        "run_limit",
        "requests without a token have created 2 runs, the limit (max_runs_without_token=2); an admin can "
        "delete old runs (DELETE /v1/runs/{run}), raise the limit, or issue tokens",
        field="name",
    )
    assert client.delete("/v1/runs/a").status_code == 204
    assert client.post("/v1/runs", json={"name": "c"}).status_code == 201
