"""One training step's trajectories as the service takes them: normalised, sampled, fitted to its limits and keyed.

Owns the batch wire format, client-side sampling, the service's batch limits as the client fits a
step to them, and the idempotency key derived from a batch's content. Pure Python: must not import
httpx, threads or the integrations.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

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
# Lists of one entry per token of a turn (ids, and the trainer's per-token floats), cut together with the ids.
TOKEN_LIST_KEYS = (*TOKEN_ID_KEYS, "token_entropies", "reasoning_logprobs")
CUT_KEYS = (*TEXT_KEYS, *TOKEN_LIST_KEYS)  # what ``shorten`` may cut
PROMPT_KEYS = ("prompt", "prompt_token_ids")  # cut to their last characters or ids, the others to their first
GROUP_KEYS = ("group_id", "group")
# What the service takes as a trainer's figures (docs/api.md, Trainer figures).
FIGURE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./:@-]{0,79}$")
MAX_FIGURES = 256
MAX_ABS_FIGURE = 1e15
# Room left in a body for all but its trajectories: the key (at most 200 characters), the step and up to
# MAX_FIGURES figures (~100 bytes each); half a body smaller than twice this.
HEAD_BYTES = 64 * 1024
MIN_BODY_BYTES = 1024  # the least max_body_bytes the service may be configured with
LIMIT_NAMES = ("max_body_bytes", "max_trajectories", "max_turns", "max_text_chars", "max_token_ids")

T = TypeVar("T")


@dataclass(frozen=True)
class BatchLimits:
    """What one batch may hold: the service's defaults (service/settings.py, docs/settings.md).

    The service refuses a whole batch past any of them (413); the client fits a step to them instead:
    whole groups past the body's size or trajectory count are left out (``GroupFit``), a text or token-id
    list past its limit, or a trajectory past the body alone, is cut (``shorten``), and readers of long
    traces cut what one turn or trajectory holds (``prime_rl_traces``). A monitor learns the limits its
    service enforces when it creates its run, and from a 413 naming one (``told``), so a service
    configured with other limits needs none given; limits given (``Monitor(limits=...)``,
    ``--max-body-bytes``) are kept where they are smaller than the service's.
    """

    max_body_bytes: int = 32 * 1024 * 1024
    max_trajectories: int = 4096
    max_turns: int = 256
    max_text_chars: int = 400_000
    max_token_ids: int = 65_536

    def __post_init__(self) -> None:
        if self.max_body_bytes < MIN_BODY_BYTES:
            raise ValueError(f"max_body_bytes must be at least {MIN_BODY_BYTES}, got {self.max_body_bytes}")
        for name in ("max_trajectories", "max_turns", "max_text_chars", "max_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def trajectory_bytes(self) -> int:
        """Bytes the trajectories of one body may take: the body less room for its key, step and figures."""
        return self.max_body_bytes - min(HEAD_BYTES, self.max_body_bytes // 2)

    def told(self, service: Any, is_given: bool = True) -> BatchLimits:
        """These limits with the service's (``service``: the ``limits`` of its answer to ``POST /v1/runs``, or
        ``{limit: allowed}`` of a 413) put in: where ``is_given``, each only where the service's is smaller
        (the service's are what it enforces), else in place of the default. Names and values the client does not
        take (a newer or an older service) leave these as they are."""
        told = {
            name: value
            for name, value in (service.items() if isinstance(service, Mapping) else ())
            if name in LIMIT_NAMES
            and type(value) is int  # a bool is no limit
            and value >= (MIN_BODY_BYTES if name == "max_body_bytes" else 1)
            and (value < getattr(self, name) or not is_given)
        }
        return replace(self, **told) if told else self


class GroupFit(Generic[T]):
    """Whole prompt groups, in order of first appearance, while they fit one body.

    ``add`` takes trajectories one at a time with their group and encoded size; one that would pass
    ``max_bytes`` or ``max_trajectories`` leaves its whole group out, the rows of it kept so far too
    (freed at once), so every kept group keeps its reward spread; later groups may still fit. Holds at
    most ``max_bytes`` of kept items, whatever it is given.
    """

    def __init__(self, max_bytes: int, max_trajectories: int) -> None:
        self.max_bytes = max_bytes
        self.max_trajectories = max_trajectories
        self.n_kept = 0
        self.kept_bytes = 0
        self.n_cut = 0  # trajectories whose texts or token lists were cut to fit (``encode``)
        self.left_out: dict[Hashable, int] = {}  # group -> its trajectories left out
        self._groups: dict[Hashable, list[tuple[int, T, int]]] = {}  # group -> (arrival, item, bytes)
        self._arrivals = 0

    def add(self, group: Hashable, item: T, n_bytes: int) -> None:
        self._arrivals += 1
        if group in self.left_out:
            self.left_out[group] += 1
            return
        if self.n_kept + 1 > self.max_trajectories or self.kept_bytes + n_bytes > self.max_bytes:
            dropped = self._groups.pop(group, [])
            self.n_kept -= len(dropped)
            self.kept_bytes -= sum(size for _, _, size in dropped)
            self.left_out[group] = len(dropped) + 1
            return
        self._groups.setdefault(group, []).append((self._arrivals, item, n_bytes))
        self.n_kept += 1
        self.kept_bytes += n_bytes

    def items(self) -> list[T]:
        """The kept items, in the order they were added."""
        return [item for _, item, _ in sorted((e for g in self._groups.values() for e in g), key=lambda e: e[0])]

    def describe_left_out(self, limit: int = 5) -> str:
        """``3 groups (12 trajectories): 'g1', 'g2', 'g7'`` for a log line; the first ``limit`` named, each in at
        most 80 characters (a group without an id is named by its prompt)."""
        names = (repr(g) for g in list(self.left_out)[:limit])
        named = ", ".join(name if len(name) <= 80 else f"{name[:77]}..." for name in names)
        more = f" and {len(self.left_out) - limit} more" if len(self.left_out) > limit else ""
        return f"{len(self.left_out)} groups ({sum(self.left_out.values())} trajectories): {named}{more}"


def group_of(trajectory: Mapping[str, Any]) -> Hashable:
    """The key that makes a trajectory's group before ``normalize`` (its group id, else its first prompt)."""
    for key in GROUP_KEYS:
        if trajectory.get(key) is not None:
            value = _as_list(trajectory[key])
            return value if isinstance(value, Hashable) else repr(value)
    turns = trajectory.get("turns")
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], Mapping) else trajectory
    prompt = first.get("prompt")
    return prompt if isinstance(prompt, str) else repr(first.get("prompt_token_ids"))


def json_bytes(value: Any) -> bytes:
    """The canonical JSON of ``value`` as bodies hold it: sorted keys, no spaces, UTF-8.

    A lone surrogate (undecodable bytes a tokenizer let through) has no UTF-8 form; written as a
    JSON escape it stays valid JSON and the service decides what to do with it.
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "backslashreplace")


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
            try:
                values = [float(v) for v in _as_list(out[key])]
            except (TypeError, ValueError, OverflowError) as e:
                raise TrajectoryError(f"{where}.{key} must hold numbers: {e}") from e
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
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: an infinity (1e400 in a JSON file)
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


def shorten(trajectory: Mapping[str, Any], caps: Mapping[str, int]) -> dict[str, Any] | None:
    """A copy of a normalized ``trajectory`` whose texts and token lists named in ``caps`` hold at most their
    cap (at least 1) of characters or entries, or None when none holds more.

    A prompt keeps its last characters or ids (a scorer keeps a long prompt's last tokens too); a response,
    a reasoning and the per-token lists of the response keep their first (the reasoning window scores a
    reasoning's opening), so a reasoning's ids and the trainer's log-probs of them stay one per token.
    """
    turns = []
    is_cut = False
    for turn in trajectory["turns"]:
        cut = {}
        for name, cap in caps.items():
            value = turn.get(name)
            if isinstance(value, (str, list)) and len(value) > cap:
                cut[name] = value[-cap:] if name in PROMPT_KEYS else value[:cap]
        turns.append({**turn, **cut} if cut else turn)
        is_cut = is_cut or bool(cut)
    return {**trajectory, "turns": turns} if is_cut else None


def limit_caps(limits: BatchLimits) -> dict[str, int]:
    """The caps (``shorten``) of the service's per-field limits: ``max_text_chars``, ``max_token_ids``."""
    return {**dict.fromkeys(TEXT_KEYS, limits.max_text_chars), **dict.fromkeys(TOKEN_LIST_KEYS, limits.max_token_ids)}


def caps(trajectories: Sequence[Mapping[str, Any]], fraction: float, keys: Sequence[str] = CUT_KEYS) -> dict[str, int]:
    """The caps (``shorten``) of the fields ``keys`` that keep about ``fraction`` of what ``trajectories`` hold
    of them: one for texts (characters), one for token lists (entries); the longest are cut first, to one
    length, so short ones stay whole."""
    sizes: dict[bool, list[int]] = {True: [], False: []}  # is it text -> the lengths
    for trajectory in trajectories:
        for turn in trajectory["turns"]:
            for key in keys:
                value = turn.get(key)
                if isinstance(value, (str, list)):
                    sizes[isinstance(value, str)].append(len(value))
    cap = {is_text: _cap(lengths, fraction * sum(lengths)) for is_text, lengths in sizes.items()}
    return {key: cap[key in TEXT_KEYS] for key in keys}


def _cap(sizes: list[int], budget: float) -> int:
    """The largest ``c >= 1`` with ``sum(min(s, c) for s in sizes) <= budget`` (water-filling)."""
    below = 0  # the sizes under the cap, whole
    ordered = sorted(sizes)
    for i, size in enumerate(ordered):
        if below + size * (len(ordered) - i) > budget:
            return max(1, int((budget - below) // (len(ordered) - i)))
        below += size
    return max(ordered, default=1)


# A trajectory past one body alone is cut this many times at most (each to 90% of what the last cut left over):
# its JSON shrinks about as its texts and ids do, so one cut mostly suffices.
MAX_CUTS = 4


def within_limits(trajectory: Mapping[str, Any], limits: BatchLimits) -> Mapping[str, Any]:
    """The trajectory with its first ``max_turns`` turns and its texts and token lists cut to their limits
    (``shorten``); itself when none is past them. ``encode`` sends each trajectory so, and readers of step files
    keep each so (``dumps``), so that they size it as it will be sent."""
    current: Mapping[str, Any] = trajectory
    if len(trajectory["turns"]) > limits.max_turns:
        current = {**trajectory, "turns": trajectory["turns"][: limits.max_turns]}
    return shorten(current, limit_caps(limits)) or current


def _piece(trajectory: Mapping[str, Any], limits: BatchLimits) -> tuple[bytes, bool]:
    """The trajectory's JSON in a body, and whether it was cut: ``within_limits`` and, past the body alone, cut
    further (``caps``) until it fits."""
    current = within_limits(trajectory, limits)
    piece = json_bytes(current)
    for _ in range(MAX_CUTS):
        if len(piece) + 1 <= limits.trajectory_bytes:
            break
        shorter = shorten(current, caps([current], 0.9 * limits.trajectory_bytes / len(piece)))
        if shorter is None:
            break  # nothing left to cut: sent as it is, and refused
        current = shorter
        piece = json_bytes(current)
    return piece, current is not trajectory


def refit(run: str, body: bytes, fraction: float, keys: Sequence[str] = CUT_KEYS) -> tuple[str, bytes]:
    """A batch's body with its fields ``keys`` (texts and token lists) cut to about ``fraction`` of what they
    hold (``caps``), under the key of its new content: a body the service refused for its scoring cost,
    refitted to it.

    Deterministic, so a refit replayed after a restart is recognised as the same batch.
    """
    batch = json.loads(body)
    limits = caps(batch["trajectories"], fraction, keys)
    batch["trajectories"] = [shorten(t, limits) or t for t in batch["trajectories"]]
    batch.pop("idempotency_key", None)
    return _keyed(run, batch["step"], json_bytes(batch), None)


def refit_to_limits(run: str, body: bytes, limits: BatchLimits) -> tuple[str, bytes, GroupFit[bytes]]:
    """A batch's body fitted again to ``limits`` (``encode``), under the key of its new content: a body the
    service refused for a batch limit it enforces (413), fitted before the client knew it, refitted to it.

    Deterministic, so a refit replayed after a restart is recognised as the same batch.
    """
    batch = json.loads(body)
    return encode(run, batch["step"], batch["trajectories"], None, batch.get("figures"), limits)


def _keyed(run: str, step: int, data: bytes, idempotency_key: str | None) -> tuple[str, bytes]:
    """The key (given, else ``{run}-{step}-{content hash}``) and the body: ``data`` (canonical JSON) with the key."""
    key = idempotency_key or f"{run}-{step}-{hashlib.sha256(data).hexdigest()[:16]}"
    return key, b'{"idempotency_key":' + json.dumps(key).encode() + b"," + data[1:]


def encode(
    run: str,
    step: int,
    trajectories: list[dict[str, Any]],
    idempotency_key: str | None = None,
    figures: Mapping[str, float] | None = None,
    limits: BatchLimits | None = None,
) -> tuple[str, bytes, GroupFit[bytes]]:
    """The request body of one batch, its idempotency key and what was fitted to ``limits``.

    ``figures``: the trainer's own figures of the step (``sendable_figures``), sent with it. The key is
    ``{run}-{step}-{content hash}``: a replay of the same batch (a retry, a spooled copy,
    a resumed trainer sending a step again) is recognised by the service, while other content at the
    same step (a re-run under the same run name) is a new batch instead of a 409 conflict. The
    content is canonical JSON (``json_bytes``), so equal batches hash equally.

    A trajectory's turns, texts and token lists past their limits are cut (``_piece``; ``fit.n_cut``
    counts the trajectories cut), so that no one of them makes the whole batch refused. Whole groups
    past the body's size or trajectory count are left out (``fit.left_out``: group id -> trajectories):
    the service scores the groups of one body together, so a step sent as two bodies would be two
    scorings of halves, not one. When not even one whole group fits, the first group's trajectories
    that fit are sent.
    """
    limits = limits or BatchLimits()
    fit: GroupFit[bytes] = GroupFit(limits.trajectory_bytes, limits.max_trajectories)
    for trajectory in trajectories:
        piece, is_cut = _piece(trajectory, limits)
        fit.n_cut += is_cut
        fit.add(trajectory["group_id"], piece, len(piece) + 1)  # + its comma
    pieces = fit.items()
    if not pieces:  # no whole group fits: the first group's trajectories that do, else its first alone
        first = trajectories[0]["group_id"]
        budget = limits.trajectory_bytes
        for trajectory in (t for t in trajectories if t["group_id"] == first):
            piece, _ = _piece(trajectory, limits)
            if len(piece) + 1 <= budget and len(pieces) < limits.max_trajectories:
                pieces.append(piece)
                budget -= len(piece) + 1
        pieces = pieces or [_piece(trajectories[0], limits)[0]]
        fit.left_out[first] -= len(pieces)
        if not fit.left_out[first]:
            del fit.left_out[first]
    # The keys in canonical order ("figures" < "step" < "trajectories"): equal to json_bytes of the whole.
    head = json_bytes({"step": step, **({"figures": dict(figures)} if figures else {})})
    data = b"".join([head[:-1], b',"trajectories":[', b",".join(pieces), b"]}"])
    return (*_keyed(run, step, data, idempotency_key), fit)
