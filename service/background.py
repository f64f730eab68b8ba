"""Background loops of the service (the scoring worker, the alert dispatcher): identity, loop, thread.

Must not import fastapi.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable


def owner_id() -> str:
    """host:pid:random, the name a process's leases are held under (unique across restarts)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def poll(work: Callable[[], bool], stop: threading.Event, idle_seconds: float, log: logging.Logger, what: str) -> None:
    """Calls ``work`` until ``stop`` is set, waiting ``idle_seconds`` whenever it found nothing to do.

    An exception (a broken database connection, say) is logged and counts as idle: the loop must
    outlive it, since the next round may well succeed.
    """
    while not stop.is_set():
        try:
            busy = work()
        except Exception:
            log.exception("%s: a round failed", what)
            busy = False
        if not busy:
            stop.wait(idle_seconds)


def start_in_thread(loop: Callable[[threading.Event], None], name: str) -> tuple[threading.Thread, threading.Event]:
    """Runs ``loop(stop)`` in a daemon thread; set the returned event to stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=loop, args=(stop,), name=name, daemon=True)
    thread.start()
    return thread, stop
