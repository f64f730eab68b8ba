"""The one harness for real ``collapse-monitor serve`` processes, shared by bench/, tests/ and client/tests.

A free loopback port, waiting until something holds (``/readyz`` above all, an alert in Alertmanager), the service's
environment, a throwaway database, the server's peak memory from /proc, percentiles. Benchmarks
import it as ``serving`` (``python bench/x.py`` puts bench/ first on the path), the tests as
``bench.serving``.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np
from sqlalchemy import create_engine, text

BIN = Path(sys.executable).parent
PG_ADMIN_URL = os.environ.get("COLLAPSE_MONITOR_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Polls ``check`` every 0.1 s (an ``httpx.HTTPError`` counts as not yet) until it holds.

    Raises ``AssertionError`` after ``timeout`` seconds, or as soon as ``process`` has exited.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process exited with {process.returncode} while waiting for {what}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def alertmanager_alerts(url: str, timeout: float, **params: str) -> list[dict[str, Any]]:
    """The alerts the Alertmanager at ``url`` holds (``params``: its query, e.g. ``filter``), once it holds any."""
    received: list[dict[str, Any]] = []

    def arrived() -> bool:
        received[:] = httpx.get(f"{url}/api/v2/alerts", params=params).json()
        return bool(received)

    wait_until(arrived, timeout, "the alert to reach Alertmanager")
    return received


def wait_ready(base: str, timeout: float, process: subprocess.Popen[bytes] | None = None) -> None:
    """Waits until ``GET {base}/readyz`` answers 200 (the database reached, the migrations applied)."""
    wait_until(lambda: httpx.get(f"{base}/readyz", timeout=2).status_code == 200, timeout, f"{base}/readyz", process)


def service_env(settings: Mapping[str, str], **environ: str) -> dict[str, str]:
    """This process's environment less its ``COLLAPSE_MONITOR_*`` variables, plus ``settings``.

    ``settings`` are named without the prefix, in either case (``{"database_url": ...}``), so a
    test or benchmark runs what it says whatever the caller's shell holds; ``environ`` are further
    variables as named (``PYTHONPATH=...``).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAPSE_MONITOR_")}
    env |= {f"COLLAPSE_MONITOR_{name.upper()}": value for name, value in settings.items()}
    return env | environ


def start_serve(
    env: Mapping[str, str], *flags: str, port: int | None = None, log: IO[bytes] | int = subprocess.DEVNULL
) -> tuple[str, subprocess.Popen[bytes]]:
    """Starts ``collapse-monitor serve`` on ``port`` (default: a free one); its base URL and process, not yet ready."""
    port = free_port() if port is None else port
    args = [str(BIN / "collapse-monitor"), "serve", "--port", str(port), *flags]
    process = subprocess.Popen(args, env=dict(env), stdout=log, stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}", process


def issue_token(env: Mapping[str, str], *flags: str) -> str:
    """Issues an API token with ``collapse-monitor tokens create *flags`` on ``env``'s database; the token."""
    args = [str(BIN / "collapse-monitor"), "tokens", "create", *flags]
    created = subprocess.run(args, env=dict(env), capture_output=True, text=True, timeout=120, check=True)
    token: str = json.loads(created.stdout)["token"]
    return token


@contextmanager
def served(settings: dict[str, str], ready_seconds: float = 180) -> Iterator[str]:
    """Runs ``collapse-monitor serve`` on a free loopback port and yields its base URL once ready.

    ``settings`` as ``service_env`` takes them (``{"DATABASE_URL": ...}``).
    """
    with served_process(settings, ready_seconds) as (base, _):
        yield base


@contextmanager
def served_process(
    settings: dict[str, str], ready_seconds: float = 180, **environ: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``served``, also yielding the server's process (its pid, for ``Memory``); ``environ`` as ``service_env``'s."""
    base, process = start_serve(service_env(settings, **environ))
    try:
        wait_ready(base, ready_seconds, process)
        yield base, process
    finally:
        process.terminate()
        process.wait()


@contextmanager
def worker_process(settings: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """Runs one ``collapse-monitor worker`` on ``settings``' (Postgres) database beside a server; stopped
    with SIGTERM (it finishes or hands back what it holds) at the end."""
    args = [str(BIN / "collapse-monitor"), "worker"]
    with subprocess.Popen(
        args, env=service_env(settings), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    ) as process:
        try:
            yield process
        finally:
            process.terminate()  # leaving the with block waits for it


def postgres_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def create_postgres_database(prefix: str, template: str | None = None) -> str:
    """Creates an empty Postgres database (or a copy of ``template``) named ``{prefix}<random>``; its name."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))
    finally:
        admin.dispose()
    return name


def drop_postgres_database(name: str) -> None:
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@contextmanager
def database(backend: str, folder: Path | str) -> Iterator[str]:
    """The URL of an empty database: SQLite under ``folder``, or a Postgres database dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{Path(folder) / 'bench.db'}"
        return
    name = create_postgres_database("cm_bench_")
    try:
        yield postgres_url(name)
    finally:
        drop_postgres_database(name)


class Memory:
    """A process's resident memory and its high-water mark since the last reset (Linux /proc), in bytes."""

    def __init__(self, pid: int) -> None:
        self.proc = Path(f"/proc/{pid}")

    def _bytes(self, field: str) -> int:
        for line in (self.proc / "status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} missing from {self.proc}/status")

    def rss(self) -> int:
        return self._bytes("VmRSS")

    def reset(self) -> int:
        """Resets the high-water mark to the current RSS, and returns that."""
        (self.proc / "clear_refs").write_text("5")
        return self.rss()

    def peak(self) -> int:
        return self._bytes("VmHWM")


def percentiles(seconds: Sequence[float], digits: int = 2) -> dict[str, float]:
    """p50, p99 and max of durations given in seconds, in milliseconds."""
    ms = np.asarray(seconds) * 1000
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), digits),
        "p99_ms": round(float(np.percentile(ms, 99)), digits),
        "max_ms": round(float(ms.max()), digits),
    }


def post_at_once(url: str, bodies: Sequence[bytes], timeout: float) -> list[int]:
    """Posts each of ``bodies`` (JSON) to ``url`` from a thread of its own, all at once; the statuses.

    As a client does, a 503 ``parsing_busy`` (the others hold the parse budget past its wait) is
    retried after its Retry-After; any other answer is the one counted.
    """
    statuses: list[int] = []

    def send(body: bytes) -> None:
        while True:
            answer = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=timeout)
            if answer.status_code != 503 or answer.json().get("error") != "parsing_busy":
                statuses.append(answer.status_code)
                return
            time.sleep(float(answer.headers.get("retry-after", "1")))

    senders = [threading.Thread(target=send, args=(body,)) for body in bodies]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    return statuses


def token_ids_body(step: int, seed: int) -> bytes:
    """~27 MB of token ids: 64 one-turn trajectories of 8,192 prompt and 65,536 reasoning ids each.

    The large body of ``bench/abuse.py --vectors token_ids`` and of tests/e2e/test_request_path_e2e.py.
    """
    rng = random.Random(seed)
    trajectories = [
        {
            "group_id": g,
            "reward": 1.0,
            "turns": [
                {
                    "prompt_token_ids": [rng.randrange(50_000) for _ in range(8192)],
                    "reasoning_token_ids": [rng.randrange(50_000) for _ in range(65_536)],
                }
            ],
        }
        for g in range(64)
    ]
    return json.dumps({"step": step, "trajectories": trajectories}, separators=(",", ":")).encode()
