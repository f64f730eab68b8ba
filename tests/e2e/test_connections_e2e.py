"""Connections against a real `collapse-monitor serve` (uvicorn's own behaviour): proxy headers only from a
configured proxy, deadlines on slow or silent clients, the concurrency cap, one log line per kind."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, insert, select

from service.storage.tables import Batch, MetricPoint, Run
from tests.e2e.conftest import service_env, start_service

pytestmark = pytest.mark.e2e


def rotating_statuses(base: str, n: int) -> list[int]:
    with httpx.Client(base_url=base, timeout=30) as client:
        return [client.get("/v1/runs", headers={"x-forwarded-for": f"10.0.{i // 250}.{i % 250}"}).status_code
                for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("proxy", [None, "127.0.0.1"])
def test_forwarded_addresses_are_read_only_from_a_configured_proxy(tmp_path, processes, proxy):
    """Issue 29 row 6: uvicorn trusted X-Forwarded-For from loopback, so a local client rotating it got 600 x 200."""
    extra = {"COLLAPSE_MONITOR_FORWARDED_ALLOW_IPS": f'["{proxy}"]'} if proxy else {}
    env = service_env(
        tmp_path,
        COLLAPSE_MONITOR_RATE_LIMIT_PER_SECOND="0.01",
        COLLAPSE_MONITOR_RATE_LIMIT_BURST="5",
        COLLAPSE_MONITOR_SCORING_PAUSED="true",
        **extra,
    )
    statuses = rotating_statuses(start_service(processes, env), 20)
    if proxy is None:  # one client, whatever it claims: its burst, then 429
        assert (statuses.count(200), statuses.count(429)) == (5, 15), statuses
    else:  # behind the listed proxy each forwarded address is a client of its own
        assert statuses == [200] * 20


def test_silent_and_slow_clients_are_closed_and_others_still_served(tmp_path, processes):
    """Issue 29 row 4: 50 connections sending nothing, or a byte a second, were never closed."""
    env = service_env(
        tmp_path,
        COLLAPSE_MONITOR_REQUEST_HEAD_SECONDS="2",
        COLLAPSE_MONITOR_REQUEST_BODY_SECONDS="3",
        COLLAPSE_MONITOR_SCORING_PAUSED="true",
    )
    base = start_service(processes, env)
    port = int(base.rsplit(":", 1)[1])
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    head = b"POST /v1/runs HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    for s in sockets[5:10]:
        s.sendall(head[:5])  # a head a few bytes at a time
    for s in sockets[10:20]:
        s.sendall(head + b"Content-Length: 1000\r\n\r\n{")  # a body a byte at a time
    closed: set[int] = set()
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=base, timeout=5) as other:
        while len(closed) < len(sockets) and time.monotonic() < deadline:
            for i, s in enumerate(sockets):
                if i in closed:
                    continue
                try:
                    s.sendall(head[5:6] if 5 <= i < 10 else b" " if i >= 10 else b"")
                    s.setblocking(False)
                    if s.recv(65536) == b"":
                        closed.add(i)
                except BlockingIOError:
                    pass
                except OSError:  # reset: closed by the server
                    closed.add(i)
            started = time.monotonic()
            assert other.get("/readyz").status_code == 200
            assert time.monotonic() - started < 3  # others are served meanwhile
            time.sleep(1)
    for s in sockets:
        s.close()
    assert len(closed) == 20, f"{len(closed)} of 20 closed within 30 s"
    log = processes.log("serve")
    # One line per kind of refusal, not one per connection.
    assert log.count("closed a connection whose request head was not in") == 1, log[-3000:]
    assert log.count("closed a connection whose request body was not in") == 1, log[-3000:]


def test_connections_past_the_cap_are_answered_503_at_once(tmp_path, processes):
    env = service_env(tmp_path, COLLAPSE_MONITOR_MAX_CONNECTIONS="8", COLLAPSE_MONITOR_SCORING_PAUSED="true")
    base = start_service(processes, env)
    port = int(base.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    try:
        time.sleep(0.5)
        statuses = [httpx.get(f"{base}/v1/runs", timeout=10).status_code for _ in range(3)]
        assert statuses == [503] * 3
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    assert httpx.get(f"{base}/v1/runs", timeout=10).status_code == 200
    assert processes.log("serve").count("Exceeded concurrency limit") == 1


def seed_series(database_url: str, run: str, n_steps: int, per_step: int = 10) -> None:
    """``n_steps`` steps of ``per_step`` points of run ``run``, written in bulk."""
    engine = create_engine(database_url)
    with engine.begin() as connection:
        run_id = connection.scalar(select(Run.id).where(Run.name == run))
        ids = [uuid.uuid4().hex for _ in range(n_steps)]
        batch = {"run_id": run_id, "kind": "matrix", "payload": "", "payload_sha256": "", "status": "done"}
        connection.execute(insert(Batch), [batch | {"id": ids[step], "step": step} for step in range(n_steps)])
        connection.execute(
            insert(MetricPoint),
            [
                {"run_id": run_id, "batch_id": ids[step], "step": step, "sampler": "matrix", "name": f"m{k}"}
                | {"value": step + k / 7, "scorer": "tiny-random"}
                for step in range(n_steps)
                for k in range(per_step)
            ],
        )
    engine.dispose()


def established_to(port: int) -> int:
    """Connections the server holds on ``port`` (its side, from /proc/net/tcp: state 01 is ESTABLISHED)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for r in rows if r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "01")


def test_clients_that_never_read_a_long_series_hold_no_database_connection(tmp_path, processes):
    """Issue 29 row 2: 16 such clients kept the pool's sessions; every database request then answered 503. Their
    connections, with the rest of their answers, were held as long as they stayed: dropped after the stall now."""
    env = service_env(tmp_path, COLLAPSE_MONITOR_SCORING_PAUSED="true", COLLAPSE_MONITOR_RESPONSE_STALL_SECONDS="3")
    base = start_service(processes, env)
    assert httpx.post(f"{base}/v1/runs", json={"name": "r"}, timeout=30).status_code == 201
    seed_series(f"sqlite:///{tmp_path / 'data' / 'collapse-monitor.db'}", "r", 20_000)  # ~30 MB as JSON
    port = int(base.rsplit(":", 1)[1])
    request = b"GET /v1/runs/r/metrics?limit=1000000&segments=all HTTP/1.1\r\nHost: localhost\r\n\r\n"
    readers = []
    for _ in range(16):
        reader = socket.create_connection(("127.0.0.1", port))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.sendall(request)  # and never reads the answer
        readers.append(reader)
    try:
        time.sleep(5)  # the reads are under way, or their answers wait in the sockets
        with httpx.Client(base_url=base, timeout=30) as other:
            for i in range(3):
                started = time.monotonic()
                assert other.get("/readyz").status_code == 200
                assert other.post("/v1/runs", json={"name": f"w{i}"}).status_code == 201
                assert time.monotonic() - started < 5, f"{time.monotonic() - started:.1f} s"
                time.sleep(1)
        # Every reader's connection gone from the server's side (answered 503 and idle past keep-alive, or its
        # answer stalled past response_stall_seconds), though none of them closed its socket.
        deadline = time.monotonic() + 60
        while established_to(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert established_to(port) == 0
        assert "read none of its answer for 3.0 s (response_stall_seconds)" in processes.log("serve")
    finally:
        for reader in readers:
            reader.close()


@pytest.fixture
def tiny_volume(tmp_path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs root; skipped otherwise): a volume that really fills up."""
    folder = tmp_path / "volume"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_volume_answers_507_storage_full_and_readyz_says_so(tmp_path, processes, tiny_volume):
    env = service_env(tmp_path, COLLAPSE_MONITOR_DATA_DIR=str(tiny_volume), COLLAPSE_MONITOR_SCORING_PAUSED="true")
    base = start_service(processes, env)
    with httpx.Client(base_url=base, timeout=30) as client:
        assert client.post("/v1/runs", json={"name": "r"}).status_code == 201
        turns = [{"prompt": "p" * 200_000, "response": "r"}]
        statuses = []
        for step in range(1, 40):
            batch = {"step": step, "trajectories": [{"group_id": 0, "reward": 1.0, "turns": turns}]}
            statuses.append(client.post("/v1/runs/r/batches", json=batch).status_code)
            if statuses[-1] != 202:
                break
        assert statuses[-1] == 507, statuses
        ready = client.get("/readyz")
        assert (ready.status_code, ready.json()["database"][:12]) == (503, "storage full")
        assert client.get("/v1/runs/r").status_code == 200
    assert "database or disk is full" in processes.log("serve")


def filter_body(size: int) -> bytes:
    """A valid POST /v1/filter body of exactly ``size`` bytes (padded with JSON whitespace)."""
    body = b'{"rewards": [[1.0, 0.0], [1.0, 1.0]]'
    return body + b" " * (size - len(body) - 1) + b"}"


def test_a_body_being_read_holds_its_share_of_the_parsing_budget(tmp_path, processes):
    """Issue 29 row 8: bodies were read whole before the budget applied (20 x 31 MB grew the server by 1.2 GB)."""
    env = service_env(tmp_path, COLLAPSE_MONITOR_MAX_PARSING_BYTES=str(2**20), COLLAPSE_MONITOR_SCORING_PAUSED="true")
    base = start_service(processes, env)
    port = int(base.rsplit(":", 1)[1])
    size = 800_000  # two do not fit in the 1 MiB budget at once
    slow = socket.create_connection(("127.0.0.1", port))
    head = "POST /v1/filter HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {size}\r\n\r\n"
    body = filter_body(size)
    slow.sendall(head.encode() + body[:1000])  # its body is being read: it holds 800 KB of the budget
    time.sleep(0.5)
    answers: list[int] = []
    other = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{base}/v1/filter", content=filter_body(size), headers={"content-type": "application/json"},
                       timeout=60).status_code
        )
    )  # fmt: skip
    other.start()
    other.join(2)
    assert answers == []  # waiting for its turn
    slow.sendall(body[1000:])
    assert b"200 OK" in slow.recv(65536)
    other.join(30)
    assert answers == [200]
    slow.close()
