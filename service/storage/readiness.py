"""Readiness of the database for ``/readyz``: answers within a second even when the database hangs.

A check runs in a thread of its own, one at a time: a probe that arrives while the previous check
still waits on a hung database reports how long it has waited instead of starting another, so
frequent probes never pile up threads or connections. Must not import fastapi.
"""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from service.storage.database import STORAGE_FULL, head_revision, outage
from service.storage.scorer_outages import scorers_down
from service.storage.times import iso_time

STORAGE_FULL_SECONDS = 60.0  # /readyz reports a full disk this long after the last write it refused


class DatabaseProbe:
    """``check()`` is ``"ok"`` or why the database is not ready (unreachable, timed out, migrations pending)."""

    def __init__(self, engine: Engine, url: str, wait_seconds: float = 0.7) -> None:
        self.engine = engine
        self.head = head_revision(url)
        self.wait_seconds = wait_seconds
        self._check: asyncio.Future[str] | None = None
        self._started = 0.0
        self._storage_full_at: float | None = None
        # The scorers a worker found down, as the last check that reached a migrated database read them.
        self.scorers_down: dict[str, dict[str, str]] = {}

    def note_storage_full(self) -> None:
        """A write was just refused for want of disk space (reads, and so the probe's own, still work)."""
        self._storage_full_at = time.monotonic()

    async def check(self) -> str:
        if self._storage_full_at is not None:
            since = time.monotonic() - self._storage_full_at
            if since < STORAGE_FULL_SECONDS:
                return f"{STORAGE_FULL} (a write was refused {since:.0f} s ago)"
            self._storage_full_at = None
        if self._check is None or self._check.done():
            self._check = asyncio.ensure_future(asyncio.to_thread(self._read))
            self._started = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(self._check), self.wait_seconds)
        except TimeoutError:
            return f"timed out: no answer for {time.monotonic() - self._started:.1f} s"

    def _read(self) -> str:
        try:
            with self.engine.connect() as connection:
                current = None
                if inspect(connection).has_table("alembic_version"):
                    current = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
                if current == self.head:
                    down = scorers_down(connection)
                    self.scorers_down = {n: {"since": iso_time(at) or "", "error": e} for n, (at, e) in down.items()}
        except SQLAlchemyError as e:
            return outage(e) or f"failed: {type(e).__name__}"
        if current != self.head:
            at = current or "no schema"
            return f"migrations pending: the database is at {at}, code needs {self.head} (collapse-monitor migrate)"
        return "ok"
