"""What the API answers when the database is not there for it: 503 + Retry-After, /readyz saying why.

The outages of a real Postgres server (stopped, frozen) are in tests/e2e/test_database_outage_e2e.py.
"""

from __future__ import annotations

import itertools
import logging
import socket
import sqlite3
import time

import psycopg
import pytest
from sqlalchemy import event, exc, text

from service.loops import retry_through_outage
from service.storage.database import STORAGE_FULL, make_engine, outage
from tests.fixtures import error_body, trajectories

pytestmark = pytest.mark.integration


def test_readyz_says_migrations_are_pending_on_an_empty_database(client_for, empty_database_url):
    client = client_for(empty_database_url, auto_migrate=False, scoring_paused=True)
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
    assert refused.json() == error_body(
        "database_unavailable",
        "the database is unavailable (timed out: another writer held the database too long); "
        "retry after the Retry-After header",
    )
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
    nowhere = make_engine(
        f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/postgres", connect_timeout_seconds=2
    )
    with pytest.raises(exc.OperationalError) as refused:
        nowhere.connect()
    assert outage(refused.value) == "unreachable: the database refused or dropped the connection"
    nowhere.dispose()


def test_a_finishing_write_is_retried_through_an_outage_until_its_deadline(caplog):
    nowhere = make_engine(
        f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/postgres", connect_timeout_seconds=2
    )
    tries: list[float] = []

    def write_after_two_refusals() -> str:
        tries.append(time.monotonic())
        if len(tries) <= 2:
            nowhere.connect()  # refused: the database is down
        return "written"

    log = logging.getLogger("test")
    assert retry_through_outage(write_after_two_refusals, time.monotonic() + 30, log, "finishing") == "written"
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert 0.5 <= gaps[0] < 1.0  # ROUND_BACKOFF.delay(1): 0.5 s and up to a quarter more
    assert 1.0 <= gaps[1] < 2.0  # ROUND_BACKOFF.delay(2): 1 s and up to a quarter more
    assert "database unreachable" in caplog.text

    def refused() -> None:
        nowhere.connect()

    with pytest.raises(exc.OperationalError):  # past the deadline (the lease): the last error is raised
        retry_through_outage(refused, time.monotonic() + 0.1, log, "finishing")

    wrong_tries = []

    def wrong() -> None:
        wrong_tries.append(1)
        raise exc.ProgrammingError("SELECT nothing", {}, Exception("a bug"))

    with pytest.raises(exc.ProgrammingError):  # not an outage: raised at once, never retried
        retry_through_outage(wrong, time.monotonic() + 30, log, "finishing")
    assert len(wrong_tries) == 1
    nowhere.dispose()


def closed_port() -> int:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_full_sqlite_disk_answers_507_storage_full_and_readyz_says_so(client_for, tmp_path):
    """Issue 29 row 9: a full volume answered 503 "unreachable" and /readyz said the database was ok.

    SQLite's own SQLITE_FULL ("database or disk is full"), as on a full volume: the file may not grow
    past the pages it holds (``max_page_count``, set on every connection of the app's engine).
    """
    client = client_for(f"sqlite:///{tmp_path / 'monitor.db'}", scoring_paused=True)
    assert client.post("/v1/runs", json={"name": "r"}).status_code == 201
    engine = client.app.state.monitor.engine
    with engine.connect() as connection:
        pages = connection.exec_driver_sql("PRAGMA page_count").scalar()

    def cap(dbapi_connection, _record) -> None:
        dbapi_connection.execute(f"PRAGMA max_page_count = {pages}")

    event.listen(engine, "connect", cap)
    engine.dispose()  # the pooled connections go; new ones get the cap
    big = {
        "step": 1,
        "trajectories": [t | {"turns": [{"prompt": "p" * 50_000, "response": "r"}]} for t in trajectories(2, 2, 1)],
    }
    refused = client.post("/v1/runs/r/batches", json=big)
    assert refused.status_code == 507, refused.text
    assert refused.json()["error"] == "storage_full"
    assert refused.json()["detail"].startswith("storage full: the database's disk has no space left for writes")
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["database"].startswith("storage full")
    assert client.get("/v1/runs/r").status_code == 200  # reads still work
    assert sum(client.get("/v1/runs/r").json()["batches"].values()) == 0  # nothing of it was kept


def test_postgres_disk_full_is_storage_full():
    """SQLSTATE 53100 from psycopg, as SQLAlchemy wraps it."""
    error = exc.OperationalError(
        "INSERT", {}, psycopg.errors.DiskFull("could not extend file: No space left on device")
    )
    assert outage(error) == STORAGE_FULL
