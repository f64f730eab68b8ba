"""Following a rollout-dump folder: each new step file is sent once, and a restart resumes.

A file is read once it is complete: when a later step's file was written after it (trainers write
steps in order), or when it has not changed for ``settle_seconds`` and ends with a newline. After its
batches are handed to a durable monitor (written to the spool before ``log()`` returns), the
file's size and modification time go to the state file, written atomically; a file that changes
afterwards (a trainer resumed from a checkpoint rewrites the step) is sent again, as new content
under the same step. Must not import httpx.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from collapse_monitor.dumps import DumpError, batches_of, read_jsonl
from collapse_monitor.monitor import Monitor

logger = logging.getLogger("collapse_monitor")

STATE_VERSION = 1


def default_state_path(folder: Path, run: str) -> Path:
    return folder / f".collapse-monitor-{run}.state.json"


class Follower:
    """Sends the step files of ``folder`` through ``monitor``, remembering what was sent in ``state_path``."""

    def __init__(self, folder: Path, monitor: Monitor, state_path: Path, settle_seconds: float = 5.0) -> None:
        self.folder = folder
        self.monitor = monitor
        self.state_path = state_path
        self.settle_seconds = settle_seconds
        self.done: dict[str, dict[str, Any]] = self._load_state()

    def _load_state(self) -> dict[str, dict[str, Any]]:
        if not self.state_path.exists():
            return {}
        state = json.loads(self.state_path.read_text())
        if state.get("version") != STATE_VERSION or state.get("run") != self.monitor.run:
            raise ValueError(
                f"{self.state_path} belongs to run {state.get('run')!r} (version {state.get('version')}), "
                f"not {self.monitor.run!r}; pass another --state file"
            )
        files: dict[str, dict[str, Any]] = state["files"]
        return files

    def _save_state(self) -> None:
        state = {"version": STATE_VERSION, "run": self.monitor.run, "files": self.done}
        tmp = self.state_path.with_name(f".{self.state_path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_path)

    def pending(self, now: float | None = None) -> list[Path]:
        """Complete files not sent yet (or changed since), in step order."""
        now = time.time() if now is None else now
        files = sorted(self.folder.glob("*.jsonl"), key=_order)
        ready = []
        stats = [path.stat() for path in files]
        for position, (path, stat) in enumerate(zip(files, stats)):
            record = self.done.get(path.name)
            if record is not None and (record["size"], record["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns):
                continue
            # A later step written after this file means the trainer has moved on; an older later
            # file is left from before a resume and proves nothing.
            moved_on = any(later.st_mtime_ns >= stat.st_mtime_ns for later in stats[position + 1 :])
            settled = now - stat.st_mtime >= self.settle_seconds and _ends_with_newline(path)
            if not (moved_on or settled):
                break  # still being written; the files after it wait too, to keep step order
            ready.append(path)
        return ready

    def send(self, path: Path) -> list[int]:
        """Logs the batches of one file; returns their steps. Malformed files are reported and skipped."""
        stat = path.stat()
        stem_step = int(path.stem) if path.stem.isdigit() else None
        try:
            batches = batches_of(read_jsonl(path), str(path), step=stem_step)
        except DumpError as e:
            logger.error("collapse-monitor: skipped %s: %s", path, e)
            self.done[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "error": str(e)}
            self._save_state()
            return []
        for step, trajectories in batches.items():
            self.monitor.log(step, trajectories)
        self.done[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "steps": list(batches)}
        self._save_state()
        return list(batches)

    def follow(self, poll_seconds: float = 2.0, once: bool = False, stop: threading.Event | None = None) -> list[int]:
        """Sends complete files as they appear until ``stop`` is set (or, with ``once``, what is ready now)."""
        stop = stop or threading.Event()
        sent: list[int] = []
        while not stop.is_set():
            for path in self.pending():
                steps = self.send(path)
                sent.extend(steps)
                logger.info("collapse-monitor: %s -> steps %s", path.name, steps)
            if once:
                break
            stop.wait(poll_seconds)
        return sent


def _order(path: Path) -> tuple[int, float, str]:
    # verl names files {global_step}.jsonl; other names follow in order of modification.
    if path.stem.isdigit():
        return (0, float(path.stem), path.name)
    return (1, path.stat().st_mtime, path.name)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
