"""A throwaway PostgreSQL cluster for fault tests: stopped, restarted and frozen at will.

initdb + pg_ctl (PostgreSQL 15) in a temporary folder, on a free loopback port, trust auth;
always stopped and removed on exit, thawed first if frozen. Run as root, the server runs as the
``postgres`` user (initdb refuses root). Used by tests/e2e/test_database_outage_e2e.py and
bench/outage.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from bench.serving import free_port

PG_BIN = Path(os.environ.get("COLLAPSE_MONITOR_PG_BIN", "/usr/lib/postgresql/15/bin"))


class ThrowawayPostgres:
    def __init__(self) -> None:
        if not (PG_BIN / "initdb").exists():
            raise FileNotFoundError(f"{PG_BIN / 'initdb'} is missing (set COLLAPSE_MONITOR_PG_BIN)")
        self.root = Path(tempfile.mkdtemp(prefix="cm-outage-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.frozen: list[int] = []
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def __enter__(self) -> ThrowawayPostgres:
        try:
            if self._as_postgres:
                self.root.chmod(0o755)
                shutil.chown(self.root, "postgres", "postgres")
            self._pg("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        """Starts the server and returns once it accepts connections."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
            "-c fsync=off -c full_page_writes=off -c max_connections=100"
        )
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options, "-w", "start")

    def stop(self) -> None:
        """Stops the server as a restart would (fast: open connections are terminated)."""
        self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def freeze(self) -> None:
        """SIGSTOP to the postmaster and every backend: a hung server, which refuses nothing."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGSTOP)  # first, so that it forks no backend we would miss
        self.frozen = [postmaster, *self._children(postmaster)]
        for pid in self.frozen[1:]:
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.frozen = []

    def close(self) -> None:
        self.thaw()
        if (self.data / "postmaster.pid").exists():
            subprocess.run(
                [*self._as_postgres, str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                capture_output=True,
                timeout=60,
                check=False,
            )
        shutil.rmtree(self.root, ignore_errors=True)

    def _pg(self, binary: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as_postgres, str(PG_BIN / binary), *args], capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{binary} {' '.join(args)} failed ({done.returncode}): {done.stderr or done.stdout}")

    @staticmethod
    def _children(parent: int) -> list[int]:
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:  # the field after the state is the parent's pid
                out.append(int(stat.parent.name))
        return out
