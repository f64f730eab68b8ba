"""Payload retention: stored payloads (batch bodies, cross-scoring matrices) of finished batches older
than ``payload_retention_days`` are purged; metric points, results and alerts stay.

The server runs ``Purger`` in a background thread; ``collapse-monitor purge`` runs ``purge`` once.
Must not import fastapi.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from service.loops import poll
from service.storage import deletion
from service.storage.tables import utcnow

log = logging.getLogger("collapse_monitor.retention")

CHUNK = 500  # batches per transaction: short transactions, however much is due
INTERVAL_SECONDS = 600.0  # between rounds once nothing is due


@dataclass(frozen=True)
class Purged:
    batches: int
    matrices: int
    before: datetime


def purge_chunk(sessions: sessionmaker[Session], older_than_days: float, now: datetime | None = None) -> Purged:
    """Purges up to ``CHUNK`` batches created more than ``older_than_days`` before ``now``, in one transaction."""
    before = (now or utcnow()) - timedelta(days=older_than_days)
    with sessions.begin() as session:
        batches, matrices = deletion.purge_payloads(session, before, CHUNK)
    return Purged(batches, matrices, before)


def purge(sessions: sessionmaker[Session], older_than_days: float) -> Purged:
    """Purges everything due now, a chunk at a time."""
    now = utcnow()
    batches = matrices = 0
    while True:
        chunk = purge_chunk(sessions, older_than_days, now)
        batches, matrices = batches + chunk.batches, matrices + chunk.matrices
        if chunk.batches < CHUNK:
            return Purged(batches, matrices, chunk.before)


class Purger:
    """The server's retention loop: a round at start, then every ``INTERVAL_SECONDS``."""

    def __init__(self, sessions: sessionmaker[Session], older_than_days: float) -> None:
        self.sessions = sessions
        self.older_than_days = older_than_days

    def run(self, stop: threading.Event) -> None:
        poll(self.run_once, stop, INTERVAL_SECONDS, log, "payload retention")

    def run_once(self) -> bool:
        """One chunk; True when it was full (more may be due at once)."""
        purged = purge_chunk(self.sessions, self.older_than_days)
        if purged.batches:
            log.info(
                "purged the payloads of %d batches (%d matrices) created before %s",
                purged.batches,
                purged.matrices,
                purged.before.isoformat(),
            )
        return purged.batches == CHUNK
