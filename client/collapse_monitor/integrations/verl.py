"""verl: one ``DataProto`` training batch (verl's PPO/GRPO trainer, or RAGEN's) as one monitor batch.

The two lines in ``RayPPOTrainer.fit`` (verl/trainer/ppo/ray_trainer.py), once the batch holds
its rewards (after ``batch.batch["token_level_scores"] = reward_tensor``)::

    monitor = Monitor(os.environ["COLLAPSE_MONITOR_URL"], self.config.trainer.experiment_name)  # before the loop
    log_batch(monitor, self.global_steps, batch, self.tokenizer)                                  # in the loop

To stop when an alert fires (verl has no callbacks), two more lines: before the loop
``alerts = watch_alerts(monitor)``, and right after ``is_last_step = self.global_steps >=
self.total_training_steps`` at the top of each step::

    is_last_step = is_last_step or alerts.should_stop(self.global_steps)

so the step during which TemplateCollapse was seen firing becomes the last one: verl saves its
checkpoint (when ``trainer.save_freq > 0``), validates and returns, as at its planned end.
``watch_alerts(monitor, save_on=("pending",))`` also asks for a checkpoint when the alert becomes
pending; ``if alerts.should_save(self.global_steps): self._save_checkpoint()`` after the actor
update takes it.

In RAGEN's ``RayAgentTrainer.fit`` (ragen/trainer/agent_trainer.py) the second line goes right
after ``batch = self.agent_proxy.rollout(batch, val=False)``, where RAGEN computes its own collapse
metrics: before its rollout filter, so the service sees (and advises on) every group.

What is read from the batch, per row (one row is one trajectory):

* **turns**: RAGEN's ``all_turns_prompt_ids`` / ``all_turns_reasoning_ids`` when present (the exact
  X and Z RAGEN scores, multi-turn), else ``first_turn_prompt_ids`` / ``first_turn_reasoning_ids``;
  otherwise the tensors: ``prompts`` (left-padded; when absent, the head of ``input_ids`` before
  ``responses``), ``responses`` and ``attention_mask``, split into turns at the runs of
  ``response_mask`` (verl's agent loop marks model tokens 1 and tool or environment tokens 0; RAGEN
  marks assistant turns in ``loss_mask``): turn k's response is its run of model tokens and its
  prompt everything before the run.
* **reward**: the row sum of ``token_level_scores``, else ``rm_scores``, else ``token_level_rewards``;
  or a per-row non-tensor column named by ``reward_key``. NaN is sent as a missing reward.
* **group**: non-tensor ``uid`` (verl GRPO), else ``group_ids`` (RAGEN), else identical prompts.

Token ids are decoded with the tokenizer (special tokens kept, so chat-template markers and think
tags survive; trailing EOS and padding dropped) and the service tokenizes the text with its
scorer; ``token_ids=True`` sends the ids instead, for a scorer that shares the policy's tokenizer
(``scorer_mode="policy"``). Rows are sampled (``max_groups``, ``max_rows`` of the monitor) before
anything is decoded. Needs neither torch nor numpy imported here: tensors and arrays are read
through ``tolist()``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import Any

from collapse_monitor.alerts import AlertActions
from collapse_monitor.monitor import Monitor

REWARD_TENSORS = ("token_level_scores", "rm_scores", "token_level_rewards")


def watch_alerts(
    monitor: Monitor,
    *,
    stop_on: Collection[str] = ("firing",),
    save_on: Collection[str] = (),
    rules: Iterable[str] | None = ("TemplateCollapse",),
    interval: float = 10.0,
) -> AlertActions:
    """Watches the run's alerts in the background; the loop asks ``should_stop(step)`` / ``should_save(step)``.

    Neither call touches the network: they read what the watcher thread queued (see the module
    docstring for where they go in ``RayPPOTrainer.fit``).
    """
    return AlertActions.watch(monitor, save_on=save_on, stop_on=stop_on, rules=rules, interval=interval)


def log_batch(
    monitor: Monitor,
    step: int,
    batch: Any,
    tokenizer: Any = None,
    *,
    token_ids: bool = False,
    reward_key: str | None = None,
) -> None:
    """Sends one training batch; never raises unless the monitor is strict (see ``trajectories``)."""
    try:
        rows = trajectories(
            batch,
            tokenizer,
            token_ids=token_ids,
            reward_key=reward_key,
            select=lambda g: monitor.sample_indices(step, g),
        )
    except (KeyError, ValueError, TypeError) as e:
        monitor.invalid(step, f"cannot read the verl batch: {e!r}", e)
        return
    monitor.log(step, rows)


def trajectories(
    batch: Any,
    tokenizer: Any = None,
    *,
    token_ids: bool = False,
    reward_key: str | None = None,
    select: Any = None,
) -> list[dict[str, Any]]:
    """The rows of a ``DataProto`` as monitor trajectories (see the module docstring).

    ``select(group_keys) -> row indices`` picks the rows to convert (default: all).

    Raises:
        KeyError: the batch lacks what every path needs (rewards, or prompts and responses).
        ValueError: text is wanted but no tokenizer was given.
    """
    tensors = batch.batch
    extra = batch.non_tensor_batch or {}
    n_rows = len(batch)
    groups = _groups(tensors, extra, n_rows)
    indices = list(range(n_rows)) if select is None else list(select(groups))
    rewards = _rewards(tensors, extra, reward_key, indices)
    if not token_ids and tokenizer is None:
        raise ValueError("pass the tokenizer to send text, or token_ids=True to send token ids")
    decode = _Decoder(tokenizer)
    if "all_turns_prompt_ids" in extra and "all_turns_reasoning_ids" in extra:
        turns = _id_turns(extra["all_turns_prompt_ids"], extra["all_turns_reasoning_ids"], indices, token_ids, decode)
    elif "first_turn_prompt_ids" in extra and "first_turn_reasoning_ids" in extra:
        turns = _id_turns(
            [[p] for p in _plain(extra["first_turn_prompt_ids"])],
            [[z] for z in _plain(extra["first_turn_reasoning_ids"])],
            indices,
            token_ids,
            decode,
        )
    else:
        turns = _tensor_turns(tensors, indices, token_ids, decode)
    out = []
    for i, row_turns, reward in zip(indices, turns, rewards):
        if row_turns:  # a row with no model tokens (or no reasoning at all) has nothing to score
            out.append({"group_id": groups[i], "reward": reward, "turns": row_turns})
    if not out:
        raise ValueError(f"none of the {len(indices)} rows holds a model turn")
    return out


class _Decoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        ends = (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None))
        self.trailing = {t for t in ends if t is not None}

    def prompt(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def strip(self, ids: Sequence[int]) -> list[int]:
        """The ids without the EOS and padding that end a generation."""
        ids = list(ids)
        while ids and ids[-1] in self.trailing:
            ids.pop()
        return ids

    def response(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(self.strip(ids), skip_special_tokens=False))


def _has(tensors: Any, key: str) -> bool:
    return key in tensors.keys()  # noqa: SIM118  # a TensorDict refuses `key in td`; its keys() view answers


def _plain(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    value = tolist() if callable(tolist) else value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _groups(tensors: Any, extra: Any, n_rows: int) -> list[Hashable]:
    for key in ("uid", "group_ids"):
        if key in extra:
            return [g if isinstance(g, Hashable) else str(g) for g in _plain(extra[key])]
    prompts = tensors["prompts"] if _has(tensors, "prompts") else tensors["input_ids"]
    keys: list[Hashable] = [tuple(row) for row in prompts.tolist()]
    return keys[:n_rows]


def _rewards(tensors: Any, extra: Any, reward_key: str | None, indices: list[int]) -> list[float | None]:
    if reward_key is not None:
        values = _plain(extra[reward_key]) if reward_key in extra else tensors[reward_key].sum(-1).tolist()
    else:
        name = next((k for k in REWARD_TENSORS if _has(tensors, k)), None)
        if name is None:
            raise KeyError(f"the batch holds no rewards ({', '.join(REWARD_TENSORS)}); pass reward_key=")
        values = tensors[name][indices].sum(-1).tolist()
        return [_finite(v) for v in values]
    return [_finite(values[i]) for i in indices]


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    reward = float(value)
    return reward if math.isfinite(reward) else None


def _id_turns(
    prompt_ids: Any, reasoning_ids: Any, indices: list[int], token_ids: bool, decode: _Decoder
) -> list[list[dict[str, Any]]]:
    """RAGEN's per-turn (prompt, reasoning) ids: the reasoning is already extracted, so it is sent as such."""
    out = []
    for i in indices:
        turns: list[dict[str, Any]] = []
        for x, z in zip(_plain(prompt_ids[i]), _plain(reasoning_ids[i])):
            if token_ids:
                turns.append({"prompt_token_ids": list(x), "reasoning_token_ids": list(z)})
            else:
                turns.append({"prompt": decode.prompt(x), "reasoning": decode.response(z)})
        out.append(turns)
    return out


def _tensor_turns(tensors: Any, indices: list[int], token_ids: bool, decode: _Decoder) -> list[list[dict[str, Any]]]:
    responses = tensors["responses"][indices].tolist()
    attention = tensors["attention_mask"][indices].tolist()
    n_response = len(responses[0]) if responses else 0
    if _has(tensors, "prompts"):
        prompts = tensors["prompts"][indices].tolist()
    else:  # RAGEN: responses = input_ids[:, 1:], so the prompt is the head of input_ids
        prompts = [row[: len(row) - n_response] for row in tensors["input_ids"][indices].tolist()]
    mask_name = next((k for k in ("response_mask", "loss_mask") if _has(tensors, k)), None)
    model_masks = tensors[mask_name][indices].tolist() if mask_name else None
    out = []
    for r, (prompt, response, valid) in enumerate(zip(prompts, responses, attention)):
        n_prompt = len(prompt)
        context = [t for t, m in zip(prompt, valid[:n_prompt]) if m]
        model = model_masks[r] if model_masks is not None else valid[n_prompt:]
        turns = []
        run: list[int] = []
        for t, is_valid, is_model in zip(response, valid[n_prompt:], model):
            if is_valid and is_model:
                run.append(t)
                continue
            if run:
                turns.append(_turn(context, run, token_ids, decode))
                context = context + run
                run = []
            if is_valid:
                context.append(t)  # a tool or environment token: part of the next turn's prompt
        if run:
            turns.append(_turn(context, run, token_ids, decode))
        out.append(turns)
    return out


def _turn(context: list[int], response: list[int], token_ids: bool, decode: _Decoder) -> dict[str, Any]:
    if token_ids:
        return {"prompt_token_ids": list(context), "reasoning_token_ids": decode.strip(response)}
    return {"prompt": decode.prompt(context), "response": decode.response(response)}
