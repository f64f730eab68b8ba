"""The spool: requests waiting on disk while the service is unreachable, one file per request.

Each file is the request body exactly as it will be sent, written atomically (temporary file,
fsync, rename, fsync of the folder), so a crash leaves either the whole request or nothing. Files
are named ``{sequence}-{kind}-{step}.json`` and replayed in sequence order, which is the order the
trainer logged them; the sequence continues across restarts. Requests the service refused are
moved to ``rejected/`` next to a ``.error.json`` that says why (of a body refused for its size, only
the reason is kept). Must not import httpx or threads
beyond its own lock.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^(\d{12})-(batch|checkpoint|figures)-(none|\d+)\.json$")


@dataclass(frozen=True)
class Entry:
    """One spooled request."""

    sequence: int
    kind: str
    step: int | None
    path: Path
    size: int


class Spool:
    """A folder of pending requests, oldest first; safe to use from several threads."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.rejected_folder = folder / "rejected"
        self._lock = threading.Lock()
        self._pending: list[Entry] = []
        self._next_sequence = 0
        self._bytes = 0
        self._is_open = False

    def open(self) -> None:
        """Creates the folder, clears half-written files and lists what an earlier process left."""
        with self._lock:
            if self._is_open:
                return
            self.folder.mkdir(parents=True, exist_ok=True)
            pending = []
            for path in self.folder.iterdir():
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)  # a write that never reached its rename
                    continue
                match = _NAME.match(path.name)
                if match:
                    step = None if match[3] == "none" else int(match[3])
                    pending.append(Entry(int(match[1]), match[2], step, path, path.stat().st_size))
            rejected = [int(m[1]) for p in _list(self.rejected_folder) if (m := _NAME.match(p.name))]
            self._pending = sorted(pending, key=lambda e: e.sequence)
            self._bytes = sum(e.size for e in self._pending)
            self._next_sequence = max([e.sequence for e in self._pending] + rejected, default=-1) + 1
            self._is_open = True

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def head(self) -> Entry | None:
        with self._lock:
            return self._pending[0] if self._pending else None

    def put(self, kind: str, step: int | None, body: bytes) -> Entry:
        """Writes one request durably after every request written before it."""
        with self._lock:
            sequence = self._next_sequence
            self._next_sequence += 1
            name = f"{sequence:012d}-{kind}-{'none' if step is None else step}.json"
            path = self.folder / name
            _write_atomically(path, body)
            entry = Entry(sequence, kind, step, path, len(body))
            self._pending.append(entry)
            self._bytes += entry.size
            return entry

    def replace(self, entry: Entry, body: bytes) -> Entry:
        """Writes ``body`` in place of a pending request's (atomically, keeping its place); returns its new entry."""
        _write_atomically(entry.path, body)
        new = Entry(entry.sequence, entry.kind, entry.step, entry.path, len(body))
        with self._lock:
            if entry in self._pending:
                self._pending[self._pending.index(entry)] = new
                self._bytes += new.size - entry.size
        return new

    def read(self, entry: Entry) -> bytes:
        return entry.path.read_bytes()

    def remove(self, entry: Entry) -> None:
        with self._lock:
            self._forget(entry)
        entry.path.unlink(missing_ok=True)

    def reject(self, entry: Entry, reason: dict[str, Any], keep_body: bool = True) -> Path:
        """Moves a refused request to ``rejected/`` with the reason beside it (``keep_body``: else removes
        it); returns the path of what was kept."""
        self.rejected_folder.mkdir(exist_ok=True)
        target = self.rejected_folder / entry.path.name
        _write_atomically(target.with_suffix(".error.json"), json.dumps(reason, indent=1).encode())
        with self._lock:
            self._forget(entry)
        if not keep_body:
            entry.path.unlink(missing_ok=True)
            return target.with_suffix(".error.json")
        if entry.path.exists():
            os.replace(entry.path, target)
        return target

    def reject_body(self, kind: str, step: int | None, body: bytes | None, reason: dict[str, Any]) -> Path:
        """Keeps a refused request that never reached the spool, under the next sequence number (``body``
        None: only its reason); returns the path of what was kept."""
        with self._lock:
            sequence = self._next_sequence
            self._next_sequence += 1
        self.rejected_folder.mkdir(parents=True, exist_ok=True)
        target = self.rejected_folder / f"{sequence:012d}-{kind}-{'none' if step is None else step}.json"
        _write_atomically(target.with_suffix(".error.json"), json.dumps(reason, indent=1).encode())
        if body is None:
            return target.with_suffix(".error.json")
        _write_atomically(target, body)
        return target

    def _forget(self, entry: Entry) -> None:
        if entry in self._pending:
            self._pending.remove(entry)
            self._bytes -= entry.size


def _list(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.is_dir() else []


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if os.name == "posix":  # the rename itself is durable only once the folder is synced
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
