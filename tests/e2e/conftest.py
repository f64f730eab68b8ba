"""Real processes on loopback: the service under uvicorn, workers, Prometheus, Alertmanager."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bench import serving
from bench.serving import BIN, free_port
from tests.e2e.browser import chromium_missing, launched

if TYPE_CHECKING:
    from playwright.sync_api import Browser


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
    """The service's environment for a test: its folders under ``tmp_path``, the tiny-random scorer.

    ``extra`` are further variables named in full (``COLLAPSE_MONITOR_LEASE_SECONDS="2"``).
    """
    settings = {
        "DATA_DIR": str(tmp_path / "data"),
        "DATABASE_URL": database_url,
        "DEFAULT_SCORER": "tiny-random",
        "CACHE_DIR": str(tmp_path / "cache"),
        "WORKER_POLL_SECONDS": "0.05",
    }
    return serving.service_env(settings, **extra)


def start_service(processes: Processes, env: dict[str, str], *flags: str) -> str:
    """Starts ``collapse-monitor serve`` on a free port (log: ``serve.log``); its base URL once ready."""
    port = free_port()
    process = processes.start("serve", [str(BIN / "collapse-monitor"), "serve", "--port", str(port), *flags], env)
    base = f"http://127.0.0.1:{port}"
    serving.wait_ready(base, 120, process)
    return base


def start_prometheus(processes: Processes, folder: Path, scrape_configs: str) -> str:
    """Starts Prometheus (log: ``prometheus.log``) scraping every second; the URL of its query API.

    ``scrape_configs``: the YAML under that key, its entries indented by two spaces.
    """
    prometheus = need("prometheus")
    config = folder / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs:\n" + scrape_configs)
    port = free_port()
    processes.start(
        "prometheus",
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
    )
    return f"http://127.0.0.1:{port}/api/v1/query"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's headless Chromium for a module's page tests; skipped where it is missing, failed under CI=true."""
    missing = chromium_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)
    with launched() as b:
        yield b
