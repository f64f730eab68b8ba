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

To see the service's diagnostics in verl's own tracker (``trainer.logger``: wandb, tensorboard,
trackio ...): ``scored = ScoredFigures(monitor).start()`` before the loop (``collapse_monitor.trackers``),
and ``merge_newest(scored, metrics)`` right before ``logger.log(data=metrics, step=self.global_steps)``;
the newest scored step's figures land at the current step, ``collapse/step`` naming the step they describe.

In RAGEN's ``RayAgentTrainer.fit`` (ragen/trainer/agent_trainer.py) the second line goes right
after ``batch = self.agent_proxy.rollout(batch, val=False)``, where RAGEN computes its own collapse
metrics: before its rollout filter, so the service sees (and advises on) every group.

The SNR filter (``apply_snr_filter``) goes where RAGEN filters, once the batch holds its rewards and
before the advantages are computed, after ``log_batch`` (which sends every group)::

    snr = SNRFilter(strategy="top_p", value=0.9, engage="on_alert")
    engagement = FilterEngagement.watch(monitor, snr)                                    # before the loop
    filtered = apply_snr_filter(batch, snr, step=self.global_steps, engagement=engagement)  # in the loop
    batch = filtered.batch
    monitor.figures(self.global_steps, filtered.figures)

``output="mask"`` (the default, as the upstream pull requests) zeroes ``response_mask`` (and RAGEN's
``loss_mask``) of the dropped groups' rows, which verl's ``token-mean`` loss aggregation (its default)
then normalises over the kept tokens only (pass ``loss_agg_mode``: the ``seq-mean-*`` modes would count
the masked rows, so mask mode refuses them); ``output="select"`` returns the kept rows alone, as RAGEN
does (the batch shrinks: keep its size divisible by what your mini-batches and workers need).
Variant ``vagen`` also multiplies the kept rows' ``advantages`` by sqrt(kept groups / groups), as VAGEN
does right after ``compute_advantage``: call it there, once the batch holds them (refused before).

When the engaged filter keeps no group (``filtered.is_empty``), the step has nothing to train on, but
this function cannot skip the update: verl's ``fit`` has no hook, and the optimizer steps inside the
workers' ``update_actor``, so a fully masked batch would be a zero-gradient step that still moves
AdamW's weights and the scheduler. Skip it in the loop: ``if not filtered.is_empty:`` around
``actor_output = self._update_actor(batch)`` and the lines that read ``actor_output``. Each empty
selection is warned, sent as ``rollout/filter_skipped`` 1, and the ``max_skipped_in_a_row``-th in a
row raises (counted by the engagement: pass the same one every step).

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
from dataclasses import dataclass
from typing import Any

from collapse_monitor.alerts import AlertActions
from collapse_monitor.engagement import FilterEngagement
from collapse_monitor.monitor import Monitor
from collapse_monitor.snr_filter import SNRFilter, step_figures

REWARD_TENSORS = ("token_level_scores", "rm_scores", "token_level_rewards")
LOSS_MASKS = ("response_mask", "loss_mask")  # verl's, RAGEN's: what a dropped row's loss is masked with


def watch_alerts(
    monitor: Monitor,
    *,
    stop_on: Collection[str] = ("firing",),
    save_on: Collection[str] = (),
    rules: Iterable[str] | None = ("TemplateCollapse",),
    interval: float = 10.0,
) -> AlertActions:
    """Watches the run's alerts in the background; the loop asks ``should_stop(step)`` / ``should_save(step)``.

    Neither call touches the network: they read what the monitor's alert watcher queued (see the module
    docstring for where they go in ``RayPPOTrainer.fit``). The same decisions as ``monitor.should_stop()``:
    ``Monitor.act_on_alerts`` with these settings.
    """
    return monitor.act_on_alerts(save_on=save_on, stop_on=stop_on, rules=rules, interval=interval)


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
    sampled_out = 0

    def select(groups: Sequence[Any]) -> list[int]:  # drawn before decoding; counted as log() counts its draws
        nonlocal sampled_out
        kept = monitor.sample_indices(step, groups)
        sampled_out = len(groups) - len(kept)
        return kept

    try:
        rows = trajectories(batch, tokenizer, token_ids=token_ids, reward_key=reward_key, select=select)
    except (KeyError, ValueError, TypeError) as e:
        monitor.invalid(step, f"cannot read the verl batch: {e!r}", e)
        return
    monitor.log(step, rows, rows_sampled_out=sampled_out)


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


@dataclass(frozen=True)
class FilteredBatch:
    """What ``apply_snr_filter`` did to one batch.

    ``batch`` is what to train on (masked, or the kept rows); ``kept_rows`` the rows of the given batch
    that train (every row when the filter was not engaged); ``row_kept`` the same as a [n_rows] bool
    tensor (a loss mask to apply elsewhere); ``figures`` the step's series (``monitor.figures``);
    ``is_empty``: the engaged filter kept no group, so the loop must skip this step's update.
    """

    batch: Any
    kept_rows: list[int]
    row_kept: Any
    figures: dict[str, float]
    engaged: bool
    is_empty: bool = False


def apply_snr_filter(
    batch: Any,
    snr_filter: SNRFilter,
    *,
    step: int,
    engagement: FilterEngagement | None = None,
    reward_key: str | None = None,
    output: str = "mask",
    loss_agg_mode: str = "token-mean",
) -> FilteredBatch:
    """Keeps the prompt groups of a ``DataProto`` whose rewards spread the most (see the module docstring).

    Groups and rewards are read as ``trajectories`` reads them (``uid``, else ``group_ids``, else identical
    prompts; ``token_level_scores``, ``rm_scores`` or ``token_level_rewards`` summed, or ``reward_key``); a
    row without a finite reward is left out of its group's statistics. ``engagement``: when the filter acts
    (``FilterEngagement.watch(monitor, snr_filter)`` for ``engage="on_alert"``; none needed for "always");
    it is read here, on the training thread, without any network call; it also counts the steps that kept
    no group (pass the same one every step: without one, none is counted across steps). ``loss_agg_mode``:
    the actor's (``actor_rollout_ref.actor.loss_agg_mode``); ``output="mask"`` needs ``token-mean``.

    Raises:
        ValueError: an unknown ``output``, ``engage="on_alert"`` without an engagement, no mask to zero
            (``output="mask"``), ``output="mask"`` under a ``seq-mean-*`` loss aggregation, variant ``vagen``
            on a batch without ``advantages``, or a batch whose groups all hold one row.
        KeyError: the batch holds no rewards.
        RuntimeError: the ``max_skipped_in_a_row``-th step in a row that kept no group.
    """
    if output not in ("mask", "select"):
        raise ValueError(f"output must be 'mask' or 'select', got {output!r}")
    tensors, extra = batch.batch, batch.non_tensor_batch or {}
    masks = [name for name in LOSS_MASKS if _has(tensors, name)]
    if output == "mask" and not masks:
        raise ValueError(f"output='mask' needs a loss mask to zero ({', '.join(LOSS_MASKS)}); use output='select'")
    if output == "mask" and loss_agg_mode != "token-mean":
        # seq-mean-* divides each micro-batch by its rows, masked ones included, so the kept sequences would
        # weigh by how many dropped rows share their micro-batch (verl splits and balances the batch itself):
        # no rescaling here can undo that, so it is refused rather than made approximately right.
        raise ValueError(
            f"output='mask' needs loss_agg_mode='token-mean' (masked rows count in the other modes' sequence "
            f"averages), got {loss_agg_mode!r}; use output='select', which trains on the kept rows alone"
        )
    if snr_filter.variant == "vagen" and not _has(tensors, "advantages"):
        raise ValueError(
            "SNRFilter variant 'vagen' scales the kept rows' advantages by sqrt(kept groups / groups), as VAGEN "
            "does after compute_advantage, but the batch holds no 'advantages': call apply_snr_filter right after "
            "compute_advantage, or use variant 'ragen' or 'upstream'"
        )
    update = "skip its update in the loop (filtered.is_empty): verl's actor cannot be told from here"
    if engagement is None:
        if snr_filter.engage != "always":
            raise ValueError("SNRFilter engage='on_alert' needs engagement=FilterEngagement.watch(monitor, snr_filter)")
        engagement = FilterEngagement(snr_filter)
        update += "; not counted across steps without engagement=FilterEngagement(snr_filter) made before the loop"
    engagement.update(step)
    n_rows = len(batch)
    keys = _groups(tensors, extra, n_rows)
    rewards = _rewards(tensors, extra, reward_key, list(range(n_rows)))
    index: dict[Hashable, int] = {}
    group_of_row = [index.setdefault(key, len(index)) for key in keys]
    by_group: list[list[float]] = [[] for _ in index]
    rows = [0] * len(index)
    for g, reward in zip(group_of_row, rewards):
        rows[g] += 1
        if reward is not None:
            by_group[g].append(reward)
    if max(rows) < 2:
        raise ValueError(
            f"the SNR filter ranks prompt groups by their reward spread, but each of the {n_rows} rows is a group "
            "of its own: give rows of one prompt the same uid (or group_ids)"
        )
    # A group without any reward has no spread: one reward 0 says so under every variant.
    selection = snr_filter.select([g or [0.0] for g in by_group], rows=rows)
    engaged = engagement.engaged
    is_empty = engaged and not any(selection.kept)
    engagement.empty.record(step, is_empty, update)  # warns; raises at the limit
    kept_rows = [r for r, g in enumerate(group_of_row) if not engaged or selection.kept[g]]
    like = tensors[masks[0]] if masks else tensors["responses"]
    row_kept = like.new_tensor([1 if not engaged or selection.kept[g] else 0 for g in group_of_row]).bool()
    filtered = batch
    if len(kept_rows) < n_rows:
        if output == "select":
            filtered = batch.select_idxs(kept_rows)
        else:
            for name in masks:
                tensors[name] = tensors[name] * row_kept.unsqueeze(-1).to(tensors[name].dtype)
        if selection.advantage_scale != 1.0:  # vagen's, on the kept rows only (every row, once selected)
            advantages = filtered.batch["advantages"]
            kept = row_kept if output == "mask" else row_kept[row_kept]
            factor = 1.0 + (selection.advantage_scale - 1.0) * kept.to(advantages.dtype)  # 1 where dropped
            filtered.batch["advantages"] = advantages * factor.view(-1, *([1] * (advantages.dim() - 1)))
    return FilteredBatch(filtered, kept_rows, row_kept, step_figures([(selection, engaged)]), engaged, is_empty)


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
