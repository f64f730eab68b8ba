"""Rollout dumps: JSONL files of generations, read back as one batch per training step.

Three line formats, told apart line by line:

* a **batch**: ``{"step": 12, "trajectories": [...]}``;
* a **trajectory** with its step: ``{"step": 12, "group_id": 0, "reward": 1.0, "turns": [...]}``
  (or the single-turn shorthand with ``prompt`` and ``response``);
* a **verl row**, as ``trainer.rollout_data_dir`` writes them (one ``{global_step}.jsonl`` per
  step): ``{"input": prompt text, "output": response text, "score": reward, "step": 12, "gts": ...}``
  plus the reward function's extra keys. Rows with the same ``uid`` form a group; verl's
  TransferQueue trainer writes ``uid`` as ``{prompt uid}_{session}_{index}``, where the rows of one
  session are the turns of one trajectory, in index order. Without ``uid``, rows with the same
  ``input`` (the same prompt, repeated ``rollout.n`` times) form a group.

Must not import httpx or the monitor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


class DumpError(ValueError):
    """A dump line that is not JSON or fits none of the formats; the message names file and line."""


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DumpError(f"{path}:{number}: not JSON: {e}") from e
            if not isinstance(value, dict):
                raise DumpError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
            rows.append((number, value))
    return rows


def is_verl_row(row: Mapping[str, Any]) -> bool:
    return "input" in row and "output" in row


def batches_of(
    rows: Iterable[tuple[int, Mapping[str, Any]]], where: str, step: int | None = None
) -> dict[int, list[Any]]:
    """Trajectories per step, steps in order of first appearance. ``step`` fills in rows without one."""
    by_step: dict[int, list[Any]] = {}
    verl: dict[int, list[Mapping[str, Any]]] = {}
    for number, row in rows:
        row_step = row.get("step", step)
        if isinstance(row_step, bool) or not isinstance(row_step, int) or row_step < 0:
            raise DumpError(f"{where}:{number}: needs an integer step (a 'step' field or --step), got {row_step!r}")
        if "trajectories" in row:
            if not isinstance(row["trajectories"], list):
                raise DumpError(f"{where}:{number}: trajectories must be a list")
            by_step.setdefault(row_step, []).extend(row["trajectories"])
        elif is_verl_row(row):
            by_step.setdefault(row_step, [])
            verl.setdefault(row_step, []).append(row)
        elif "turns" in row or "prompt" in row or "prompt_token_ids" in row:
            by_step.setdefault(row_step, []).append({k: v for k, v in row.items() if k != "step"})
        else:
            raise DumpError(
                f"{where}:{number}: expected a batch (trajectories), a trajectory (turns or prompt) or a verl row "
                f"(input, output), got keys {sorted(row)}"
            )
    for row_step, verl_rows in verl.items():
        by_step[row_step].extend(verl_trajectories(verl_rows))
    return by_step


def verl_trajectories(rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """verl dump rows as trajectories: groups by ``uid`` (or prompt), multi-turn sessions joined."""
    sessions: dict[Any, list[tuple[int, Mapping[str, Any]]]] = {}
    groups: dict[Any, Any] = {}
    for i, row in enumerate(rows):
        group, session, index = _verl_key(row, i)
        sessions.setdefault(session, []).append((index, row))
        groups[session] = group
    trajectories = []
    for session, turns in sessions.items():
        turns.sort(key=lambda t: t[0])
        last = turns[-1][1]
        trajectories.append(
            {
                "group_id": groups[session],
                "reward": _score(last.get("score")),
                "turns": [{"prompt": str(row["input"]), "response": str(row["output"])} for _, row in turns],
            }
        )
    return trajectories


def _verl_key(row: Mapping[str, Any], i: int) -> tuple[Any, Any, int]:
    """(group, session, turn index) of a row; see the module docstring."""
    uid = row.get("uid")
    if uid is None:
        return ("input", row["input"]), ("row", i), 0
    parts = str(uid).rsplit("_", 2)
    if len(parts) == 3 and parts[2].isdigit():
        return ("uid", parts[0]), ("session", parts[0], parts[1]), int(parts[2])
    return ("uid", str(uid)), ("row", i), 0


def _score(value: Any) -> float | None:
    if value is None:
        return None
    try:
        score = float(value)
    except (TypeError, ValueError):
        return None
    return score if math.isfinite(score) else None
