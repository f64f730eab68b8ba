"""Database outages against a real server: 503 + Retry-After in the documented shape, then recovery in seconds.

A throwaway Postgres cluster (tests/e2e/pg_cluster.py) is stopped, or frozen with SIGSTOP (a hung
server that refuses nothing), while a client streams batches (tests/e2e/outage_drill.py).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.e2e.conftest import service_env, start_service
from tests.e2e.outage_drill import Drill
from tests.e2e.pg_cluster import PG_BIN, ThrowawayPostgres

pytestmark = pytest.mark.e2e

CONNECT_SECONDS = 2  # the smallest libpq allows
STATEMENT_SECONDS = 2.0


@pytest.fixture
def database() -> Iterator[ThrowawayPostgres]:
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"PostgreSQL server binaries are not installed at {PG_BIN}")
    with ThrowawayPostgres() as cluster:
        yield cluster


def serve(processes, tmp_path, url: str) -> str:
    env = service_env(
        tmp_path,
        url,
        COLLAPSE_MONITOR_DATABASE_CONNECT_TIMEOUT_SECONDS=str(CONNECT_SECONDS),
        COLLAPSE_MONITOR_DATABASE_STATEMENT_TIMEOUT_SECONDS=str(STATEMENT_SECONDS),
        COLLAPSE_MONITOR_RATE_LIMIT_PER_SECOND="0",
    )
    return start_service(processes, env)


def check_outage_answers(drill: Drill) -> None:
    during = drill.during()
    assert {a.what for a in during} == {"ingest", "run", "healthz", "readyz"}, "every kind of request met the outage"
    for a in during:
        assert a.status is not None, f"{a.what} got no answer: {a.body}"
        if a.what == "healthz":
            assert a.status == 200
        elif a.what == "readyz":
            if a.status == 503:
                assert a.body["ready"] is False
                assert a.body["database"].startswith(("unreachable", "timed out")), a.body
            # A probe may start just before the database is out, or answer once it is back.
            assert a.seconds < 1.0, f"/readyz took {a.seconds:.2f}s"
        else:
            assert a.status in (200, 202, 503), (a.what, a.status, a.body)
            if a.status == 503:
                assert a.retry_after is not None
                assert int(a.retry_after) > 0
                assert a.is_json_error, a.body
                assert a.body["error"] == "database_unavailable", a.body
            # Every wait is bounded: a free pooled connection (CONNECT), then its ping (CONNECT) and a new
            # connection (CONNECT), or a statement (STATEMENT + 1 s); plus a crowded machine's slack.
            assert a.seconds < 2 * CONNECT_SECONDS + STATEMENT_SECONDS + 3, f"{a.what} took {a.seconds:.1f}s"
    assert sum(a.status == 503 for a in during if a.what == "ingest") >= 1
    assert any(a.status == 503 for a in during if a.what == "readyz")


def check_nothing_lost_or_scored_twice(drill: Drill) -> None:
    stored = drill.stored()
    assert stored["batches"] == len(drill.ids)
    assert stored["lost"] == stored["duplicated"] == stored["not_done"] == 0, stored
    # Scored once: no batch was claimed again after a lost lease, none has its points twice.
    assert stored["scored_more_than_once"] == 0, stored
    assert stored["batches_with_points"] == len(drill.ids)
    assert stored["duplicate_points"] == 0
    assert stored["first_scored_after_back_seconds"] is not None
    assert stored["first_scored_after_back_seconds"] < 5.0, stored


def test_a_stopped_database_answers_503_and_scoring_resumes_within_seconds(processes, tmp_path, database):
    base = serve(processes, tmp_path, database.url)
    drill = Drill(base, database, "stop", outage_seconds=5.0)
    drill.run(timeout=300)  # a deadline, not the expected time: ~60 s idle, 212 s at load 14
    check_outage_answers(drill)
    check_nothing_lost_or_scored_twice(drill)
    log = processes.log("serve")
    # An outage is logged in one line per request or round, never as an error with a traceback.
    assert "ERROR collapse_monitor" not in log
    assert "Exception in ASGI application" not in log


def test_a_frozen_database_answers_within_the_timeouts_and_recovers(processes, tmp_path, database):
    base = serve(processes, tmp_path, database.url)
    # Longer than every timeout, so that requests meet them rather than the thaw.
    drill = Drill(base, database, "freeze", outage_seconds=2 * CONNECT_SECONDS + STATEMENT_SECONDS + 4)
    drill.run(timeout=300)  # a deadline, not the expected time: ~60 s idle, 212 s at load 14
    check_outage_answers(drill)
    check_nothing_lost_or_scored_twice(drill)
    assert "ERROR collapse_monitor" not in processes.log("serve")


def test_503_and_500_answer_json_and_keep_the_connection(processes, tmp_path, database):
    base = serve(processes, tmp_path, database.url)
    address = urlsplit(base)
    connection = http.client.HTTPConnection(address.netloc, timeout=30)

    def get(path: str) -> tuple[int, dict[str, str], dict]:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, dict(response.headers), json.loads(response.read())

    assert get("/v1/runs")[0] == 200
    socket_before = connection.sock
    # A fault of a query, not an outage: the table it reads is gone.
    engine = create_engine(database.url)
    with engine.begin() as c:
        c.execute(text("ALTER TABLE runs RENAME TO runs_away"))
    status, _, body = get("/v1/runs")
    assert status == 500
    assert set(body) == {"error", "detail", "field", "index"}
    assert body["error"] == "internal_error"
    with engine.begin() as c:
        c.execute(text("ALTER TABLE runs_away RENAME TO runs"))
    engine.dispose()
    assert get("/v1/runs")[0] == 200
    database.stop()
    for _ in range(3):
        status, headers, body = get("/v1/runs")
        assert status == 503
        assert body["error"] == "database_unavailable"
        assert int(headers["retry-after"]) > 0
    database.start()
    assert get("/v1/runs")[0] == 200
    assert connection.sock is socket_before, "the keep-alive connection survived the 500 and the 503s"
    connection.close()
    metrics = httpx.get(f"{base}/metrics").text
    assert 'collapse_monitor_rejections_total{reason="database_unavailable"} 3.0' in metrics
