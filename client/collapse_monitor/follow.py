"""Following a trainer's output folder: each new step is sent once, and a restart resumes.

The folder's layout says which trainer wrote it (``formats.py``: verl, TRL, prime-rl, AReaL, ROLL,
slime), or ``format`` names it; it may not exist yet: it is looked at again at every poll, and the
format found first is kept (and remembered in the state file).

A step is read once it is complete: when a later step's files were written after it (trainers
write steps in order); a JSONL file also when it has not changed for ``settle_seconds`` and ends
with a newline, a parquet file once it ends with its footer (written last), a slime dump once it
ends with its zip directory. An AReaL version folder gathers the trajectories that finished under
that policy version, some after the next version began, so it is read only once it has not changed
for ``settle_seconds``. After a step's batches are handed to a durable monitor (written to the
spool before ``log()`` returns), its files' size and modification time go to the state file,
written atomically; a step that changes afterwards (a trainer resumed from a checkpoint rewrites
it) is sent again, as new content under the same step. TRL writes the latest generation at every
logging step, so with ``steps_per_generation`` (or ``num_iterations``) above 1 consecutive files
repeat one generation: a completion file whose trajectories equal the previous file's is recorded
and not sent (the TRL integration sends each generation once too, at the step that generated it).

Alerts (``AlertHook``): the trainers read here have no hook to stop them, so ``follow`` can only
act from outside: write a stop file the trainer's own code may look for, and run a command (signal
the trainer, cancel its job). Must not import httpx.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from collapse_monitor.alerts import AlertEvent
from collapse_monitor.completion_files import CompletionFileError
from collapse_monitor.completion_files import file_step as trl_file_step
from collapse_monitor.dumps import DumpError
from collapse_monitor.formats import FORMATS, Reading, StepUnit, UntrustedDumpError, detect, read_unit, units
from collapse_monitor.monitor import Monitor

logger = logging.getLogger("collapse_monitor")

STATE_VERSION = 1
ZIP_END = b"PK\x05\x06"  # the zip end-of-directory record, which torch.save writes last


def default_state_path(folder: Path, run: str) -> Path:
    if folder.suffix == ".db":  # a Trackio project: its state beside it, named after it
        return folder.with_name(f".{folder.stem}.collapse-monitor-{run}.state.json")
    return folder / f".collapse-monitor-{run}.state.json"


@dataclass(eq=False)
class Follower:
    """Sends the steps written under ``folder`` through ``monitor``, remembering what was sent in ``state_path``."""

    folder: Path
    monitor: Monitor
    state_path: Path
    settle_seconds: float = 5.0
    reading: Reading = field(default_factory=Reading)
    format: str = "auto"
    traces: str = "train/effective"  # prime-rl: which of its trace files

    def __post_init__(self) -> None:
        if self.format != "auto" and self.format not in FORMATS:
            raise ValueError(f"format must be auto or one of {', '.join(FORMATS)}, got {self.format!r}")
        self.done: dict[str, dict[str, Any]] = {}
        self.found: str | None = None if self.format == "auto" else self.format
        if self.state_path.exists():
            state = json.loads(self.state_path.read_text())
            if state.get("version") != STATE_VERSION or state.get("run") != self.monitor.run:
                raise ValueError(
                    f"{self.state_path} belongs to run {state.get('run')!r} (version {state.get('version')}), "
                    f"not {self.monitor.run!r}; pass another --state file"
                )
            self.done = state["files"]
            self.found = self.found or state.get("format")

    def _save_state(self) -> None:
        state = {"version": STATE_VERSION, "run": self.monitor.run, "format": self.found, "files": self.done}
        tmp = self.state_path.with_name(f".{self.state_path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_path)

    def units(self) -> list[StepUnit]:
        """The steps there are now, in step order (none while the folder holds no step file)."""
        if self.found is None:
            self.found = detect(self.folder, self.traces)
            if self.found is None:
                return []
            logger.info("collapse-monitor: %s holds %s output", self.folder, self.found)
        return sorted(units(self.folder, self.found, self.traces), key=_order)

    def pending(self, now: float | None = None) -> list[StepUnit]:
        """Complete steps not sent yet (or changed since), in step order."""
        now = time.time() if now is None else now
        found, stats = [], []
        for unit in self.units():
            try:
                stats.append(_stat(unit, self.folder))
            except FileNotFoundError:  # removed since listed (a trainer rotating its dumps): gone for us too
                continue
            except UnreadableError as e:
                self._skip_unreadable(unit, e)
                continue
            found.append(unit)
        ready = []
        for position, (unit, (size, mtime_ns)) in enumerate(zip(found, stats)):
            record = self.done.get(unit.key)
            if record is not None and (record["size"], record["mtime_ns"]) == (size, mtime_ns):
                continue
            # A later step written after this one means the trainer has moved on; an older later
            # step is left from before a resume and proves nothing.
            moved_on = any(later >= mtime_ns for _, later in stats[position + 1 :])
            rested = now - mtime_ns / 1e9 >= self.settle_seconds
            try:
                complete = self._is_complete(unit, moved_on, rested)
            except OSError as e:  # unreadable (permissions) or removed since its stat
                self._skip(unit, (size, mtime_ns), str(e))
                continue
            if not complete:
                break  # still being written; the steps after it wait too, to keep step order
            ready.append(unit)
        return ready

    def _is_complete(self, unit: StepUnit, moved_on: bool, rested: bool) -> bool:
        if self.found == "areal":
            return rested  # stragglers of a version land after the next version began
        if unit.kind == "parquet":
            return moved_on or _has_parquet_footer(unit.paths[0])
        if unit.kind == "trackio":
            return moved_on or rested  # a step's rows are in once a later step's are, or all went quiet
        if unit.kind == "pt":
            return (moved_on or rested) and _ends_with_zip_directory(unit.paths[0])
        return moved_on or (rested and all(_ends_with_newline(p) for p in unit.paths))

    def _skip(self, unit: StepUnit, identity: tuple[int, int], reason: str) -> None:
        """Records a step that cannot be read, progress saved first, so a restart passes it by (until it changes)."""
        logger.error("collapse-monitor: skipped %s: %s", unit.key, reason)
        self.done[unit.key] = {"size": identity[0], "mtime_ns": identity[1], "error": reason}
        self._save_state()

    def _skip_unreadable(self, unit: StepUnit, error: UnreadableError) -> None:
        record = self.done.get(unit.key)
        if record is not None and (record["size"], record["mtime_ns"]) == error.identity:
            return  # skipped already, and unchanged
        self._skip(unit, error.identity, str(error))

    def send(self, unit: StepUnit) -> list[int]:
        """Logs the batches of one step; returns their steps. Steps that cannot be read are reported and skipped."""
        try:
            size, mtime_ns = _stat(unit, self.folder)
        except FileNotFoundError:
            return []
        except UnreadableError as e:
            self._skip_unreadable(unit, e)
            return []
        record: dict[str, Any] = {"size": size, "mtime_ns": mtime_ns}
        try:
            # Read up to the limits the monitor fits to now: the service's once it told them.
            batches = read_unit(unit, replace(self.reading, limits=self.monitor.limits))
        except UntrustedDumpError:
            raise  # the folder's setting, not this file: follow stops and says how to trust it
        except (DumpError, CompletionFileError, OSError, ValueError, RecursionError, MemoryError) as e:
            # ValueError: a bad byte anywhere a reader decodes text; RecursionError: nesting past what
            # Python parses; MemoryError: a file far past what this machine holds. None may end the loop.
            self._skip(unit, (size, mtime_ns), str(e) or type(e).__name__)
            return []
        empty = [step for step, read in batches.items() if not read.trajectories]
        if empty:
            logger.warning("collapse-monitor: %s holds no trajectory to score at step(s) %s", unit.key, empty)
            batches = {step: read for step, read in batches.items() if read.trajectories}
        if unit.kind == "parquet":
            record["content"] = _content_key([read.trajectories for read in batches.values()])
            previous = self._previous_completion_file(unit)
            if previous is not None and self.done[previous].get("content") == record["content"]:
                logger.info("collapse-monitor: %s repeats the generation of %s; not sent again", unit.key, previous)
                self.done[unit.key] = {**record, "steps": [], "same_as": previous}
                self._save_state()
                return []
        for step, read in batches.items():
            self.monitor.log(step, read.trajectories, rows_cut=read.n_cut, rows_left_out=read.n_left_out)
        self.done[unit.key] = {**record, "steps": list(batches)}
        self._save_state()
        return list(batches)

    def _previous_completion_file(self, unit: StepUnit) -> str | None:
        """The recorded completion file of the latest step before this one's."""
        earlier = [
            (trl_file_step(Path(key)), key)
            for key, record in self.done.items()
            if key.endswith(".parquet") and "error" not in record
        ]
        candidates = [(s, key) for s, key in earlier if s is not None and unit.step is not None and s < unit.step]
        return max(candidates)[1] if candidates else None

    def follow(self, poll_seconds: float = 2.0, once: bool = False, stop: threading.Event | None = None) -> list[int]:
        """Sends complete steps as they appear until ``stop`` is set (or, with ``once``, what is ready now)."""
        stop = stop or threading.Event()
        sent: list[int] = []
        while not stop.is_set():
            for unit in self.pending():
                steps = self.send(unit)
                sent.extend(steps)
                logger.info("collapse-monitor: %s -> steps %s", unit.key, steps)
            if once:
                break
            stop.wait(poll_seconds)
        return sent


@dataclass(eq=False)
class AlertHook:
    """What ``follow`` does when an alert enters one of the watched states: a stop file, a command.

    The stop file gets the alert's description (written atomically, so a trainer polling for it never
    reads half of it); the command runs through the shell with the alert in its environment
    (``COLLAPSE_MONITOR_RUN``, ``_RULE``, ``_STATE``, ``_STEP``, ``_SAMPLER``, ``_SUMMARY``). Both
    happen on the watcher's thread, never in the way of the files being sent.
    """

    run: str
    stop_file: Path | None = None
    command: str | None = None
    command_timeout_seconds: float = 60.0

    def __call__(self, event: AlertEvent) -> None:
        logger.warning("collapse-monitor: %s: %s", event.describe(), event.summary)
        if self.stop_file is not None:
            tmp = self.stop_file.with_name(f".{self.stop_file.name}.tmp")
            tmp.write_text(f"{event.describe()}\n{event.summary}\n")
            os.replace(tmp, self.stop_file)
            logger.warning("collapse-monitor: wrote the stop file %s", self.stop_file)
        if self.command is not None:
            env = {
                **os.environ,
                "COLLAPSE_MONITOR_RUN": self.run,
                "COLLAPSE_MONITOR_RULE": event.rule,
                "COLLAPSE_MONITOR_STATE": event.state,
                "COLLAPSE_MONITOR_STEP": str(event.step),
                "COLLAPSE_MONITOR_SAMPLER": event.sampler,
                "COLLAPSE_MONITOR_SUMMARY": event.summary,
            }
            try:
                # through the shell: it is the user's own command line, as they typed it
                done = subprocess.run(
                    self.command, shell=True, env=env, timeout=self.command_timeout_seconds, check=False
                )
            except subprocess.TimeoutExpired:
                logger.error("collapse-monitor: the alert command ran past %gs", self.command_timeout_seconds)
                return
            log = logger.warning if done.returncode == 0 else logger.error
            log("collapse-monitor: the alert command exited with %d", done.returncode)


class UnreadableError(OSError):
    """A step's path is no regular file inside the followed folder (a folder, a FIFO, a symlink loop or
    one pointing outside): never opened, since opening a FIFO blocks until a writer comes."""

    def __init__(self, message: str, identity: tuple[int, int]) -> None:
        super().__init__(message)
        self.identity = identity  # the path's own size and mtime (lstat): a change lets it be tried again


def _stat(unit: StepUnit, folder: Path) -> tuple[int, int]:
    """Total size and newest modification time of a step's files, once each is known to be a regular file
    (Trackio: the step's rows and its newest row's time).

    Raises:
        FileNotFoundError: a file is gone.
        UnreadableError: a file is not a regular file in ``folder`` (symlinks are followed only inside it).
    """
    if unit.version is not None:
        return unit.version
    inside = os.path.realpath(folder)
    stats = []
    for path in unit.paths:
        own = os.lstat(path)
        identity = (own.st_size, own.st_mtime_ns)
        st = own
        if stat.S_ISLNK(own.st_mode):
            target = os.path.realpath(path)
            if os.path.commonpath([inside, target]) != inside:
                raise UnreadableError(f"{path} is a symlink out of {folder} (to {target}); not followed", identity)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise UnreadableError(f"{path} is a dangling symlink", identity) from None
            except OSError as e:  # ELOOP: a symlink loop
                raise UnreadableError(f"{path} is a symlink that cannot be followed: {e.strerror}", identity) from e
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "special"
            raise UnreadableError(f"{path} is not a regular file ({kind}); only regular files are read", identity)
        stats.append(st)
    return sum(s.st_size for s in stats), max(s.st_mtime_ns for s in stats)


def _order(unit: StepUnit) -> tuple[int, float, str]:
    # steps named by their paths first, in step order; others in order of modification (lstat: never
    # follows a link, and never fails on one that loops)
    if unit.step is not None:
        return (0, float(unit.step), unit.key)
    try:
        mtime_ns = max(os.lstat(p).st_mtime_ns for p in unit.paths)
    except FileNotFoundError:
        mtime_ns = 0
    return (1, mtime_ns / 1e9, unit.key)


def _content_key(steps: list[list[Any]]) -> str:
    """What a completion file holds, without its step: equal for two files of one generation."""
    content = json.dumps(steps, sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()


def _has_parquet_footer(path: Path) -> bool:
    """Whether the file ends with a parquet footer: its length (4 bytes, little-endian), then ``PAR1``."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 12:
            return False
        f.seek(size - 8)
        tail = f.read(8)
    if len(tail) != 8 or tail[4:] != b"PAR1":
        return False
    return int.from_bytes(tail[:4], "little") + 12 <= size


def _ends_with_zip_directory(path: Path) -> bool:
    """Whether a torch file is whole: its zip end-of-directory record (22 bytes, no comment) ends it."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 22:
            return False
        f.seek(size - 22)
        return f.read(4) == ZIP_END


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
