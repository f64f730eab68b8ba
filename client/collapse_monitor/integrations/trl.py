"""TRL: every generation batch of a ``GRPOTrainer`` (or ``RLOOTrainer``) goes to collapse-monitor.

    from collapse_monitor import Monitor
    from collapse_monitor.integrations.trl import attach

    trainer = GRPOTrainer(model=..., reward_funcs=[accuracy, formatting], args=args, train_dataset=ds)
    attach(trainer, Monitor("http://monitor:8000", "grpo-math-3"))
    trainer.train()

``attach`` wraps the trainer's reward functions, so it sees exactly what TRL scores: the prompts,
the completions (and their token ids) and each function's rewards, ``None`` included. It adds a
``TrainerCallback`` that, at the end of each optimizer step, sends what was generated for it:

* the **prompt** of each completion rebuilt as the trainer built it: the chat template of the
  processing class, with the trainer's ``chat_template``, ``tools`` and ``chat_template_kwargs``
  and the generation prompt (tokenized, it gives the ids the trainer generated from); plain-text
  prompts as they are. ``token_ids=True`` sends those ids and the completion ids instead of text.
* the **reward**: TRL's weighted sum of the reward functions (``reward_weights``), skipping the
  ``None`` of a function that could not score a completion; null when none could. Reward models
  (``nn.Module`` reward functions) are read through a forward hook.
* the **group**: a dataset column ``uid`` when present, else ``i // num_generations`` over the
  batch gathered from all processes, the grouping TRL normalises advantages with.
* the **step**: ``state.global_step`` after the optimizer step the batch trained.
* **multi-turn** completions (tool calls): one turn per assistant message, its prompt being the
  conversation before it.

With several processes every rank gathers its shard (``accelerate.utils.gather_object``, at the
same point on every rank) and only the main process sends, one batch per step. Evaluation
batches are not sent. Saved checkpoints are announced (``Monitor.checkpoint``) when the run scores
with the policy (``scorer_mode="policy"``), or always with ``announce_checkpoints=True``.

Acting on alerts: with ``save_on=("pending",)`` and/or ``stop_on=("firing",)`` the main process
watches the run's alerts (``Monitor.on_alert``, every ``alert_poll_seconds``, in the background) and
at the end of the next optimizer step sets ``control.should_save`` when an alert of ``rules``
(default TemplateCollapse) entered a ``save_on`` state, and ``control.should_training_stop`` when one
entered a ``stop_on`` state: the trainer saves ``checkpoint-{step}`` and stops exactly as at its
planned end. The decision is read from a queue on the training thread (no network call there) and,
with several processes, broadcast from the main process so that every rank saves and stops together.

The SNR filter: ``snr_filter=SNRFilter(...)`` installs it (``integrations/trl_filter.py``); its figures
ride with each step's batch, and what TRL logs after the step (its losses, rewards, the policy's entropy
as ``actor/entropy``) follows in a small post (``Monitor.figures``). ``engage="on_alert"`` reads the
monitor's one alert watcher, as ``save_on``/``stop_on`` do. ``rollback_on`` stops at an alert state and
hands back the newest checkpoint whose policy generated a batch before the episode's onset
(``integrations/trl_rollback.py``; the trainer's own saves, ``save_steps``, of which the
``rollback_keep`` newest are kept): TRL cannot reload a checkpoint in the middle of ``train()``, so the
rollback is its resume, ``trainer.train(resume_from_checkpoint=callback.take_rollback())``, with the
filter engaged.

The trainer's trackers: when ``report_to`` names TensorBoard, Trackio or W&B, the main process writes
each scored step's figures (``collapse/...``) into them at the step they belong to, fetched every
``tracker_poll_seconds`` in the background (``integrations/trl_trackers.py``).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback

from collapse_monitor.alerts import STATES, AlertActions, AlertEvent, check_filters
from collapse_monitor.conversations import assistant_turns, is_conversation
from collapse_monitor.engagement import FilterEngagement
from collapse_monitor.integrations.trl_filter import TRLSNRFilter, install_snr_filter
from collapse_monitor.integrations.trl_rollback import ROLLBACK_KEEP, CheckpointKeeper, checkpoint_before
from collapse_monitor.integrations.trl_trackers import feed_trackers
from collapse_monitor.monitor import Monitor
from collapse_monitor.snr_filter import FIGURE_NAMES, SNRFilter

logger = logging.getLogger("collapse_monitor")

# Logs that are no training step's: an evaluation's, and the summary at the end of training (train_runtime, ...).
NOT_STEP_LOGS = ("eval_", "train_")
# TRL's names of figures RAGEN and verl name otherwise: sent under RAGEN's name.
RAGEN_NAMES = {"entropy": "actor/entropy"}


@dataclass
class _Generation:
    """One generation batch as this process's reward functions saw it."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]] | None
    uids: list[Any] | None
    rewards: dict[int, list[float | None]] = field(default_factory=dict)


def attach(
    trainer: Any,
    monitor: Monitor,
    *,
    token_ids: bool = False,
    announce_checkpoints: bool | None = None,
    flush_timeout: float = 10.0,
    save_on: Collection[str] = (),
    stop_on: Collection[str] = (),
    rules: Iterable[str] | None = ("TemplateCollapse",),
    alert_poll_seconds: float = 10.0,
    snr_filter: SNRFilter | None = None,
    rollback_on: Collection[str] = (),
    tracker_poll_seconds: float = 10.0,
    rollback_keep: int = ROLLBACK_KEEP,
) -> CollapseMonitorCallback:
    """Sends ``trainer``'s generation batches to ``monitor``; returns the callback it added.

    Call it after building the trainer and before ``train()``, on every process. ``save_on`` and
    ``stop_on`` (alert states: pending, firing, resolved) save a checkpoint and stop training when
    an alert of ``rules`` (None: every rule) enters them; see the module docstring. ``snr_filter``
    installs the SNR filter (``collapse_monitor.integrations.trl_filter``); with ``engage="on_alert"``
    it acts from the step after an alert of its ``rules`` entered one of its ``states``.
    ``rollback_on`` (alert states; needs ``snr_filter`` and the trainer's checkpoints, ``save_strategy``
    "steps"): stop when an alert of ``rules`` enters one, engage the filter, and hand back the newest
    checkpoint whose policy generated a batch before the alert's onset step (``take_rollback()``) to
    resume from, as TRL resumes: ``trainer.train(resume_from_checkpoint=...)``. Its checkpoints are
    pruned to the ``rollback_keep`` newest and the newest before an open alert's onset (in place of
    ``save_total_limit``, which would delete that one).
    ``tracker_poll_seconds``: how often the scored figures are fetched for the trackers ``report_to`` names.

    Raises:
        TypeError: not a TRL GRPOTrainer or RLOOTrainer.
        ValueError: a setting that cannot work, named (alert states, the filter's needs).
    """
    for name in ("reward_funcs", "num_generations", "processing_class", "state", "accelerator"):
        if not hasattr(trainer, name):
            raise TypeError(f"attach() needs a TRL GRPOTrainer or RLOOTrainer; {type(trainer).__name__} has no {name}")
    keeper = None
    if rollback_on:
        if snr_filter is None:
            raise ValueError("rollback_on resumes training with the SNR filter engaged: pass snr_filter=SNRFilter(...)")
        check_filters(None, rollback_on)  # an unknown state raises
        args = trainer.args
        if str(getattr(args.save_strategy, "value", args.save_strategy)) != "steps":
            raise ValueError(
                "rollback_on returns to a checkpoint saved before the alert's onset: set save_strategy='steps' "
                f"and save_steps (every few steps), got save_strategy={args.save_strategy!r}"
            )
        if args.save_total_limit is not None:
            raise ValueError(
                "rollback_on keeps its own checkpoints (the rollback_keep newest, and the newest before an open "
                f"alert's onset, which save_total_limit would delete): leave save_total_limit unset, got "
                f"{args.save_total_limit}"
            )
        keeper = CheckpointKeeper(args.output_dir, rollback_keep)
    stops = (*stop_on, *rollback_on)
    actions = AlertActions(save_on=save_on, stop_on=stops, rules=rules) if save_on or stops else None
    snr = None
    if snr_filter is not None:
        snr = install_snr_filter(trainer, snr_filter, FilterEngagement(snr_filter))
    if trainer.accelerator.is_main_process:
        # The monitor's one alert watcher feeds them all; the other processes follow the main one's decisions.
        if actions is not None and actions.states:
            monitor.on_alert(actions, rules=actions.rules, states=actions.states, interval=alert_poll_seconds)
        if keeper is not None:
            monitor.on_alert(keeper, rules=rules, states=STATES, interval=alert_poll_seconds)
        if snr is not None and snr_filter is not None and snr_filter.engage == "on_alert":
            snr.engagement.subscribe(monitor, alert_poll_seconds)
    callback = CollapseMonitorCallback(
        trainer,
        monitor,
        token_ids,
        announce_checkpoints,
        flush_timeout,
        actions,
        snr_filter=snr,
        rollback_on=rollback_on,
        keeper=keeper,
    )
    trainer.add_callback(callback)
    feed_trackers(trainer, monitor, tracker_poll_seconds, flush_timeout)
    return callback


class CollapseMonitorCallback(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
    """Records what the reward functions see and sends it at each optimizer step's end."""

    def __init__(
        self,
        trainer: Any,
        monitor: Monitor,
        token_ids: bool = False,
        announce_checkpoints: bool | None = None,
        flush_timeout: float = 10.0,
        alert_actions: AlertActions | None = None,
        snr_filter: TRLSNRFilter | None = None,
        rollback_on: Collection[str] = (),
        keeper: CheckpointKeeper | None = None,
    ) -> None:
        self.trainer = trainer
        self.alert_actions = alert_actions
        self.snr_filter = snr_filter
        self.rollback_on = frozenset(rollback_on)
        self.rollback_to: str | None = None  # the checkpoint a rollback asked to resume from (take_rollback)
        self.keeper = keeper
        self._sent_step: int | None = None  # the step of the last batch sent: logged figures join it
        self._warned_unsent = False
        self.monitor = monitor
        self.token_ids = token_ids
        self.announce_checkpoints = (
            monitor.run_settings.get("scorer_mode") == "policy"
            if announce_checkpoints is None
            else announce_checkpoints
        )
        self.flush_timeout = flush_timeout
        self.weights = [float(w) for w in trainer.reward_weights.tolist()]
        self._generations: list[_Generation] = []
        self._module_rewards: dict[int, list[float | None]] = {}
        self._rendered: dict[str, str] = {}
        for index, func in enumerate(trainer.reward_funcs):
            if hasattr(func, "register_forward_hook") and hasattr(func, "parameters"):  # a reward model
                func.register_forward_hook(functools.partial(self._on_reward_model, index))
            else:
                trainer.reward_funcs[index] = self._wrap(index, func)

    # Recording (every process, inside TRL's reward computation) -------------------------------

    def _wrap(self, index: int, func: Callable[..., Any]) -> Callable[..., Any]:
        if _is_async(func):

            @functools.wraps(func)
            async def recorded_async(*args: Any, **kwargs: Any) -> Any:
                rewards = await func(*args, **kwargs)
                self._record(index, kwargs, rewards)
                return rewards

            return recorded_async

        @functools.wraps(func)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            rewards = func(*args, **kwargs)
            self._record(index, kwargs, rewards)
            return rewards

        return recorded

    def _record(self, index: int, kwargs: dict[str, Any], rewards: Sequence[Any]) -> None:
        if not self.trainer.model.training:
            return  # an evaluation batch: not a training step
        prompts = kwargs["prompts"]
        current = self._generations[-1] if self._generations else None
        if current is None or current.prompts is not prompts:  # TRL hands every function the same list
            current = _Generation(
                prompts=prompts,
                completions=kwargs["completions"],
                completion_ids=kwargs.get("completion_ids"),
                uids=kwargs.get("uid"),
                rewards=self._module_rewards,
            )
            self._module_rewards = {}
            self._generations.append(current)
        current.rewards[index] = [None if r is None else float(r) for r in rewards]

    def _on_reward_model(self, index: int, _module: Any, _inputs: Any, output: Any) -> None:
        if not self.trainer.model.training:
            return
        rewards: list[float | None] = [float(r) for r in output.logits[:, 0].tolist()]
        current = self._generations[-1] if self._generations else None
        # A model listed after a callable belongs to that callable's batch; listed first, to the next.
        if current is not None and index not in current.rewards:
            current.rewards[index] = rewards
        else:
            self._module_rewards[index] = rewards

    # Sending (every process gathers, the main process sends) ---------------------------------

    def on_step_end(self, _args: Any, state: Any, control: Any, **_kwargs: Any) -> None:
        self._send(state)
        if self.alert_actions is not None:
            self._act_on_alerts(state, control)

    def _send(self, state: Any) -> None:
        # Every rank takes its filter's figures (all computed the same ones from the gathered rewards).
        figures = self.snr_filter.take_figures() if self.snr_filter is not None else None
        if not self._generations:
            return
        generations, self._generations = self._generations, []
        rows = [row for generation in generations for row in self._rows(generation)]
        if self.trainer.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            rows = gather_object(rows)  # concatenated in process order, as TRL gathers its rewards
        if not state.is_world_process_zero:
            return
        self.monitor.log(state.global_step, trajectories(rows, self.trainer.num_generations), figures=figures)
        self._sent_step = state.global_step

    def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, Any] | None = None, **_kwargs: Any) -> None:
        """Sends what TRL logged for the step (its losses, rewards, the policy's entropy) beside the step's batch."""
        if not state.is_world_process_zero or not logs or any(name.startswith(NOT_STEP_LOGS) for name in logs):
            return
        figures = {
            RAGEN_NAMES.get(name, name): value
            for name, value in logs.items()
            if name not in FIGURE_NAMES and _is_number(value)
        }
        if not figures:
            return
        if self._sent_step != state.global_step:
            # TRL reuses a generation batch for num_iterations > 1 steps: no batch of this step to join.
            if not self._warned_unsent:
                self._warned_unsent = True
                logger.warning(
                    "collapse-monitor: TRL logged step %d, which sent no batch (a generation batch reused across "
                    "steps, num_iterations > 1): logged figures are sent only for steps that sent a batch",
                    state.global_step,
                )
            return
        self.monitor.figures(state.global_step, figures)

    def _act_on_alerts(self, state: Any, control: Any) -> None:
        """Applies what the alerts asked since the last step; every rank does the same as the main one."""
        assert self.alert_actions is not None
        decision = self.alert_actions.take(state.global_step)  # only the main process's queue is fed
        rollback = next((e for e in decision.events if e.state in self.rollback_on), None)
        target = None
        if rollback is not None:  # the main process: the keeper kept the checkpoint it needs
            target = checkpoint_before(self.trainer.args.output_dir, rollback.onset_step)
            if target is None:
                logger.error(
                    "collapse-monitor: %s: no checkpoint of a policy from before onset step %d is left in %s; "
                    "training stops without a rollback (save more often: save_steps)",
                    rollback.describe(),
                    rollback.onset_step,
                    self.trainer.args.output_dir,
                )
        flags: list[Any] = [decision.save, decision.stop, target]
        if self.trainer.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            flags = broadcast_object_list(flags, from_process=0)  # a collective: every rank, every step
        if flags[0]:
            control.should_save = True
        if flags[1]:
            control.should_training_stop = True
        if flags[2] is not None:
            self._roll_back(state.global_step, rollback, flags[2])

    def _roll_back(self, step: int, event: AlertEvent | None, target: str) -> None:
        """Stops here (the decision above) with the filter engaged; ``take_rollback`` gives the checkpoint to resume."""
        assert self.snr_filter is not None
        self.snr_filter.engagement.engage(step, event, is_pinned=True)  # event None: another rank's
        self.rollback_to = target
        logger.warning(
            "collapse-monitor: rolling back: training stops at step %d; resume from %s, the newest checkpoint "
            "before onset step %s (trainer.train(resume_from_checkpoint=callback.take_rollback())) with the SNR "
            "filter engaged",
            step,
            target,
            "?" if event is None else event.onset_step,
        )

    def take_rollback(self) -> str | None:
        """The checkpoint a rollback asked to resume from, once (None when there was no rollback since)."""
        folder, self.rollback_to = self.rollback_to, None
        return folder

    def on_save(self, args: Any, state: Any, _control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self.keeper is not None and state.is_world_process_zero:
            self.keeper.prune(protected=(state.best_model_checkpoint, self.rollback_to))
        if not (self.announce_checkpoints and state.is_world_process_zero):
            return
        is_lora = hasattr(kwargs.get("model"), "peft_config")
        self.monitor.checkpoint(folder, step=state.global_step, kind="lora" if is_lora else "full")

    def on_train_end(self, _args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.monitor.flush(self.flush_timeout)

    def _rows(self, generation: _Generation) -> list[dict[str, Any]]:
        """This process's completions as plain rows: turns, reward (weighted sum) and uid."""
        rows = []
        for i, (prompt, completion) in enumerate(zip(generation.prompts, generation.completions)):
            scored = [
                self.weights[f] * reward
                for f, rewards in generation.rewards.items()
                if (reward := rewards[i]) is not None
            ]
            ids = generation.completion_ids[i] if generation.completion_ids is not None else None
            rows.append(
                {
                    "turns": self._turns(prompt, completion, ids),
                    "reward": sum(scored) if scored else None,
                    "uid": generation.uids[i] if generation.uids is not None else None,
                }
            )
        return rows

    def _turns(self, prompt: Any, completion: Any, completion_ids: Sequence[int] | None) -> list[dict[str, Any]]:
        if not is_conversation(prompt):
            if self.token_ids and completion_ids is not None:
                ids = self.trainer.processing_class(text=prompt)["input_ids"]
                return [{"prompt_token_ids": list(ids), "reasoning_token_ids": list(completion_ids)}]
            return [{"prompt": str(prompt), "response": str(completion)}]
        messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        n_assistant = sum(1 for m in messages if m.get("role") == "assistant")
        if self.token_ids and completion_ids is not None and n_assistant == 1:
            ids = self._tokenizer()(self._render(prompt), add_special_tokens=False)["input_ids"]
            return [{"prompt_token_ids": list(ids), "reasoning_token_ids": list(completion_ids)}]
        return assistant_turns(prompt, messages, self._render)

    def _render(self, conversation: list[Any]) -> str:
        """The conversation as the trainer tokenized it for generation (text, generation prompt appended)."""
        key = json.dumps(conversation, sort_keys=True, default=str)
        text = self._rendered.get(key)
        if text is None:
            if len(self._rendered) > 4096:  # prompts repeat within a batch, rarely across steps
                self._rendered.clear()
            tools = getattr(self.trainer, "tools", None)
            text = self.trainer.processing_class.apply_chat_template(
                conversation=conversation,
                tools=tools or None,
                chat_template=getattr(self.trainer, "chat_template", None),
                add_generation_prompt=True,
                tokenize=False,
                **(getattr(self.trainer, "chat_template_kwargs", None) or {}),
            )
            self._rendered[key] = text
        return str(text)

    def _tokenizer(self) -> Any:
        processing_class = self.trainer.processing_class
        return getattr(processing_class, "tokenizer", processing_class)  # a processor wraps its tokenizer


def trajectories(rows: list[dict[str, Any]], num_generations: int) -> list[dict[str, Any]]:
    """Rows gathered from every process (in process order) as trajectories with their groups.

    The group of row ``i`` is its ``uid`` when the dataset has one, else ``i // num_generations``:
    TRL's sampler repeats each prompt ``num_generations`` times in a row across the gathered batch.
    """
    return [
        {
            "group_id": row["uid"] if row["uid"] is not None else i // num_generations,
            "reward": row["reward"],
            "turns": row["turns"],
        }
        for i, row in enumerate(rows)
    ]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_async(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004  # a callable instance's async __call__
