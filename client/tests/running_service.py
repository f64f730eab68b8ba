"""A real ``collapse-monitor serve`` process for the client tests: tiny-random scorer, SQLite.

It can be killed and started again on the same port and database, as an outage looks to a
trainer. What arrived is read from the service's own SQLite database.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
from pathlib import Path

from bench.serving import free_port, service_env, start_serve, wait_ready, wait_until


class RunningService:
    def __init__(self, folder: Path, **settings: str) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database = folder / "monitor.db"
        self.env = service_env(
            {
                "database_url": f"sqlite:///{self.database}",
                "data_dir": str(folder / "data"),
                "cache_dir": str(folder / "cache"),
                "default_scorer": "tiny-random",
                "worker_poll_seconds": "0.1",
            }
            | settings
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 600.0) -> None:  # generous: a loaded 2-core machine took over 180 s
        self.starts += 1
        with open(self.folder / f"serve-{self.starts}.log", "wb") as log:
            _, self.process = start_serve(self.env, port=self.port, log=log)
        try:
            wait_ready(self.url, timeout, self.process)
        except AssertionError as e:
            raise AssertionError(f"{e}: {self.log()}") from None

    def kill(self) -> None:
        """SIGKILL: the service vanishes mid-whatever, as a crashed or preempted host does."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return "".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.folder.glob("serve-*.log")))

    def _rows(self, sql: str, run: str) -> list:
        """The rows of ``sql`` (one ``?``: the run's name) on the service's database."""
        with sqlite3.connect(self.database) as db:
            return list(db.execute(sql, (run,)))

    def batches(self, run: str) -> list[tuple[int, str]]:
        """(step, client batch id) of every batch the run holds, in the order they were stored."""
        return self._rows(
            "SELECT b.step, b.client_batch_id FROM batches b JOIN runs r ON r.id = b.run_id "
            "WHERE r.name = ? ORDER BY b.rowid",
            run,
        )

    def payloads(self, run: str) -> list[dict]:
        """The request bodies of the run's batches as stored, in stored order."""
        sql = "SELECT b.payload FROM batches b JOIN runs r ON r.id = b.run_id WHERE r.name = ? ORDER BY b.rowid"
        return [json.loads(payload) for (payload,) in self._rows(sql, run)]

    def wait_until_processed(self, run: str, n_batches: int, timeout: float = 120.0) -> None:
        """Waits until the worker has finished (done or failed) ``n_batches`` batches of ``run``."""
        sql = (
            "SELECT COUNT(*) FROM batches b JOIN runs r ON r.id = b.run_id "
            "WHERE r.name = ? AND b.status IN ('done', 'failed')"
        )
        wait_until(lambda: self._rows(sql, run)[0][0] >= n_batches, timeout, f"{n_batches} batches of {run} processed")

    def checkpoint_of_batches(self, run: str) -> list[tuple[int, str | None]]:
        """(step, path of the checkpoint the batch will be scored with) in stored order."""
        return self._rows(
            "SELECT b.step, c.path FROM batches b JOIN runs r ON r.id = b.run_id "
            "LEFT JOIN checkpoints c ON c.id = b.checkpoint_id WHERE r.name = ? ORDER BY b.rowid",
            run,
        )

    def checkpoints(self, run: str) -> list[tuple[str, str, int | None]]:
        return self._rows(
            "SELECT c.path, c.kind, c.step FROM checkpoints c JOIN runs r ON r.id = c.run_id "
            "WHERE r.name = ? ORDER BY c.id",
            run,
        )
