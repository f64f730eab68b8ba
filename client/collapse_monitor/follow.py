"""Following a rollout-dump folder: each new step file is sent once, and a restart resumes.

Two kinds of step files: verl's JSONL dumps (``DIR/{step}.jsonl``, ``dumps.py``) and TRL's
completion files (``completions_{step:05d}.parquet`` in ``DIR`` or ``DIR/completions``, so ``DIR``
may be the trainer's ``output_dir``; ``completion_files.py``). The folder may not exist yet: it is
looked at again at every poll.

A file is read once it is complete: when a later step's file was written after it (trainers write
steps in order); a JSONL file also when it has not changed for ``settle_seconds`` and ends with a
newline, a parquet file once it ends with its footer (written last). After its batches are handed
to a durable monitor (written to the spool before ``log()`` returns), the file's size and
modification time go to the state file, written atomically; a file that changes afterwards (a
trainer resumed from a checkpoint rewrites the step) is sent again, as new content under the same
step. TRL writes the latest generation at every logging step, so with ``steps_per_generation`` (or
``num_iterations``) above 1 consecutive files repeat one generation: a completion file whose
trajectories equal the previous file's is recorded and not sent (the TRL integration sends each
generation once too, at the step that generated it). Must not import httpx.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collapse_monitor.completion_files import CompletionFileError, Weights, batches_of_file, file_step
from collapse_monitor.conversations import Render
from collapse_monitor.dumps import DumpError, batches_of, read_jsonl
from collapse_monitor.monitor import Monitor

logger = logging.getLogger("collapse_monitor")

STATE_VERSION = 1


def default_state_path(folder: Path, run: str) -> Path:
    return folder / f".collapse-monitor-{run}.state.json"


@dataclass(eq=False)
class Follower:
    """Sends the step files of ``folder`` through ``monitor``, remembering what was sent in ``state_path``."""

    folder: Path
    monitor: Monitor
    state_path: Path
    settle_seconds: float = 5.0
    reward_weights: Weights = None
    render: Render | None = None

    def __post_init__(self) -> None:
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

    def files(self) -> list[Path]:
        """The step files there are now, in step order."""
        found = [
            *self.folder.glob("*.jsonl"),
            *self.folder.glob("completions_*.parquet"),
            *(self.folder / "completions").glob("completions_*.parquet"),
        ]
        return sorted(found, key=_order)

    def pending(self, now: float | None = None) -> list[Path]:
        """Complete files not sent yet (or changed since), in step order."""
        now = time.time() if now is None else now
        files = self.files()
        ready = []
        stats = [path.stat() for path in files]
        for position, (path, stat) in enumerate(zip(files, stats)):
            record = self.done.get(self._key(path))
            if record is not None and (record["size"], record["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns):
                continue
            # A later step written after this file means the trainer has moved on; an older later
            # file is left from before a resume and proves nothing.
            moved_on = any(later.st_mtime_ns >= stat.st_mtime_ns for later in stats[position + 1 :])
            if path.suffix == ".parquet":
                complete = _has_parquet_footer(path, stat.st_size)
            else:
                complete = now - stat.st_mtime >= self.settle_seconds and _ends_with_newline(path)
            if not (moved_on or complete):
                break  # still being written; the files after it wait too, to keep step order
            ready.append(path)
        return ready

    def send(self, path: Path) -> list[int]:
        """Logs the batches of one file; returns their steps. Malformed files are reported and skipped."""
        stat = path.stat()
        key = self._key(path)
        record: dict[str, Any] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        try:
            if path.suffix == ".parquet":
                batches = batches_of_file(path, self.reward_weights, self.render)
            else:
                stem_step = int(path.stem) if path.stem.isdigit() else None
                batches = batches_of(read_jsonl(path), str(path), step=stem_step)
        except (DumpError, CompletionFileError) as e:
            logger.error("collapse-monitor: skipped %s: %s", path, e)
            self.done[key] = {**record, "error": str(e)}
            self._save_state()
            return []
        if path.suffix == ".parquet":
            record["content"] = _content_key(batches)
            previous = self._previous_completion_file(path)
            if previous is not None and self.done[previous].get("content") == record["content"]:
                logger.info("collapse-monitor: %s repeats the generation of %s; not sent again", key, previous)
                self.done[key] = {**record, "steps": [], "same_as": previous}
                self._save_state()
                return []
        for step, trajectories in batches.items():
            self.monitor.log(step, trajectories)
        self.done[key] = {**record, "steps": list(batches)}
        self._save_state()
        return list(batches)

    def _key(self, path: Path) -> str:
        # relative to the folder: verl's files by name (as earlier state files hold them), TRL's may sit in completions/
        return path.relative_to(self.folder).as_posix()

    def _previous_completion_file(self, path: Path) -> str | None:
        """The recorded completion file of the latest step before this one's."""
        step = file_step(path)
        earlier = [
            (file_step(Path(key)), key)
            for key in self.done
            if key.endswith(".parquet") and "error" not in self.done[key]
        ]
        candidates = [(s, key) for s, key in earlier if s is not None and step is not None and s < step]
        return max(candidates)[1] if candidates else None

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
    # verl names files {global_step}.jsonl, TRL completions_{step:05d}.parquet; other names follow in
    # order of modification.
    step = int(path.stem) if path.stem.isdigit() else file_step(path)
    if step is not None:
        return (0, float(step), path.name)
    return (1, path.stat().st_mtime, path.name)


def _content_key(batches: dict[int, list[Any]]) -> str:
    """What a completion file holds, without its step: equal for two files of one generation."""
    content = json.dumps(list(batches.values()), sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()


def _has_parquet_footer(path: Path, size: int) -> bool:
    """Whether the file ends with a parquet footer: its length (4 bytes, little-endian), then ``PAR1``."""
    if size < 12:
        return False
    with open(path, "rb") as f:
        f.seek(size - 8)
        tail = f.read(8)
    if len(tail) != 8 or tail[4:] != b"PAR1":
        return False
    return int.from_bytes(tail[:4], "little") + 12 <= size


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
