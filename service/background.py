"""Background loops of the service (the scoring worker, the alert dispatcher): identity, loop, thread.

Must not import fastapi.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

MAX_WORKER_SLOTS = 1024


def owner_id() -> str:
    """host:pid:random, the name a process's leases are held under (unique across restarts)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


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
