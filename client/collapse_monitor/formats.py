"""Each trainer's step files: where they are, which step each holds, and how one is read.

| format   | the trainer writes (``DIR`` is what ``follow`` is given)                 | one step is      |
| -------- | ------------------------------------------------------------------------ | ---------------- |
| verl     | ``trainer.rollout_data_dir``: ``DIR/{step}.jsonl`` (also any ``*.jsonl``) | a file           |
| trl      | ``output_dir``: ``DIR[/completions]/completions_{step:05d}.parquet``      | a file           |
| prime-rl | ``output_dir``: ``DIR[/rollouts]/step_{N}/{train,eval}/{all,effective}/traces.jsonl`` | a file |
| areal    | ``{fileroot}/{experiment}/{trial}``: ``DIR[/rollout]/{version}/{task_id}.jsonl`` | a folder  |
| roll     | ``rollout_dump_dir``: ``DIR/rollout_dump_data.step_{N}.jsonl``            | a file           |
| slime    | ``--dump-details``: ``DIR[/rollout_data]/{rollout_id}.pt`` (miles too)    | a file           |
| trackio  | verl/TRL rollout traces: ``DIR`` is the project's ``{name}.db`` (``trackio_traces``) | a run's step |

``detect`` names the format a folder holds (None while it holds no step file yet); the more
specific layouts are tried first, since the verl layout takes any ``*.jsonl``. Evaluation output
is never read unless ``DIR`` is its folder (prime-rl: ``traces`` names the kind). ``read_unit``
hands a step's files to their reader (``dumps``, ``completion_files``, ``slime_samples``). Must not
import httpx or the monitor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collapse_monitor.batches import BatchLimits
from collapse_monitor.completion_files import Weights, batches_of_file
from collapse_monitor.completion_files import file_step as trl_file_step
from collapse_monitor.conversations import Render
from collapse_monitor.dumps import DumpError, batches_of, read_jsonl
from collapse_monitor.slime_samples import Decode, read_dump
from collapse_monitor.slime_samples import trajectories as slime_trajectories
from collapse_monitor.trackio_traces import is_trackio_database, step_trajectories, step_versions

FORMATS = ("verl", "trl", "prime-rl", "areal", "roll", "slime", "trackio")
DETECTION_ORDER = ("trackio", "roll", "prime-rl", "areal", "slime", "trl", "verl")
PRIME_RL_TRACES = ("train/effective", "train/all", "eval/effective", "eval/all")

ROLL_FILE = re.compile(r"^rollout_dump_data\.step_(\d+)\.jsonl$")
STEP_FOLDER = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class StepUnit:
    """What one step of a trainer's output is: one file, or (AReaL) a folder of files."""

    key: str  # the path relative to the followed folder: the state file's name for it
    step: int | None  # the step its path names; None: the content says (or the order of writing)
    paths: tuple[Path, ...]
    kind: str  # how it is read: "jsonl", "parquet", "pt" or "trackio"
    version: tuple[int, int] | None = None  # trackio: (rows, newest row ns), in place of the file's size and time


def units(folder: Path, fmt: str, traces: str = "train/effective") -> list[StepUnit]:
    """The step units of ``fmt`` there are now under ``folder`` (unordered)."""
    if fmt == "trackio":
        if not is_trackio_database(folder):
            return []
        versions = step_versions(folder)
        return [StepUnit(f"{run}/{n}", n, (folder,), "trackio", version) for (run, n), version in versions.items()]
    if fmt == "verl":
        return [_file(folder, p, int(p.stem) if p.stem.isdigit() else None, "jsonl") for p in folder.glob("*.jsonl")]
    if fmt == "trl":
        found = [*folder.glob("completions_*.parquet"), *(folder / "completions").glob("completions_*.parquet")]
        return [_file(folder, p, trl_file_step(p), "parquet") for p in found]
    if fmt == "roll":
        return [
            _file(folder, p, _match(ROLL_FILE, p.name), "jsonl") for p in folder.glob("rollout_dump_data.step_*.jsonl")
        ]
    if fmt == "prime-rl":
        found = [*folder.glob(f"step_*/{traces}/traces.jsonl"), *folder.glob(f"rollouts/step_*/{traces}/traces.jsonl")]
        steps = [(p, _match(STEP_FOLDER, p.parents[2].name)) for p in found]
        return [_file(folder, p, step, "jsonl") for p, step in steps if step is not None]
    if fmt == "areal":
        out = []
        for root in (folder, folder / "rollout"):
            for version in (d for d in _subfolders(root) if d.name.isdigit()):
                files = tuple(sorted(version.glob("*.jsonl")))
                if files:
                    out.append(StepUnit(version.relative_to(folder).as_posix(), int(version.name), files, "jsonl"))
        return out
    if fmt == "slime":
        found = [*folder.glob("*.pt"), *(folder / "rollout_data").glob("*.pt")]
        return [_file(folder, p, int(p.stem), "pt") for p in found if p.stem.isdigit()]  # eval_{id}.pt is evaluation
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def detect(folder: Path, traces: str = "train/effective") -> str | None:
    """The format of the step files under ``folder``, or None while there are none."""
    for fmt in DETECTION_ORDER:
        if units(folder, fmt, traces):
            return fmt
    return None


def file_format(path: Path) -> str:
    """The format of one step file, from its name and place (``send``)."""
    if path.suffix == ".parquet":
        return "trl"
    if is_trackio_database(path):
        return "trackio"
    if path.suffix == ".pt":
        return "slime"
    if ROLL_FILE.match(path.name):
        return "roll"
    if path.name == "traces.jsonl" and len(path.parents) > 3 and STEP_FOLDER.match(path.parents[2].name):
        return "prime-rl"
    if path.stem.isdigit() and path.parent.name.isdigit():
        return "areal"
    return "verl"


def step_of_file(path: Path, fmt: str) -> int | None:
    """The step a single file's place names (None: its lines must say)."""
    if fmt == "trl":
        return trl_file_step(path)
    if fmt == "roll":
        return _match(ROLL_FILE, path.name)
    if fmt == "prime-rl":
        return _match(STEP_FOLDER, path.parents[2].name) if len(path.parents) > 3 else None
    if fmt == "areal":
        return int(path.parent.name) if path.parent.name.isdigit() else None
    return int(path.stem) if path.stem.isdigit() else None


def _file(folder: Path, path: Path, step: int | None, kind: str) -> StepUnit:
    return StepUnit(path.relative_to(folder).as_posix(), step, (path,), kind)


def _match(pattern: re.Pattern[str], name: str) -> int | None:
    found = pattern.match(name)
    return int(found.group(1)) if found else None


def _subfolders(root: Path) -> list[Path]:
    return [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []


@dataclass(frozen=True)
class Reading:
    """How step files are turned into trajectories, beyond what they hold themselves."""

    reward_weights: Weights = None  # TRL: the trainer's reward_weights
    render: Render | None = None  # conversations as prompt text (TRL, ROLL messages, prime-rl)
    trust_pickle: bool = False  # slime: the folder is trusted, its .pt files may be unpickled
    reward_key: str | None = None  # slime: the key of dict rewards (the trainer's --reward-key)
    decode: Decode | None = None  # slime: the policy's tokenizer, for multi-turn samples
    limits: BatchLimits = field(default_factory=BatchLimits)  # JSONL: a step is read up to what one batch may hold


@dataclass(frozen=True)
class Step:
    """One step's trajectories as read, and how many reading cut or left out to fit the service's limits (JSONL
    readers: ``dumps``), for the monitor to count (``Monitor.log``)."""

    trajectories: list[Any]
    n_cut: int = 0
    n_left_out: int = 0


class UntrustedDumpError(ValueError):
    """slime's dumps are pickles: reading them runs code, so only a folder said to be trusted is read."""


def read_unit(unit: StepUnit, reading: Reading) -> dict[int, Step]:
    """The steps of one step unit; raises DumpError, CompletionFileError, MissingExtraError."""
    if unit.kind == "trackio":
        run, number = unit.key.rsplit("/", 1)
        return {int(number): Step(step_trajectories(unit.paths[0], run, int(number), reading.render))}
    if unit.kind == "parquet":
        read = batches_of_file(unit.paths[0], reading.reward_weights, reading.render)
        return {step: Step(trajectories) for step, trajectories in read.items()}
    if unit.kind == "pt":
        if not reading.trust_pickle:
            raise UntrustedDumpError(
                f"{unit.paths[0]} is a slime dump, a pickle that runs code when read: pass --trust-pickle if you "
                "trust the folder (your trainer wrote it), or log through collapse_monitor.integrations.slime"
            )
        rollout_id, samples = read_dump(unit.paths[0])
        step = unit.step if unit.step is not None else rollout_id
        if step is None:
            raise DumpError(f"{unit.paths[0]}: names no rollout id (neither its name nor its rollout_id)")
        try:
            found = slime_trajectories(samples, reward_key=reading.reward_key, decode=reading.decode)
        except (ValueError, TypeError, AttributeError) as e:
            raise DumpError(f"{unit.paths[0]}: {e}") from e
        return {step: Step(found)}
    rows = (line for path in unit.paths for line in read_jsonl(path))  # one line at a time
    total_bytes = sum(path.stat().st_size for path in unit.paths)
    where = str(unit.paths[0]) if len(unit.paths) == 1 else f"{unit.paths[0].parent}/*.jsonl"
    fits = batches_of(
        rows, where, step=unit.step, render=reading.render, limits=reading.limits, total_bytes=total_bytes
    )
    return {step: Step(fit.items(), fit.n_cut, sum(fit.left_out.values())) for step, fit in fits.items()}
