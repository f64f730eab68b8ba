"""``collapse-monitor tokens`` and ``collapse-monitor purge`` on SQLite and Postgres."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, select, update

from service.access import digest
from service.cli import main
from service.storage.tables import ApiToken, Batch, utcnow
from tests.fixtures import dependence_matrix

pytestmark = pytest.mark.integration


@pytest.fixture
def cli(capsys, monkeypatch):
    """Runs the command line; returns (exit code, stdout as JSON or None, stderr)."""
    for key in [k for k in os.environ if k.startswith("COLLAPSE_MONITOR_")]:
        monkeypatch.delenv(key)

    def run(*args: str) -> tuple[int, object, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, json.loads(out) if out else None, err

    return run


def test_tokens_are_created_once_listed_without_secrets_and_revoked(database_url, cli):
    code, created, err = cli(
        "tokens", "create", "--scope", "ingest", "--run-prefix", "team-a-", "--name", "trainer", "--database-url",
        database_url,
    )  # fmt: skip
    assert code == 0
    assert err == "Keep this token now: it is not shown again (only its hash is stored).\n"
    secret = created.pop("token")
    assert created == {"id": 1, "name": "trainer", "scope": "ingest", "run_prefix": "team-a-"}
    assert secret.startswith("cm_")
    assert len(secret) >= 40
    _, admin, _ = cli("tokens", "create", "--scope", "admin", "--database-url", database_url)

    engine = create_engine(database_url)
    with engine.connect() as connection:
        stored = connection.execute(select(ApiToken.secret_sha256, ApiToken.hint).order_by(ApiToken.id)).all()
    engine.dispose()
    assert [tuple(row) for row in stored] == [
        (digest(secret), secret[:8]),
        (digest(admin["token"]), admin["token"][:8]),
    ]

    code, listed, _ = cli("tokens", "list", "--database-url", database_url)
    assert code == 0
    assert [(t["id"], t["scope"], t["run_prefix"], t["hint"], t["revoked_at"], t["runs_created"]) for t in listed] == [
        (1, "ingest", "team-a-", secret[:8], None, 0),
        (2, "admin", "", admin["token"][:8], None, 0),
    ]
    assert secret not in json.dumps(listed)

    code, revoked, err = cli("tokens", "revoke", "1", "--database-url", database_url)
    assert (code, revoked["id"], err) == (0, 1, "")
    assert revoked["revoked_at"] is not None
    assert cli("tokens", "revoke", "2", "--database-url", database_url)[::2] == (
        2,
        "error: tokens revoke: token 2 is the last unrevoked admin token: without one no one can delete runs through "
        "the API; create its successor first (collapse-monitor tokens create --scope admin), or pass --force\n",
    )
    code, _, err = cli("tokens", "revoke", "2", "--force", "--database-url", database_url)
    assert code == 0
    assert err.startswith("warning: no unrevoked token is left: writes stay refused")
    assert cli("tokens", "revoke", "7", "--database-url", database_url)[::2] == (
        2,
        "error: tokens revoke: no token has id 7 (see `collapse-monitor tokens list`)\n",
    )


def test_bad_token_arguments_exit_2_with_one_line(tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    assert cli("tokens", "create", "--scope", "read", "--run-prefix", "x", "--database-url", url)[::2] == (
        2,
        "error: --run-prefix: only ingest tokens are limited to a run prefix, not read tokens\n",
    )
    code, _, err = cli("tokens", "create", "--scope", "root", "--database-url", url)
    assert code == 2
    assert "argument --scope: invalid choice: 'root'" in err
    assert cli("tokens", "create", "--scope", "ingest", "--run-prefix", "team a", "--database-url", url)[::2] == (
        2,
        "error: --run-prefix: a run prefix is the start of run names: a letter or digit, then letters, digits, '.', "
        "'_' or '-' (at most 128 characters), got 'team a'\n",
    )


def test_an_ingest_token_for_every_run_is_created_with_a_warning(tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    code, created, err = cli("tokens", "create", "--scope", "ingest", "--database-url", url)
    assert (code, created["run_prefix"]) == (0, "")
    assert "warning: this ingest token may write every run (no --run-prefix)" in err
    assert "warning" not in cli("tokens", "create", "--scope", "admin", "--database-url", url)[2]


def test_revoking_an_admin_token_that_has_a_successor_needs_no_force(tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    for _ in range(2):
        cli("tokens", "create", "--scope", "admin", "--database-url", url)
    assert cli("tokens", "revoke", "1", "--database-url", url)[0] == 0
    assert cli("tokens", "revoke", "1", "--database-url", url)[0] == 0  # already revoked: not the last admin
    assert cli("tokens", "revoke", "2", "--database-url", url)[0] == 2


def backdate(url: str, steps: tuple[int, ...], days: float) -> None:
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(
            update(Batch).where(Batch.step.in_(steps)).values(created_at=utcnow() - timedelta(days=days))
        )
    engine.dispose()


def test_purge_empties_old_payloads_of_finished_batches_and_says_how_many(database_url, cli, client_for, monkeypatch):
    client = client_for(database_url, scoring_paused=True)
    client.post("/v1/runs", json={"name": "r"})
    for step in (1, 2, 3):
        assert client.post("/v1/runs/r/matrices", json=dependence_matrix(step, 1.0)).status_code == 201
    backdate(database_url, (1, 2), 40)

    assert cli("purge", "--database-url", database_url)[::2] == (
        2,
        "error: purge: give --older-than-days N, or set payload_retention_days\n",
    )
    code, purged, _ = cli("purge", "--older-than-days", "30", "--database-url", database_url)
    assert code == 0
    assert (purged["batches"], purged["matrices"]) == (2, 2)
    code, again, _ = cli("purge", "--older-than-days", "30", "--database-url", database_url)
    assert (again["batches"], again["matrices"]) == (0, 0)
    backdate(database_url, (3,), 2)
    monkeypatch.setenv("COLLAPSE_MONITOR_PAYLOAD_RETENTION_DAYS", "1")  # the setting, when no flag is given
    code, by_setting, _ = cli("purge", "--database-url", database_url)
    assert (code, by_setting["batches"]) == (0, 1)
    assert all(s["payload_purged_at"] for s in _statuses(client))


def _statuses(client) -> list[dict]:
    engine = create_engine(client.app.state.monitor.settings.resolved_database_url)
    with engine.connect() as connection:
        ids = connection.execute(select(Batch.id)).scalars().all()
    engine.dispose()
    return [client.get(f"/v1/batches/{batch_id}").json() for batch_id in ids]
