"""What the API answers when the database is not there for it: 503 + Retry-After, /readyz saying why.

The outages of a real Postgres server (stopped, frozen) are in tests/e2e/test_database_outage_e2e.py.
"""

from __future__ import annotations

import socket
import sqlite3

import pytest
from sqlalchemy import exc, text

from service.storage.database import make_engine, outage

pytestmark = pytest.mark.integration


def test_readyz_says_migrations_are_pending_on_an_empty_database(client_for, database_url):
    client = client_for(database_url, auto_migrate=False, scoring_paused=True)
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["ready"] is False
    assert ready.json()["database"].startswith("migrations pending: the database is at no schema, code needs 00")


def test_a_sqlite_database_locked_past_the_busy_timeout_answers_503_with_retry_after(client_for, tmp_path):
    path = tmp_path / "monitor.db"
    client = client_for(f"sqlite:///{path}", database_statement_timeout_seconds=0.2, scoring_paused=True)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another writer holding the file
    try:
        refused = client.post("/v1/runs", json={"name": "locked"})
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) > 0
    assert refused.json() == {
        "error": "database_unavailable",
        "detail": "the database is unavailable (timed out: another writer held the database too long); "
        "retry after the Retry-After header",
        "field": None,
        "index": None,
    }
    assert client.post("/v1/runs", json={"name": "locked"}).status_code == 201
    metrics = client.get("/metrics").text
    assert 'collapse_monitor_rejections_total{reason="database_unavailable"} 1.0' in metrics


def test_every_rejection_reason_including_database_unavailable_is_exported_from_zero(client_for, tmp_path):
    client = client_for(f"sqlite:///{tmp_path / 'monitor.db'}", scoring_paused=True)
    assert 'collapse_monitor_rejections_total{reason="database_unavailable"} 0.0' in client.get("/metrics").text


def test_outage_tells_timeouts_and_refusals_from_faults_of_a_query(postgres_url):
    engine = make_engine(postgres_url, connect_timeout_seconds=2, statement_timeout_seconds=0.2)
    with engine.connect() as connection:
        with pytest.raises(exc.OperationalError) as slow:
            connection.execute(text("SELECT pg_sleep(2)"))  # past the server's statement_timeout
        assert outage(slow.value) == "timed out: the database did not answer in time"
        connection.rollback()
        with pytest.raises(exc.ProgrammingError) as wrong:
            connection.execute(text("SELECT * FROM no_such_table"))
        assert outage(wrong.value) is None  # a fault of the query: 500, not 503
    engine.dispose()
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nowhere = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", connect_timeout_seconds=2)
    with pytest.raises(exc.OperationalError) as refused:
        nowhere.connect()
    assert outage(refused.value) == "unreachable: the database refused or dropped the connection"
    nowhere.dispose()
