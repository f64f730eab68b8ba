"""Rollout dumps: JSONL files of generations, read back as one batch per training step.

The line formats, told apart line by line:

* a **batch**: ``{"step": 12, "trajectories": [...]}``;
* a **trajectory** with its step: ``{"step": 12, "group_id": 0, "reward": 1.0, "turns": [...]}``
  (or the single-turn shorthand with ``prompt`` and ``response``);
* a **verl row**, as ``trainer.rollout_data_dir`` writes them (one ``{global_step}.jsonl`` per
  step): ``{"input": prompt text, "output": response text, "score": reward, "step": 12, "gts": ...}``
  plus the reward function's extra keys. Rows with the same ``uid`` form a group; verl's V1
  (TransferQueue) trainer writes ``uid`` as ``{prompt uid}_{session}_{index}``, where the rows of
  one session are the turns of one trajectory, in index order. Without ``uid``, rows with the same
  ``input`` (the same prompt, repeated ``rollout.n`` times) form a group.
* an **AReaL row** (``rollout.dump_to_file``, one ``{task_id}.jsonl`` per task in a folder per
  policy version): ``{"task_id", "sample_idx", "prompt", "completion", "reward", ...}``, prompt and
  completion decoded with their special tokens. The rows of one task form a group; the step is
  the version folder's (given as ``step``).
* a **ROLL batch** (``rollout_dump_dir``, ``rollout_dump_data.step_{N}.jsonl``): one line holding
  the step's columns, ``{"id": [...], "prompt": [...], "messages": [...], "responses": [...],
  "scores": [...], "global_step": [...], ...}``. Rows with the same ``id`` (else the same prompt)
  form a group; the prompt is ``messages`` (a conversation, JSON or a list, rendered by
  ``render``) when present, else ``prompt``.
* a **prime-rl episode** (``rollouts/step_{N}/.../traces.jsonl``): verifiers' ``Episode.to_record()``,
  read by ``prime_rl_traces``; the step is the ``step_{N}`` folder's (given as ``step``).

Lines are read and converted one at a time, and a step holds only what one body can send
(``batches.GroupFit``): each trajectory is kept as it will be sent, its turns, texts and token lists
cut to the service's limits (``batches.within_limits``, as ``encode`` cuts them), and sized so, and
whole groups past the limits of one batch are left out as they come and named in the log. So a step
holds every whole group that fits its body once cut, and reading holds about one body per step, not
what the file expands to (the rows of verl's multi-turn sessions are the exception: a session's
turns may be anywhere in the file, so they are kept, their texts cut, until its end; a verl row of
its own is converted as it comes). An episode record's trajectories are bounded to its share of
that body, its line's share of the file's bytes (``prime_rl_traces``).

Must not import httpx or the monitor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Hashable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from collapse_monitor.batches import (
    GROUP_KEYS,
    BatchLimits,
    GroupFit,
    TrajectoryError,
    group_of,
    json_bytes,
    normalize,
    within_limits,
)
from collapse_monitor.conversations import Render, is_conversation, render_plain
from collapse_monitor.prime_rl_traces import episode_trajectories, is_episode_record

logger = logging.getLogger("collapse_monitor")


class DumpError(ValueError):
    """A dump line that is not JSON or fits none of the formats; the message names file and line."""


# A line past the service's body limit could never be sent; reading stops there so a file with no newline
# (2 GB of NULs) costs one line's bytes, not the file's.
MAX_LINE_BYTES = BatchLimits.max_body_bytes
# A group's key past this many characters (a prompt, when it is the group) is kept as its opening and a digest.
MAX_KEY_CHARS = 80


def read_jsonl(path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, dict[str, Any], int]]:
    """(line number, object, the line's bytes) of every non-blank line, read as they are asked for.

    Raises:
        DumpError: a line is longer than ``max_line_bytes``, not UTF-8, not JSON, nested too deep to
            parse, or not an object.
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), 1):
            if len(raw) > max_line_bytes:
                raise DumpError(
                    f"{path}:{number}: a line longer than {max_line_bytes} bytes (the service's body limit)"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DumpError(f"{path}:{number}: not UTF-8: {e}") from e
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DumpError(f"{path}:{number}: not JSON: {e}") from e
            except RecursionError as e:
                raise DumpError(f"{path}:{number}: JSON nested too deep to read") from e
            if not isinstance(value, dict):
                raise DumpError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
            yield number, value, len(raw)


def is_verl_row(row: Mapping[str, Any]) -> bool:
    return "input" in row and "output" in row


def is_areal_row(row: Mapping[str, Any]) -> bool:
    return "task_id" in row and "completion" in row


def is_roll_batch(row: Mapping[str, Any]) -> bool:
    return "responses" in row and "scores" in row


def batches_of(
    rows: Iterable[tuple[int, Mapping[str, Any], int]],
    where: str,
    step: int | None = None,
    render: Render | None = None,
    limits: BatchLimits | None = None,
    total_bytes: int | None = None,
) -> dict[int, GroupFit[Any]]:
    """Trajectories per step (``GroupFit.items()``, with what was cut and left out), steps in order of first
    appearance (see the module docstring).

    ``rows``: (line number, object, its bytes). ``step`` fills in rows without one; ``render`` turns a
    conversation into prompt text (ROLL's ``messages``, prime-rl's conversations; default
    ``conversations.render_plain``). Each step keeps the whole groups that fit one body of ``limits``;
    ``total_bytes`` (the lines' bytes together) gives each prime-rl record its share of that body.
    """
    render = render or render_plain
    limits = limits or BatchLimits()
    fits: dict[int, GroupFit[Any]] = {}
    verl: dict[int, list[Mapping[str, Any]]] = {}

    def keep(row_step: int, trajectories: Iterable[Any]) -> None:
        fit = fits.setdefault(row_step, GroupFit(limits.trajectory_bytes, limits.max_trajectories))
        for trajectory in trajectories:
            group, sent, n_bytes, is_cut = _as_sent(trajectory, limits)
            fit.n_cut += is_cut
            fit.add(("malformed", id(trajectory)) if group is None else group, sent, n_bytes)

    for number, row, n_bytes in rows:
        row_step = _roll_step(row, step, f"{where}:{number}") if is_roll_batch(row) else row.get("step", step)
        if isinstance(row_step, bool) or not isinstance(row_step, int) or row_step < 0:
            raise DumpError(f"{where}:{number}: needs an integer step (a 'step' field or --step), got {row_step!r}")
        if is_verl_row(row) and _verl_key(row, number)[1][0] == "row":  # a trajectory of its own
            keep(row_step, verl_trajectories([row]))
        elif is_verl_row(row):
            keep(row_step, [])  # the step keeps its place in the order of steps
            verl.setdefault(row_step, []).append(_verl_row_within(row, limits))
        else:
            share = limits.trajectory_bytes * n_bytes // max(total_bytes or n_bytes, n_bytes)
            keep(row_step, _row_trajectories(row, f"{where}:{number}", render, limits, share))
    for row_step, verl_rows in verl.items():
        keep(row_step, verl_trajectories(verl_rows))
    for row_step, fit in fits.items():
        if fit.n_cut:
            logger.warning(
                "collapse-monitor: %s, step %d: %d trajectories read with their turns, texts or token ids cut to the "
                "service's limits (%d turns, %d characters a text, %d ids a list)",
                where,
                row_step,
                fit.n_cut,
                limits.max_turns,
                limits.max_text_chars,
                limits.max_token_ids,
            )
        if fit.left_out:
            logger.warning(
                "collapse-monitor: %s, step %d: %s left out to fit the service's limits of one batch (%d bytes, %d "
                "trajectories); a step is scored as one batch, so they are not sent",
                where,
                row_step,
                fit.describe_left_out(),
                limits.max_body_bytes,
                limits.max_trajectories,
            )
    return fits


def _row_trajectories(
    row: Mapping[str, Any], where: str, render: Render, limits: BatchLimits, share_bytes: int
) -> list[Any]:
    """The trajectories of one line that is not a verl row (``share_bytes``: its part of one body)."""
    if "trajectories" in row:
        if not isinstance(row["trajectories"], list):
            raise DumpError(f"{where}: trajectories must be a list")
        return row["trajectories"]
    if is_areal_row(row):
        return [_areal_trajectory(row, where)]
    if is_roll_batch(row):
        return _roll_trajectories(row, where, render)
    if is_episode_record(row):
        try:
            return episode_trajectories(row, render, limits, share_bytes)
        except (KeyError, TypeError, ValueError) as e:
            raise DumpError(f"{where}: not a verifiers episode record as prime-rl writes it: {e!r}") from e
    if "turns" in row or "prompt" in row or "prompt_token_ids" in row:
        return [{k: v for k, v in row.items() if k != "step"}]
    raise DumpError(
        f"{where}: expected a batch (trajectories), a trajectory (turns or prompt), a verl row "
        f"(input, output), an AReaL row (task_id, completion), a ROLL batch (responses, scores) or a "
        f"prime-rl episode (task, traces), got keys {sorted(row)}"
    )


def _as_sent(trajectory: Any, limits: BatchLimits) -> tuple[Hashable | None, Any, int, bool]:
    """(its group, the trajectory as it will be sent, its bytes in a body with its comma, whether it was cut).

    As sent: cut to the limits as ``encode`` cuts it (``batches.within_limits``), so the step holds no uncut text
    and its groups are counted at the size they will take. Its group is pinned (a ``group_id``) where it was its
    prompt, or a long text: a prompt cut to its last characters might no longer tell two groups apart, and a long
    key would keep the uncut text in memory. A trajectory not well formed has no group (None: it joins no group's
    fate) and is kept as it is; normalize names it when it is logged.
    """
    turns = trajectory.get("turns") if isinstance(trajectory, Mapping) else None
    if not isinstance(trajectory, Mapping) or not (
        turns is None or (isinstance(turns, list) and turns and all(isinstance(turn, Mapping) for turn in turns))
    ):
        return None, trajectory, _json_size(trajectory), False
    if turns is None:  # the single-turn shorthand: the trajectory is its own turn
        sent: Mapping[str, Any] = within_limits({"turns": [trajectory]}, limits)["turns"][0]
    else:
        sent = within_limits(trajectory, limits)
    is_cut = sent is not trajectory
    raw_group = group_of(trajectory)
    group = _bounded(raw_group)
    given = next((trajectory[key] for key in GROUP_KEYS if trajectory.get(key) is not None), None)
    if given is None or (isinstance(given, str) and group is not raw_group):
        sent = {**sent, "group_id": group}
    try:
        [row] = normalize([sent])
    except TrajectoryError:  # not well formed after all
        return None, trajectory, _json_size(trajectory), False
    # The group id a body holds: the trajectory's own integer, else an index under max_trajectories (at most).
    if not (isinstance(given, int) and not isinstance(given, bool)):
        row["group_id"] = limits.max_trajectories - 1
    return group, sent, len(json_bytes(row)) + 1, is_cut


def _json_size(trajectory: Any) -> int:
    """The bytes of a trajectory ``normalize`` refuses, near enough."""
    text = json.dumps(trajectory, separators=(",", ":"), ensure_ascii=False, default=str)
    return len(text.encode("utf-8", "replace")) + 1  # + its comma


def _bounded(key: Hashable) -> Hashable:
    """A group's key in at most ``MAX_KEY_CHARS`` characters: a longer text as its opening and a digest of it."""
    if not isinstance(key, str) or len(key) <= MAX_KEY_CHARS:
        return key
    return f"{key[: MAX_KEY_CHARS - 20]}... #{hashlib.sha256(key.encode('utf-8', 'replace')).hexdigest()[:12]}"


def _areal_trajectory(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One AReaL sample: its task is its group (AReaL runs one task per prompt, ``n_samples`` times)."""
    task = row["task_id"]
    if isinstance(task, bool) or not isinstance(task, (int, str)):
        raise DumpError(f"{where}: task_id must be an integer or a string, got {task!r}")
    return {
        "group_id": task,
        "reward": _score(row.get("reward")),
        "turns": [{"prompt": str(row.get("prompt") or ""), "response": str(row["completion"] or "")}],
    }


def _roll_step(row: Mapping[str, Any], step: int | None, where: str) -> Any:
    steps = row.get("global_step")
    if steps is None:
        return step
    if not isinstance(steps, list) or not steps or len(set(map(repr, steps))) != 1:
        raise DumpError(f"{where}: global_step must be a non-empty list of one repeated step, got {steps!r}")
    return steps[0]


def _roll_trajectories(row: Mapping[str, Any], where: str, render: Render) -> list[dict[str, Any]]:
    """ROLL's columns as trajectories: one per response, grouped by ``id`` (else by prompt)."""
    responses, scores = row["responses"], row["scores"]
    prompt_column = "messages" if row.get("messages") is not None else "prompt"
    columns = {"responses": responses, "scores": scores, prompt_column: row.get(prompt_column)}
    if row.get("id") is not None:
        columns["id"] = row["id"]
    for name, values in columns.items():
        if not isinstance(values, list) or len(values) != len(responses):
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise DumpError(f"{where}: ROLL column {name} must be a list of {len(responses)} values, got {got}")
    out = []
    for i, response in enumerate(responses):
        prompt = columns[prompt_column][i]
        if prompt_column == "messages":
            try:
                conversation = json.loads(prompt) if isinstance(prompt, str) else prompt
            except json.JSONDecodeError as e:
                raise DumpError(f"{where}: messages[{i}] is not JSON: {e}") from e
            if not is_conversation(conversation):
                raise DumpError(f"{where}: messages[{i}] must be a list of chat messages, got {prompt!r:.80}")
            text = render(conversation)
        else:
            text = "" if prompt is None else str(prompt)
        out.append(
            {
                "group_id": columns["id"][i] if "id" in columns else text,
                "reward": _score(scores[i]),
                "turns": [{"prompt": text, "response": "" if response is None else str(response)}],
            }
        )
    return out


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


def _verl_row_within(row: Mapping[str, Any], limits: BatchLimits) -> Mapping[str, Any]:
    """A verl row of a multi-turn session with its texts cut to the limits, as its turn will be sent."""
    turn = within_limits({"turns": [{"prompt": row["input"], "response": row["output"]}]}, limits)["turns"][0]
    return {**row, "input": turn["prompt"], "output": turn["response"]}


def _verl_key(row: Mapping[str, Any], i: int) -> tuple[Any, Any, int]:
    """(group, session, turn index) of a row; see the module docstring."""
    uid = row.get("uid")
    if uid is None:
        return ("input", _bounded(row["input"])), ("row", i), 0
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
