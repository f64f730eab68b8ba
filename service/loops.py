"""Background loops of the service (the scoring worker, the alert dispatcher): identity, loop, thread.

Must not import fastapi.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from service.storage.database import first_line, outage

T = TypeVar("T")
MAX_WORKER_SLOTS = 1024


def owner_id() -> str:
    """host:pid:random, the name a process's leases are held under (unique across restarts)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Backoff:
    """Seconds to wait after ``failures`` consecutive failures (1, 2, ...): doubling from ``first_seconds``
    up to ``max_seconds``, then lengthened by up to ``jitter`` of itself at random, so that processes that
    failed together (N workers losing one database) do not all retry at the same instant."""

    first_seconds: float
    max_seconds: float
    jitter: float = 0.0

    def delay(self, failures: int, uniform: Callable[[], float] = random.random) -> float:
        """``uniform`` draws from [0, 1): a test passes its own to see both ends of the jitter."""
        base = min(self.first_seconds * 2 ** (failures - 1), self.max_seconds)
        return float(base * (1 + self.jitter * uniform()))


# A failed round is retried after 0.5 s, then 1 s, then every 2 s (each up to a quarter longer):
# short enough to resume within seconds of a database coming back, long enough not to hammer it
# (or the log) while it is down.
ROUND_BACKOFF = Backoff(first_seconds=0.5, max_seconds=2.0, jitter=0.25)


def worker_identity(data_dir: Path, configured: str) -> tuple[str, int | None]:
    """A worker's name, stable across restarts, and the descriptor of the lock that makes it its own.

    ``configured`` (the ``worker_name`` setting) is taken as is. Otherwise the name is host:N, N
    the lowest slot of this host whose lock file under ``<data_dir>/worker-slots`` no living
    process holds: flock locks die with their process (SIGKILL included), so a restarted worker
    takes the name of one that died and can re-claim its batches at once, while two living
    workers sharing the data folder never share a name. Without a writable data folder the name
    is unique per process (host:pid), and a crashed worker's batch waits out its lease.
    """
    if configured:
        return configured, None
    host = socket.gethostname()
    folder = data_dir / "worker-slots"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for slot in range(MAX_WORKER_SLOTS):
            fd = os.open(folder / f"{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return f"{host}:{slot}", fd
    except OSError as e:
        logging.getLogger("collapse_monitor.worker").warning("no worker slot under %s (%s): named by pid", folder, e)
    return f"{host}:pid{os.getpid()}", None


def lease_owner(name: str) -> str:
    """The owner a worker's leases are held under: its stable name, then # and this process's nonce.

    Leases are renewed and finished only under the exact owner, so even two processes given
    the same name never both finish one batch; the name alone finds a dead predecessor's leases.
    """
    return f"{name}#{uuid.uuid4().hex[:8]}"


def poll(work: Callable[[], bool], stop: threading.Event, idle_seconds: float, log: logging.Logger, what: str) -> None:
    """Calls ``work`` until ``stop`` is set, waiting ``idle_seconds`` whenever it found nothing to do.

    A round that raises (a database outage, say) is retried after ``ROUND_BACKOFF``: the loop must
    outlive the failure, since a later round may well succeed. An outage is logged in one line
    per round, anything else with its traceback.
    """
    failures = 0
    while not stop.is_set():
        try:
            busy = work()
        except Exception as e:
            failures += 1
            reason = outage(e)
            if reason is None:
                log.exception("%s: a round failed", what)
            else:
                log.warning("%s: database %s (failed round %d): %s", what, reason, failures, first_line(e))
            stop.wait(ROUND_BACKOFF.delay(failures))
            continue
        if failures:
            log.info("%s: working again after %d failed rounds", what, failures)
            failures = 0
        if not busy:
            stop.wait(idle_seconds)


def retry_through_outage(write: Callable[[], T], until: float, log: logging.Logger, what: str) -> T:
    """``write()``, tried again after ``ROUND_BACKOFF`` while it fails with a database outage, until ``until``.

    ``until`` is a ``time.monotonic()`` instant (the end of a lease, say); past it the last error
    is raised. Any other error is raised at once.
    """
    failures = 0
    while True:
        try:
            return write()
        except Exception as e:
            failures += 1
            reason = outage(e)
            delay = ROUND_BACKOFF.delay(failures)
            if reason is None or time.monotonic() + delay > until:
                raise
            log.warning("%s: database %s (try %d): %s", what, reason, failures, first_line(e))
            time.sleep(delay)


def start_in_thread(loop: Callable[[threading.Event], None], name: str) -> tuple[threading.Thread, threading.Event]:
    """Runs ``loop(stop)`` in a daemon thread; set the returned event to stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=loop, args=(stop,), name=name, daemon=True)
    thread.start()
    return thread, stop
