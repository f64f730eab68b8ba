"""slime's (and miles') rollout samples as trajectories: live ``Sample`` objects or their dumped dicts.

A rollout of slime is a flat list of ``Sample`` (slime/utils/types.py), each one sampled response:
``group_index`` (the prompt group: ``n_samples_per_prompt`` samples share it), ``index``,
``prompt`` (the text, chat template applied with ``--apply-chat-template``, else as the dataset
holds it: a string or a message list), ``tokens`` (prompt ids then response ids),
``response_length`` (the response ids at the end of ``tokens``), ``response`` (its text),
``loss_mask`` (per response token: 1 for model tokens, 0 for tool or environment tokens a
multi-turn rollout appended; None: all 1), ``reward`` (a number, or a dict read at
``args.reward_key``), ``rollout_id`` (set when several samples come from one rollout execution) and
``status``. ``--dump-details DIR`` saves ``{"rollout_id", "samples": [Sample.to_dict(), ...]}``
with ``torch.save`` to ``DIR/rollout_data/{rollout_id}.pt`` (``eval_{rollout_id}.pt`` for
evaluation); miles adds ``metadata``.

What becomes of a sample:

* **turns**: a response whose ``loss_mask`` has no 0 is one turn: ``prompt`` (a message list
  rendered by ``conversations.render_plain``) and ``response`` as text. A multi-turn response
  (runs of model tokens between tool tokens) is one turn per run of model tokens, its prompt
  every token before the run; the ids are decoded with ``decode`` (the policy's tokenizer,
  special tokens kept). With ``token_ids`` the ids themselves are sent: the prompt ids and each
  run's ids as the reasoning (for a scorer that shares the policy's tokenizer).
* **group**: ``group_index``. Samples sharing a ``rollout_id`` within a group are one trajectory,
  their turns in ``index`` order, the reward the last one's.
* **reward**: ``reward``, or ``reward[reward_key]`` for a dict.

A sample with no model token (an empty or fully masked response) carries nothing to score and is
left out. A multi-turn sample's turns are kept in order while they fit: at most ``MAX_TURNS``, and
their prompts and responses together at most ``max_token_ids`` ids (its first turn always): every
turn's prompt repeats all the turns before it, so 2,000 tool turns would otherwise cost the square
of the sample's length (a 64 MB batch for one sample, which the service refuses). Reading a dump
needs torch and unpickles the file, so it is done only for folders the caller trusts. Must not
import httpx or the monitor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from collapse_monitor.batches import BatchLimits
from collapse_monitor.completion_files import MissingExtraError
from collapse_monitor.conversations import is_conversation, render_plain
from collapse_monitor.dumps import DumpError

Decode = Callable[[list[int]], str]

# The service's defaults (docs/settings.md): a trajectory of more than max_turns turns, or a prompt of more
# than max_token_ids ids, is refused with the whole batch.
MAX_TURNS = BatchLimits.max_turns
MAX_SAMPLE_TOKEN_IDS = BatchLimits.max_token_ids


def trajectories(
    samples: Iterable[Any],
    *,
    reward_key: str | None = None,
    token_ids: bool = False,
    decode: Decode | None = None,
    max_token_ids: int = MAX_SAMPLE_TOKEN_IDS,
) -> list[dict[str, Any]]:
    """The trajectories of a rollout's samples (objects or ``to_dict()`` dicts); raises ValueError naming one.

    ``max_token_ids``: the ids a multi-turn sample's kept turns may hold together (see the module docstring).
    """
    out: list[dict[str, Any]] = []
    executions: dict[tuple[Any, Any], dict[str, Any]] = {}
    ordered = sorted(enumerate(samples), key=lambda s: (field(s[1], "index") is None, field(s[1], "index") or 0, s[0]))
    for position, sample in ordered:
        where = f"samples[{position}] (index {field(sample, 'index')})"
        turns = _turns(sample, token_ids, decode, max_token_ids, where)
        if not turns:
            continue
        reward = _reward(field(sample, "reward"), reward_key, where)
        group = field(sample, "group_index")
        execution = field(sample, "rollout_id")
        if execution is not None and (group, execution) in executions:
            joined = executions[(group, execution)]
            joined["turns"].extend(turns)
            joined["reward"] = reward
            continue
        trajectory = {"group_id": group, "reward": reward, "turns": turns}
        if execution is not None:
            executions[(group, execution)] = trajectory
        out.append(trajectory)
    return out


def read_dump(path: Path) -> tuple[int | None, list[Any]]:
    """``(rollout_id, samples)`` of a ``--dump-details`` file; unpickles it: only for trusted folders.

    Raises:
        MissingExtraError: torch is not installed.
        DumpError: the file is not a rollout dump as slime writes it.
    """
    try:
        import torch
    except ImportError as e:
        raise MissingExtraError(
            "reading slime dumps (.pt) needs torch (the trainer's environment has it): run there, or pip install torch"
        ) from e
    try:
        # weights_only=False: a dump holds Sample dicts (and numpy arrays), which torch's safe loader refuses.
        # The caller has been told the folder is trusted.
        data = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise DumpError(f"{path}: not a readable torch file: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise DumpError(f"{path}: expected a dict with a list of samples, as slime's --dump-details writes")
    rollout_id = data.get("rollout_id")
    return (rollout_id if isinstance(rollout_id, int) and not isinstance(rollout_id, bool) else None), data["samples"]


def field(sample: Any, name: str) -> Any:
    """A field of a ``Sample`` or of its ``to_dict()``."""
    return sample.get(name) if isinstance(sample, dict) else getattr(sample, name, None)


def _ids(value: Any) -> list[int]:
    tolist = getattr(value, "tolist", None)  # a tensor or an array: one C call
    value = tolist() if callable(tolist) else value
    return (
        list(value) if isinstance(value, list) and all(type(v) is int for v in value) else [int(v) for v in value or []]
    )


def _turns(sample: Any, token_ids: bool, decode: Decode | None, max_token_ids: int, where: str) -> list[dict[str, Any]]:
    n_response = int(field(sample, "response_length") or 0)
    raw_mask = field(sample, "loss_mask")
    if raw_mask is None:
        runs = [(0, n_response)] if n_response else []
    else:
        mask = _ids(raw_mask)
        if len(mask) != n_response:
            raise ValueError(f"{where}: loss_mask has {len(mask)} values for {n_response} response tokens")
        runs = _model_runs(mask)
    if not runs:
        return []
    if not token_ids and runs == [(0, n_response)]:  # one turn, sent as the text slime holds: no ids needed
        prompt = field(sample, "prompt")
        text = render_plain(prompt) if is_conversation(prompt) else ("" if prompt is None else str(prompt))
        return [{"prompt": text, "response": str(field(sample, "response") or "")}]
    tokens = _ids(field(sample, "tokens"))
    if n_response > len(tokens):
        raise ValueError(f"{where}: response_length {n_response} exceeds its {len(tokens)} tokens")
    prompt_ids, response_ids = tokens[: len(tokens) - n_response], tokens[len(tokens) - n_response :]
    runs = _fitting(runs, len(prompt_ids), max_token_ids)
    if token_ids:
        return [
            {"prompt_token_ids": prompt_ids + response_ids[:start], "reasoning_token_ids": response_ids[start:end]}
            for start, end in runs
        ]
    if decode is None:
        raise ValueError(
            f"{where}: a multi-turn sample (tool tokens between model tokens) is decoded turn by turn with the "
            "policy's tokenizer, and none was given"
        )
    return [
        {"prompt": decode(prompt_ids + response_ids[:start]), "response": decode(response_ids[start:end])}
        for start, end in runs
    ]


def _model_runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of 1s."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _fitting(runs: list[tuple[int, int]], n_prompt: int, max_token_ids: int) -> list[tuple[int, int]]:
    """The first runs whose turns (turn k: the prompt, the response up to its run's end) hold at most
    ``max_token_ids`` ids together, ``MAX_TURNS`` at most; the first run always."""
    kept, n_ids = runs[:1], n_prompt + runs[0][1]
    for start, end in runs[1:MAX_TURNS]:
        n_ids += n_prompt + end
        if n_ids > max_token_ids:
            break
        kept.append((start, end))
    return kept


def _reward(value: Any, reward_key: str | None, where: str) -> float | None:
    if isinstance(value, dict):
        if reward_key is None:
            raise ValueError(f"{where}: the reward is a dict ({sorted(value)}); name the key to read (reward_key)")
        if reward_key not in value:
            raise ValueError(f"{where}: the reward has no key {reward_key!r}; it has {sorted(value)}")
        value = value[reward_key]
    if value is None:
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: the reward must be a number, got {value!r}") from e
    return reward if math.isfinite(reward) else None


def tokenizer_decode(model_dir: str) -> Decode:
    """The decoding of a model folder's tokenizer, special tokens kept (loads it with transformers)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise MissingExtraError(
            "decoding multi-turn slime samples needs transformers (pip install transformers)"
        ) from e
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    return decode
