"""The pieces every benchmark shares: a throwaway database, a ``collapse-monitor serve`` process, percentiles."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, text

BIN = Path(sys.executable).parent
PG_ADMIN = os.environ.get("COLLAPSE_MONITOR_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@contextmanager
def database(backend: str, folder: Path | str) -> Iterator[str]:
    """The URL of an empty database: SQLite under ``folder``, or a Postgres database dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{Path(folder) / 'bench.db'}"
        return
    name = f"cm_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(settings: dict[str, str], ready_seconds: float = 180) -> Iterator[str]:
    """Runs ``collapse-monitor serve`` on a free loopback port and yields its base URL once ready.

    ``settings`` are ``COLLAPSE_MONITOR_*`` variables without the prefix (``{"DATABASE_URL": ...}``);
    the caller's own ``COLLAPSE_MONITOR_*`` variables are dropped, so a benchmark measures what it says.
    """
    with served_process(settings, ready_seconds) as (base, _):
        yield base


@contextmanager
def served_process(
    settings: dict[str, str], ready_seconds: float = 180
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``served``, also yielding the server's process (its pid, for /proc/<pid>/status)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAPSE_MONITOR_")}
    env |= {f"COLLAPSE_MONITOR_{name}": value for name, value in settings.items()}
    process = subprocess.Popen(
        [str(BIN / "collapse-monitor"), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_seconds
        while not _ready(base):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"collapse-monitor serve did not become ready (exit code {process.poll()})")
            time.sleep(0.1)
        yield base, process
    finally:
        process.terminate()
        process.wait()


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def percentiles(seconds: Sequence[float], digits: int = 2) -> dict[str, float]:
    """p50, p99 and max of durations given in seconds, in milliseconds."""
    ms = np.asarray(seconds) * 1000
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), digits),
        "p99_ms": round(float(np.percentile(ms, 99)), digits),
        "max_ms": round(float(ms.max()), digits),
    }
