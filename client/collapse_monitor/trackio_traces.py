"""Trackio's rollout traces: the ``traces`` table of a project's SQLite file, read back as trajectories.

Two trainers write every rollout there (``trackio.log({key: trackio.Trace(messages, metadata)}, step)``;
trackio 0.43 ``sqlite_storage.py`` stores one row per trace: ``id, run_name, step, key, messages,
metadata, timestamp``, the messages and metadata as JSON):

* verl 0.9.1 (``actor_rollout_ref.rollout.trace.backend=trackio``, ``verl/utils/rollout_trace.py``):
  each agent loop's ``run`` under ``rollout_trace/<Loop>.run``, its ``step`` the training step, its
  metadata ``sample_index`` (the prompt), ``rollout_n``, ``validate`` and ``output`` (the
  ``AgentLoopOutput`` with ``prompt_text``/``response_text`` when token2text is on, and
  ``reward_score``); the messages are the prompt's, then the assistant's answer. Other operations
  (tool parsers) write rows under other keys: they are not rollouts and are passed over.
* TRL's async GRPO (``trl/experimental/async_grpo`` ``log_rollout_traces``): under ``rollouts``, the
  messages the prompt then the completion, the metadata ``reward``, ``group_id``, ``model_version``.

A step is the rows of one run at one ``step``; a prompt group is verl's ``sample_index`` or TRL's
``group_id``. Validation rollouts (verl ``validate``) are not training and are passed over. A row
that cannot be read is named (its ``id``) in the log and left out. Must not import httpx or the monitor.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from collapse_monitor.conversations import Render, message_text, render_plain

logger = logging.getLogger("collapse_monitor")

VERL_KEY_PREFIX = "rollout_trace/"
TRL_KEY = "rollouts"


def project_database(project: str) -> Path:
    """A project's SQLite file: ``project`` as a path if it names one, else where trackio keeps it.

    Trackio keeps ``{TRACKIO_DIR or HF_HOME/trackio}/{name}.db``, the name stripped to ``[A-Za-z0-9_-]``.
    """
    path = Path(project)
    if path.suffix == ".db" or path.exists():
        return path
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    root = Path(os.environ["TRACKIO_DIR"]) if os.environ.get("TRACKIO_DIR") else home / "trackio"
    name = "".join(c for c in project if c.isalnum() or c in "_-") or "default"
    return root / f"{name}.db"


def _connect(database: Path) -> sqlite3.Connection:
    # read-only: the trainer's trackio is the only writer; a WAL reader sees committed rows only
    return sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True, timeout=30)


def step_versions(database: Path) -> dict[tuple[str, int], tuple[int, int]]:
    """Per (run, step): how many trace rows it holds and its newest row's time (ns): what changes when it grows."""
    try:
        with _connect(database) as conn:
            rows = conn.execute(
                "SELECT run_name, step, count(*), max(timestamp) FROM traces GROUP BY run_name, step"
            ).fetchall()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):  # a project that has logged no trace yet
            return {}
        raise
    return {(str(run), int(step)): (int(n), _time_ns(newest)) for run, step, n, newest in rows}


def _time_ns(timestamp: str) -> int:
    return int(datetime.fromisoformat(timestamp).timestamp() * 1e9)


def is_trackio_database(path: Path) -> bool:
    """Whether ``path`` is a SQLite file (trackio's projects are ``*.db``)."""
    if path.suffix != ".db" or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(16) == b"SQLite format 3\x00"


def step_trajectories(database: Path, run: str, step: int, render: Render | None = None) -> list[dict[str, Any]]:
    """The training trajectories of one run's step (see the module docstring), in the order they were logged."""
    render = render or render_plain
    with _connect(database) as conn:
        rows = conn.execute(
            "SELECT id, key, messages, metadata FROM traces WHERE run_name = ? AND step = ? ORDER BY rowid",
            (run, step),
        ).fetchall()
    out = []
    for row_id, key, messages, metadata in rows:
        if not (key == TRL_KEY or (key.startswith(VERL_KEY_PREFIX) and key.endswith(".run"))):
            continue
        try:
            trajectory = _trajectory(key, json.loads(messages), json.loads(metadata), render)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            logger.error(
                "collapse-monitor: trackio trace %s (run %s, step %d) cannot be read: %s", row_id, run, step, e
            )
            continue
        if trajectory is not None:
            out.append(trajectory)
    return out


def _trajectory(key: str, messages: list[Any], metadata: Mapping[str, Any], render: Render) -> dict[str, Any] | None:
    if metadata.get("validate") or metadata.get("status") == "error":
        return None  # evaluation, or a rollout that raised: nothing trained on
    if key == TRL_KEY:
        # TRL: messages = sample.prompt + sample.completion; the completion follows the last user turn
        n_prompt = max((i + 1 for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
        responses = [message_text(m.get("content")) for m in messages[n_prompt:] if m.get("role") == "assistant"]
        if not n_prompt or not responses:
            raise ValueError(f"holds no prompt and assistant answer ({len(messages)} messages)")
        turn = {"prompt": render(messages[:n_prompt]), "response": "\n".join(responses)}
        return {"group_id": str(metadata["group_id"]), "reward": _finite(metadata.get("reward")), "turns": [turn]}
    # verl: the texts are in the output only when the rollout's token2text is on; without it the
    # trace holds token ids and its messages a JSON dump of the call, which is not the model's text
    output = metadata.get("output") or {}
    raw_prompt = ((metadata.get("inputs") or {}).get("kwargs") or {}).get("raw_prompt")
    prompt = output.get("prompt_text") or (render(raw_prompt) if isinstance(raw_prompt, list) and raw_prompt else None)
    if not prompt or output.get("response_text") is None:
        raise ValueError("holds no prompt_text/response_text: set actor_rollout_ref.rollout.trace.token2text=True")
    turn = {"prompt": str(prompt), "response": str(output["response_text"])}
    return {"group_id": str(metadata["sample_index"]), "reward": _finite(output.get("reward_score")), "turns": [turn]}


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return number if math.isfinite(number) else None
