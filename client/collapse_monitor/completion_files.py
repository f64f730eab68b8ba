"""TRL's completion files, what ``GRPOTrainer`` writes with ``log_completions=True``, read back as batches.

TRL 1.16 writes ``OUTPUT_DIR/completions/completions_{step:05d}.parquet`` from the main process at
every logging step (``logging_steps``): the latest generation batch, gathered from every process,
as the columns ``step`` (the global step), ``prompt``, ``completion``, one column per reward
function (its name; NaN where the function returned None), the columns of ``log_extra``, and
``advantage``. Prompts and completions are chat message lists for conversational datasets
(a completion holds the tool messages of a tool-calling policy too), strings otherwise.

What becomes of them:

* **groups**: rows with identical prompts (TRL repeats each prompt ``num_generations`` times), as
  for verl dumps; a prompt present twice in one batch of the dataset makes one group of both.
* **reward**: the sum of the reward columns, skipping missing values (NaN, null), null when all are
  missing. TRL's own total weighs them with ``reward_weights``, which the file does not hold: pass
  them as ``weights`` (a list in column order, or names to weights, which also picks the columns).
  Reward columns are the columns between ``completion`` and ``advantage`` holding only numbers,
  so a numeric ``log_extra`` column counts as one unless ``weights`` names the columns.
* **prompt text**: a string prompt as is; a conversation rendered by ``render`` (a model's chat
  template, ``chat_template_from``) or else by ``conversations.render_plain``. Multi-turn
  completions give one turn per assistant message, as the TRL integration sends them.
* **step**: the ``step`` column.

Reading needs pyarrow (the ``parquet`` extra), imported only here and only when a file is read.
Must not import httpx or the monitor.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from collapse_monitor.conversations import Render, assistant_turns, is_conversation, render_plain

FILE_NAME = re.compile(r"^completions_(\d+)\.parquet$")
FIXED_COLUMNS = ("step", "prompt", "completion", "advantage")
Weights = Union[Sequence[float], Mapping[str, float], None]


class CompletionFileError(ValueError):
    """A completion file that cannot be read or does not hold what TRL writes; the message names the file."""


class MissingExtraError(RuntimeError):
    """pyarrow (or transformers, for a chat template) is not installed."""


def file_step(path: Path) -> int | None:
    """The step in a completion file's name (``completions_00012.parquet`` -> 12), else None."""
    match = FILE_NAME.match(path.name)
    return int(match.group(1)) if match else None


def read_rows(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The column names and rows of a parquet file."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingExtraError(
            "reading TRL completion files needs pyarrow: pip install 'collapse-monitor-client[parquet]'"
        ) from e
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise CompletionFileError(f"{path}: not a readable parquet file: {e}") from e
    return list(table.column_names), table.to_pylist()


def parse_weights(text: str) -> Weights:
    """``--reward-weights``: ``1,0.5`` (one per reward column, in order) or ``accuracy=1,format=0.5``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("--reward-weights: expected numbers (1,0.5) or names with weights (accuracy=1,format=0.5)")
    try:
        if all("=" in p for p in parts):
            named = {}
            for part in parts:
                name, _, value = part.partition("=")
                named[name.strip()] = float(value)
            return named
        if any("=" in p for p in parts):
            raise ValueError("mixes numbers and name=weight pairs")
        return [float(p) for p in parts]
    except ValueError as e:
        raise ValueError(f"--reward-weights: cannot read {text!r}: {e}") from e


def reward_columns(columns: Sequence[str], rows: Sequence[Mapping[str, Any]], weights: Weights) -> dict[str, float]:
    """The reward columns and their weights (see the module docstring); raises CompletionFileError."""
    if isinstance(weights, Mapping):
        missing = sorted(set(weights) - set(columns))
        if missing:
            raise CompletionFileError(f"--reward-weights names {', '.join(missing)}, not columns of the file")
        bad = sorted(name for name in weights if not all(_is_number(row.get(name)) for row in rows))
        if bad:
            raise CompletionFileError(f"--reward-weights names {', '.join(bad)}, which hold values other than numbers")
        return {name: float(weights[name]) for name in weights}
    between = columns[columns.index("completion") + 1 : columns.index("advantage")]
    numeric = [name for name in between if all(_is_number(row.get(name)) for row in rows)]
    if weights is None:
        return dict.fromkeys(numeric, 1.0)
    if len(weights) != len(numeric):
        raise CompletionFileError(
            f"--reward-weights gives {len(weights)} weights; the file has {len(numeric)} reward columns "
            f"({', '.join(numeric) or 'none'}): give one per column, or name them (name=weight)"
        )
    return dict(zip(numeric, (float(w) for w in weights)))


def batches_of_file(path: Path, weights: Weights = None, render: Render | None = None) -> dict[int, list[Any]]:
    """Trajectories per step of one completion file (one step, as TRL writes them); raises CompletionFileError."""
    columns, rows = read_rows(path)
    missing = [c for c in FIXED_COLUMNS if c not in columns]
    if missing:
        raise CompletionFileError(f"{path}: lacks the column(s) {', '.join(missing)} TRL writes; columns: {columns}")
    rewards = reward_columns(columns, rows, weights)
    render = render or render_plain
    groups: dict[str, int] = {}
    by_step: dict[int, list[Any]] = {}
    for number, row in enumerate(rows):
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CompletionFileError(f"{path}: row {number} has step {step!r}, expected an integer of at least 0")
        prompt, completion = row["prompt"], row["completion"]
        key = json.dumps(prompt, sort_keys=True, default=str)
        group = groups.setdefault(key, len(groups))
        if is_conversation(prompt):
            turns = assistant_turns(prompt, completion, render)
        else:
            turns = [{"prompt": "" if prompt is None else str(prompt), "response": _plain(completion)}]
        if not turns:
            raise CompletionFileError(f"{path}: row {number}'s completion holds no assistant message")
        by_step.setdefault(step, []).append({"group_id": group, "reward": _total(row, rewards), "turns": turns})
    return by_step


def chat_template_from(model_dir: str) -> Render:
    """The chat template of a model folder (its tokenizer), with the generation prompt, as TRL applies it.

    Loads the tokenizer with transformers (in the trainer's environment already); the trainer's own
    ``chat_template`` override, ``chat_template_kwargs`` and tools are not known here.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise MissingExtraError("--chat-template-from needs transformers installed (pip install transformers)") from e
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--chat-template-from: the tokenizer in {model_dir} has no chat template")

    def render(conversation: list[Any]) -> str:
        return str(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True))

    return render


def _plain(completion: Any) -> str:
    if isinstance(completion, list):  # a conversational completion next to a string prompt: its text
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return "" if completion is None else str(completion)


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _total(row: Mapping[str, Any], rewards: Mapping[str, float]) -> float | None:
    parts = [w * float(v) for name, w in rewards.items() if _is_number(v := row.get(name)) and v is not None]
    finite = [p for p in parts if math.isfinite(p)]
    return sum(finite) if finite else None
