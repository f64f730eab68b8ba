"""Background loops of the service (the scoring worker, the alert dispatcher): identity, loop, thread.

Must not import fastapi.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from service.storage.database import first_line, outage

T = TypeVar("T")


def owner_id() -> str:
    """host:pid:random, the name a process's leases are held under (unique across restarts)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


# A failed round is retried after 0.5 s, then 1 s, then every 2 s: short enough to resume within
# seconds of a database coming back, long enough not to hammer it (or the log) while it is down.
FIRST_RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 2.0


def retry_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` consecutive failed rounds (1, 2, ...)."""
    return float(min(FIRST_RETRY_SECONDS * 2 ** (failures - 1), MAX_RETRY_SECONDS))


def poll(work: Callable[[], bool], stop: threading.Event, idle_seconds: float, log: logging.Logger, what: str) -> None:
    """Calls ``work`` until ``stop`` is set, waiting ``idle_seconds`` whenever it found nothing to do.

    A round that raises (a database outage, say) is retried after ``retry_delay``: the loop must
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
            stop.wait(retry_delay(failures))
            continue
        if failures:
            log.info("%s: working again after %d failed rounds", what, failures)
            failures = 0
        if not busy:
            stop.wait(idle_seconds)


def retry_through_outage(write: Callable[[], T], until: float, log: logging.Logger, what: str) -> T:
    """``write()``, tried again after ``retry_delay`` while it fails with a database outage, until ``until``.

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
            if reason is None or time.monotonic() + retry_delay(failures) > until:
                raise
            log.warning("%s: database %s (try %d): %s", what, reason, failures, first_line(e))
            time.sleep(retry_delay(failures))


def start_in_thread(loop: Callable[[threading.Event], None], name: str) -> tuple[threading.Thread, threading.Event]:
    """Runs ``loop(stop)`` in a daemon thread; set the returned event to stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=loop, args=(stop,), name=name, daemon=True)
    thread.start()
    return thread, stop
