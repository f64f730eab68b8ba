"""One training step's trajectories as the service takes them: normalised, sampled and keyed.

Owns the batch wire format, client-side sampling and the idempotency key derived from a batch's
content. Pure Python: must not import httpx, threads or the integrations.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

# A turn given at the top level of a trajectory (single-turn shorthand) is made of these keys.
TURN_KEYS = (
    "prompt",
    "prompt_token_ids",
    "response",
    "reasoning",
    "reasoning_token_ids",
    "token_entropies",
    "reasoning_logprobs",
)
TEXT_KEYS = ("prompt", "response", "reasoning")
TOKEN_ID_KEYS = ("prompt_token_ids", "reasoning_token_ids")
GROUP_KEYS = ("group_id", "group")
# What the service takes as a trainer's figures (docs/api.md, Trainer figures).
FIGURE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./:@-]{0,79}$")
MAX_FIGURES = 256
MAX_ABS_FIGURE = 1e15


class TrajectoryError(ValueError):
    """A trajectory that cannot be sent; the message names it (``trajectories[3].turns[0].prompt``)."""


def normalize(trajectories: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Wire-format copies of ``trajectories``: integer group ids, float-or-null rewards, plain lists.

    A trajectory is a mapping with ``group_id`` (any hashable; ``group`` is an alias; default: its
    first prompt, so identical prompts form one group), ``reward`` (a number; ``None``, NaN or an
    infinity are sent as null, a missing reward) and ``turns`` (mappings with ``prompt`` or
    ``prompt_token_ids`` and ``response``, ``reasoning`` or ``reasoning_token_ids``). A single turn
    may be given at the top level instead of ``turns``. Keys the client does not know are passed
    through, so newer service fields need no client release. Token ids may be any sequence of
    ints, or anything with ``tolist()`` (tensors, arrays).

    Group ids that are all ints are kept; otherwise each distinct group gets 0, 1, ... in order of
    first appearance.

    Raises:
        TrajectoryError: naming the first trajectory that is not well formed.
    """
    if isinstance(trajectories, (str, bytes, Mapping)) or not isinstance(trajectories, Sequence):
        raise TrajectoryError(f"trajectories must be a sequence of mappings, got {type(trajectories).__name__}")
    if not trajectories:
        raise TrajectoryError("trajectories must hold at least one trajectory, got none")
    out: list[dict[str, Any]] = []
    keys: list[Hashable] = []
    for i, trajectory in enumerate(trajectories):
        where = f"trajectories[{i}]"
        if not isinstance(trajectory, Mapping):
            raise TrajectoryError(f"{where} must be a mapping, got {type(trajectory).__name__}")
        raw_turns = trajectory.get("turns")
        if raw_turns is None:
            raw_turns = [{k: trajectory[k] for k in TURN_KEYS if k in trajectory}]
        elif isinstance(raw_turns, (str, bytes, Mapping)) or not isinstance(raw_turns, Sequence) or not raw_turns:
            raise TrajectoryError(f"{where}.turns must be a non-empty list of turns")
        turns = [_turn(turn, f"{where}.turns[{k}]") for k, turn in enumerate(raw_turns)]
        passed = {k: v for k, v in trajectory.items() if k not in GROUP_KEYS and k != "turns" and k not in TURN_KEYS}
        passed["reward"] = _reward(trajectory.get("reward"), where)
        passed["turns"] = turns
        keys.append(_group_key(trajectory, turns[0], where))
        out.append(passed)
    for trajectory, group_id in zip(out, _group_ids(keys)):
        trajectory["group_id"] = group_id
    return out


def _turn(turn: Any, where: str) -> dict[str, Any]:
    if not isinstance(turn, Mapping):
        raise TrajectoryError(f"{where} must be a mapping, got {type(turn).__name__}")
    out = dict(turn)
    if "prompt" not in out and "prompt_token_ids" not in out:
        raise TrajectoryError(f"{where} needs a prompt (text) or prompt_token_ids")
    if not any(k in out for k in ("response", "reasoning", "reasoning_token_ids")):
        raise TrajectoryError(f"{where} needs a response, a reasoning or reasoning_token_ids")
    for key in TEXT_KEYS:
        if key in out:
            if not isinstance(out[key], str):
                raise TrajectoryError(f"{where}.{key} must be a string, got {type(out[key]).__name__}")
            out[key] = _storable(out[key])
    for key in TOKEN_ID_KEYS:
        if key in out:
            out[key] = _token_ids(out[key], f"{where}.{key}")
    # Per-token floats the trainer already has (tensors or arrays welcome): sent as plain finite numbers.
    for key in ("token_entropies", "reasoning_logprobs"):
        if out.get(key) is not None:
            values = [float(v) for v in _as_list(out[key])]
            if not all(math.isfinite(v) for v in values):
                raise TrajectoryError(f"{where}.{key} must be finite numbers")
            out[key] = values
    return out


def _storable(text: str) -> str:
    """``text`` with NUL characters and lone surrogates replaced by U+FFFD.

    A sampled response can hold either (a policy emitting token 0, undecodable bytes a tokenizer let
    through); no database stores them as text and the service refuses them, which would lose the
    whole step. One replaced character barely moves a sequence's score.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Paired surrogates become their character again; lone ones become U+FFFD.
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _as_list(values: Any) -> Any:
    # Tensors and arrays convert to plain lists in one C call; iterating them element-wise is slow.
    tolist = getattr(values, "tolist", None)
    return tolist() if callable(tolist) else values


def _token_ids(values: Any, where: str) -> list[int]:
    values = _as_list(values)
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise TrajectoryError(f"{where} must be a list of token ids, got {type(values).__name__}")
    try:
        ids = [int(v) for v in values]
    except (TypeError, ValueError) as e:
        raise TrajectoryError(f"{where} must hold integers: {e}") from e
    return ids


def _reward(value: Any, where: str) -> float | None:
    if value is None:
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError) as e:
        raise TrajectoryError(f"{where}.reward must be a number or None, got {value!r}") from e
    # NaN and infinities cannot travel as JSON; the service counts null rewards as missing.
    return reward if math.isfinite(reward) else None


def _group_key(trajectory: Mapping[str, Any], first_turn: Mapping[str, Any], where: str) -> Hashable:
    for key in GROUP_KEYS:
        if trajectory.get(key) is not None:
            value = _as_list(trajectory[key])
            if not isinstance(value, Hashable):
                raise TrajectoryError(f"{where}.{key} must be hashable, got {type(value).__name__}")
            return value
    prompt = first_turn.get("prompt")
    return prompt if prompt is not None else ("ids", *first_turn["prompt_token_ids"])


def _group_ids(keys: list[Hashable]) -> list[int]:
    ints = [k for k in keys if isinstance(k, int) and not isinstance(k, bool)]
    if len(ints) == len(keys):
        return ints
    index: dict[Hashable, int] = {}
    return [index.setdefault(k, len(index)) for k in keys]


def sample_indices(
    group_ids: Sequence[Hashable], *, max_groups: int | None, max_rows: int | None, seed: int, step: int
) -> list[int]:
    """Rows to keep, in their original order: at most ``max_groups`` groups, then at most ``max_rows`` rows.

    Groups are drawn uniformly without replacement; rows are then capped by keeping whole groups
    (in the same random order) while they fit, so the reward spread of every kept group stays
    intact. Only when the first drawn group alone exceeds ``max_rows`` are its rows subsampled.
    The draw depends only on ``(seed, step)`` and the group layout, so a replayed step keeps
    exactly the same rows (and so the same batch key).
    """
    n = len(group_ids)
    if (max_groups is None or max_groups <= 0) and (max_rows is None or max_rows <= 0):
        return list(range(n))
    rows_of: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        rows_of.setdefault(g, []).append(i)
    if (max_groups is None or len(rows_of) <= max_groups) and (max_rows is None or n <= max_rows):
        return list(range(n))
    # A string seed is hashed with SHA-512 by `random`, so draws agree across processes and runs.
    rng = random.Random(f"collapse-monitor:{seed}:{step}")
    order = list(rows_of)
    rng.shuffle(order)
    if max_groups is not None and max_groups > 0:
        order = order[:max_groups]
    kept: list[int] = []
    if max_rows is None or max_rows <= 0:
        for g in order:
            kept.extend(rows_of[g])
        return sorted(kept)
    for g in order:
        rows = rows_of[g]
        if len(kept) + len(rows) <= max_rows:
            kept.extend(rows)
    if not kept:
        kept = rng.sample(rows_of[order[0]], max_rows)
    return sorted(kept)


def sendable_figures(figures: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """The figures the service takes (name -> float, in the given order) and why each other one is left out.

    A figure is a number (anything ``float()`` takes: ints, numpy and torch scalars) that is finite and
    within +-1e15, under a name of letters, digits and ``_ . / : @ -`` of at most 80 characters; at most
    256 are sent, the first ones given.
    """
    kept: dict[str, float] = {}
    left_out: dict[str, str] = {}
    for name, raw in figures.items():
        try:
            value = float(raw)
        except (TypeError, ValueError):
            left_out[str(name)] = f"not a number ({type(raw).__name__})"
            continue
        if not isinstance(name, str) or not FIGURE_NAME.match(name):
            left_out[str(name)] = f"the name must match {FIGURE_NAME.pattern}"
        elif not (math.isfinite(value) and abs(value) <= MAX_ABS_FIGURE):
            left_out[name] = f"{value} is not a finite number within +-{MAX_ABS_FIGURE:g}"
        elif len(kept) == MAX_FIGURES:
            left_out[name] = f"over the {MAX_FIGURES} figures a request may hold"
        else:
            kept[name] = value
    return kept, left_out


def encode(
    run: str,
    step: int,
    trajectories: list[dict[str, Any]],
    idempotency_key: str | None = None,
    figures: Mapping[str, float] | None = None,
) -> tuple[str, bytes]:
    """The request body of one batch and its idempotency key (``idempotency_key``).

    ``figures``: the trainer's own figures of the step (``sendable_figures``), sent with it. The key is
    ``{run}-{step}-{content hash}``: a replay of the same batch (a retry, a spooled copy,
    a resumed trainer sending a step again) is recognised by the service, while other content at the
    same step (a re-run under the same run name) is a new batch instead of a 409 conflict. The
    content is canonical JSON (sorted keys, no spaces), so equal batches hash equally.
    """
    content = json.dumps(
        {"step": step, "trajectories": trajectories, **({"figures": dict(figures)} if figures else {})},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    # A lone surrogate (undecodable bytes a tokenizer let through) has no UTF-8 form; written as a
    # JSON escape it stays valid JSON and the service decides what to do with it.
    data = content.encode("utf-8", "backslashreplace")
    key = idempotency_key or f"{run}-{step}-{hashlib.sha256(data).hexdigest()[:16]}"
    return key, b'{"idempotency_key":' + json.dumps(key).encode() + b"," + data[1:]
