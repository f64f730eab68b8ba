"""Real processes on loopback: the service under uvicorn, workers, Prometheus, Alertmanager."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        message = f"{binary} is not installed (scripts/setup installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


class Processes:
    """Starts processes and guarantees they are stopped (SIGKILL as a last resort) after the test."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.running.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def processes(tmp_path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


def service_env(tmp_path: Path, database_url: str = "", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAPSE_MONITOR_")}
    env.update(
        {
            "COLLAPSE_MONITOR_DATA_DIR": str(tmp_path / "data"),
            "COLLAPSE_MONITOR_DATABASE_URL": database_url,
            "COLLAPSE_MONITOR_DEFAULT_SCORER": "tiny-random",
            "COLLAPSE_MONITOR_CACHE_DIR": str(tmp_path / "cache"),
            "COLLAPSE_MONITOR_WORKER_POLL_SECONDS": "0.05",
        }
    )
    env.update(extra)
    return env


def start_service(processes: Processes, env: dict[str, str], *flags: str) -> str:
    port = free_port()
    processes.start("serve", [str(BIN / "collapse-monitor"), "serve", "--port", str(port), *flags], env)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{base}/readyz").status_code == 200, 120, f"the service at {base}")
    return base
