"""The SNR filter inside a TRL ``GRPOTrainer`` or ``RLOOTrainer``: each generation batch, the prompt groups whose
rewards spread least are masked out of the loss.

    from collapse_monitor.integrations.trl_filter import install_snr_filter
    from collapse_monitor.snr_filter import SNRFilter

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=args, train_dataset=ds)
    snr = install_snr_filter(trainer, SNRFilter(strategy="top_p", value=0.9))  # no monitor needed
    trainer.train()

(``attach(trainer, monitor, snr_filter=...)`` installs it the same way and adds alert engagement and the
per-step series.) What happens each training generation batch:

* the rewards are TRL's own: ``_calculate_rewards`` (every process's, gathered) weighted by
  ``reward_weights`` and summed, as the monitor receives them; a completion no reward function could
  score (all None) is left out of its group's statistics, and a group with none at all counts as one
  reward 0 (no spread);
* groups are TRL's: ``num_generations`` consecutive completions of the gathered batch; every process
  selects from the same gathered rewards, so all agree;
* a dropped group's completions get ``completion_mask`` 0 (as TRL masks truncated completions), which
  takes them out of the policy-gradient, KL and entropy terms, and advantage 0; ``num_items_in_batch``
  is counted again over the kept tokens, so ``loss_type`` dapo (TRL's default), bnpo, cispo and vespo
  normalise by kept tokens only. The loss types that average over sequences (grpo, sapo, dr_grpo, luspo,
  and RLOO's loss) would count the dropped completions as zeros: there every micro-batch's policy and KL
  terms are scaled by the generation batch's rows over its kept rows (every process's, counted once per
  generation batch), so that the micro-batches of one optimizer step sum to the average over the kept
  sequences however the kept rows fall among them. RLOO's ``old_logps`` of dropped rows are zeroed too,
  so their ratio stays 1. With ``gradient_accumulation_steps`` equal to ``steps_per_generation`` (TRL's
  default) the update is the kept groups' alone; with a generation batch spanning several optimizer
  steps each step gets the generation batch's average weight, as TRL's own dapo normaliser does;
* ``bnpo`` and the entropy bonus (``entropy_coef``) divide by each micro-batch's own token count, which a
  run on the kept groups alone would count over different micro-batches: with more than one micro-batch
  per generation batch no rescaling makes them exact, so they are refused there (use dapo, which
  normalises the whole generation batch's tokens);
* a generation batch in which the engaged filter keeps no group trains nothing: its optimizer steps are
  skipped (no ``optimizer.step``, so no momentum moves the weights, and no scheduler step), each warned
  and counted in ``rollout/filter_skipped``; after ``max_skipped_in_a_row`` skipped steps in a row
  (5, RAGEN's) training stops with an error naming the setting;
* advantages were computed before the filter, from whole groups (the filter keeps or drops whole
  groups, so a kept group's are unchanged with ``scale_rewards`` "group"; "batch" scaling uses the std
  of every group, dropped ones included, as RAGEN's filter after advantage estimation does not);
  variant ``vagen`` then multiplies the kept rows' advantages by sqrt(kept groups / groups), as VAGEN
  does after its advantage estimation (the policy-gradient term only: GRPO's KL term is not scaled,
  RLOO's, which sits in its rewards, is, as VAGEN's ``use_kl_in_reward``).

The filter's figures of each step (``collapse_monitor.snr_filter.FIGURE_NAMES``) are added to TRL's own
logged metrics, averaged over the logging window as TRL averages the rest. Not supported, refused at
install: the Liger loss (``use_liger_kernel``), which computes its own loss from the masks; a trainer
without groups (``num_generations`` < 2). Must not import torch at module level.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from collapse_monitor.engagement import FilterEngagement
from collapse_monitor.snr_filter import (
    DROPPED_SPREAD,
    KEPT_COUNT,
    KEPT_ROWS,
    KEPT_SPREAD,
    Selection,
    SNRFilter,
    step_figures,
)

logger = logging.getLogger("collapse_monitor")

KEPT = "collapse_monitor_kept"  # [B] bool, 1 for a kept row: rides in TRL's batch dict through shuffle and split
# [B] float, every row the generation batch's rows over its kept rows: rides along as KEPT does, so each
# micro-batch carries the weight of the generation batch it came from.
SCALE = "collapse_monitor_scale"
TOKEN_NORMALISED = ("dapo", "bnpo", "cispo", "vespo")  # normalised by num_items_in_batch or the mask's sum
SEQUENCE_MEAN = ("grpo", "sapo", "dr_grpo", "luspo")  # averaged over the micro-batch's sequences


class TRLSNRFilter:
    """The filter installed on one trainer: its settings, whether it is engaged, and the figures of each step.

    ``engagement`` says whether the filter acts (``engage="always"``: from the start); ``take_figures()``
    returns the figures of the generation batches since it was last called (the step's), or None when
    there was none.
    """

    def __init__(self, trainer: Any, snr_filter: SNRFilter, engagement: FilterEngagement) -> None:
        self.trainer = trainer
        self.snr_filter = snr_filter
        self.engagement = engagement
        self.is_rloo = _is_rloo(trainer)
        self.scales_sequences = self.is_rloo or getattr(trainer, "loss_type", None) in SEQUENCE_MEAN
        self._rewards: Any = None  # the last _calculate_rewards answer: [N, n_funcs], every process's rows
        self._selections: list[tuple[Selection, bool]] = []
        self._reported = False  # the first filtered step is logged at WARNING, the rest at DEBUG
        self._is_empty = False  # the last generation batch kept no group: its optimizer steps are skipped
        self._wrap()

    def take_figures(self) -> dict[str, float] | None:
        """The figures of the generation batches since the last call (a step's), or None without any."""
        if not self._selections:
            return None
        figures, self._selections = step_figures(self._selections), []
        return figures

    # The hooks into TRL ------------------------------------------------------------------------

    def _wrap(self) -> None:
        trainer = self.trainer
        calculate, generate, compute = (
            trainer._calculate_rewards,
            trainer._generate_and_score_completions,
            trainer._compute_loss,
        )

        def calculate_rewards(*args: Any, **kwargs: Any) -> Any:
            self._rewards = calculate(*args, **kwargs)
            return self._rewards

        def generate_and_score(inputs: Any) -> Any:
            output = generate(inputs)
            rewards, self._rewards = self._rewards, None
            if trainer.model.training and rewards is not None:
                self._filter(output, rewards, len(inputs))
            return output

        def compute_loss(model: Any, inputs: Any) -> Any:
            return self._compute_loss(compute, model, inputs)

        # Instance attributes shadow the class's methods; TRL calls them through self.
        trainer._calculate_rewards = calculate_rewards
        trainer._generate_and_score_completions = generate_and_score
        trainer._compute_loss = compute_loss

    def _filter(self, output: dict[str, Any], rewards_per_func: Any, n_local: int) -> None:
        """Selects the groups of one generation batch and masks the dropped ones' rows of this process."""
        trainer = self.trainer
        weights = trainer.reward_weights.to(rewards_per_func.device)
        # TRL's total: the weighted sum of the functions that scored; NaN where none did.
        totals = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1).tolist()
        unscorable = rewards_per_func.isnan().all(dim=1).tolist()
        n = trainer.num_generations
        groups: list[list[float]] = [[] for _ in range(len(totals) // n)]
        for i, (total, missing) in enumerate(zip(totals, unscorable)):
            if not missing and math.isfinite(total):
                groups[i // n].append(float(total))
        # An all-unscorable group has no spread: one reward 0 says so under every variant.
        selection = self.snr_filter.select([g or [0.0] for g in groups], rows=[n] * len(groups))
        engaged = self._engaged()
        self._is_empty = engaged and not any(selection.kept)
        self._selections.append((selection, engaged))
        first = trainer.accelerator.process_index * n_local
        kept_rows = [engaged is False or selection.kept[(first + r) // n] for r in range(n_local)]
        mask = output["completion_mask"]
        keep = _bool_tensor(kept_rows, mask)
        output[KEPT] = keep
        n_kept = sum(n for kept in selection.kept if kept) if engaged else len(totals)
        output[SCALE] = output["advantages"].new_full((n_local,), len(totals) / max(n_kept, 1))
        figures = step_figures([(selection, engaged)])
        self._log_metrics(figures)
        if not engaged or all(selection.kept):
            return
        output["completion_mask"] = mask * keep.unsqueeze(1).to(mask.dtype)
        # 0 for a dropped row; a kept row's advantage times the variant's scale (vagen's sqrt(kept / groups), else 1)
        weight = keep.to(output["advantages"].dtype) * selection.advantage_scale
        output["advantages"] = output["advantages"] * weight.view(-1, *([1] * (output["advantages"].dim() - 1)))
        if self.is_rloo:
            output["old_logps"] = output["old_logps"] * keep.to(output["old_logps"].dtype)
        if "num_items_in_batch" in output:
            loss_mask = output["completion_mask"]
            if "tool_mask" in output:
                loss_mask = loss_mask * output["tool_mask"]
            output["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()
        self._report(figures, len(selection.kept))

    def _engaged(self) -> bool:
        """Whether the filter acts on this generation batch: alerts the watcher queued since the last batch are
        read now, so an alert seen while the previous step trained engages (or disengages) the filter for this one."""
        engagement, f = self.engagement, self.snr_filter
        if f.engage != "on_alert" or (engagement.engaged and f.disengage == "never"):
            return engagement.engaged
        step = self.trainer.state.global_step + 1  # the optimizer step this batch trains
        flags = [engagement.update(step)]  # only the main process's watcher feeds the queue
        if self.trainer.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            # A collective inside TRL's generation, which every rank runs at the same point.
            flags = broadcast_object_list(flags, from_process=0)
        engagement.engaged = bool(flags[0])  # the other ranks follow the main one
        return engagement.engaged

    def _compute_loss(self, compute: Callable[..., Any], model: Any, inputs: dict[str, Any]) -> Any:
        """TRL's loss; for sequence-mean losses, weighted by the generation batch's rows over its kept rows."""
        scales = inputs.get(SCALE)
        # A micro-batch whose rows are all kept is scaled too: its weight is its generation batch's.
        scale = 1.0 if scales is None or not self.scales_sequences else float(scales[0])
        if scale == 1.0:
            return compute(model, inputs)
        scaled = dict(inputs)
        scaled["advantages"] = inputs["advantages"] * scale
        beta = getattr(self.trainer, "beta", 0.0)
        if self.is_rloo or not beta:  # RLOO's KL is in its rewards, hence in the advantages already
            return compute(model, scaled)
        self.trainer.beta = beta * scale  # GRPO adds beta * KL to each token's loss
        try:
            return compute(model, scaled)
        finally:
            self.trainer.beta = beta

    def wrap_optimizer(self, optimizer: Any) -> None:
        """Makes the optimizer of one ``train()`` skip its steps after an empty selection, and the scheduler's.

        The scheduler is told through accelerate's own mark of a skipped step (``step_was_skipped``, set on
        an fp16 overflow), which the trainer reads before stepping the scheduler: a wrapper on the scheduler
        would be saved in its checkpointed state.
        """
        step = optimizer.step
        accelerated = self.trainer.accelerator._optimizers  # what optimizer_step_was_skipped reads

        def optimizer_step(*args: Any, **kwargs: Any) -> Any:
            for each in accelerated:
                each._is_overflow = self._is_empty
            training_step = self.trainer.state.global_step + 1
            self.engagement.empty.record(training_step, self._is_empty, "its update is skipped")  # raises at the limit
            return None if self._is_empty else step(*args, **kwargs)

        # An instance attribute shadows the method the trainer calls; torch's scheduler marks the optimizer's
        # step it wrapped and warns when the mark is gone: carry it over.
        optimizer.step = functools.update_wrapper(optimizer_step, step)

    def _log_metrics(self, figures: dict[str, float]) -> None:
        metrics = getattr(self.trainer, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            for name, value in figures.items():
                metrics["train"][name].append(value)

    def _report(self, figures: dict[str, float], n_groups: int) -> None:
        """Logs what the filter did: the first step it acted on at WARNING, later ones at DEBUG."""
        level = logging.DEBUG if self._reported else logging.WARNING
        self._reported = True
        logger.log(
            level,
            "collapse-monitor: SNR filter (%s %s %g) keeps %d of %d groups (%d rows) for step %d; mean reward std "
            "%.4g kept, %.4g dropped",
            self.snr_filter.variant,
            self.snr_filter.strategy,
            self.snr_filter.value,
            figures[KEPT_COUNT],
            n_groups,
            figures[KEPT_ROWS],
            self.trainer.state.global_step + 1,  # the optimizer step this batch trains
            figures[KEPT_SPREAD],
            figures.get(DROPPED_SPREAD, 0.0),
        )


def install_snr_filter(trainer: Any, snr_filter: SNRFilter, engagement: FilterEngagement | None = None) -> TRLSNRFilter:
    """Installs ``snr_filter`` on a TRL ``GRPOTrainer`` or ``RLOOTrainer``; call it before ``train()``, on every rank.

    ``engagement``: when the filter acts; default: from the start, which needs ``engage="always"``
    (``engage="on_alert"`` needs the alerts of a monitor: ``attach(trainer, monitor, snr_filter=...)``).

    Raises:
        TypeError: not a TRL GRPOTrainer or RLOOTrainer.
        ValueError: a setting the filter cannot work with, named (see the module docstring).
    """
    check_trainer(trainer)
    if engagement is None:
        if snr_filter.engage != "always":
            raise ValueError(
                "SNRFilter engage='on_alert' needs a monitor's alerts: use "
                "attach(trainer, monitor, snr_filter=...), or engage='always' without a monitor"
            )
        engagement = FilterEngagement(snr_filter)
    from transformers import TrainerCallback

    installed = TRLSNRFilter(trainer, snr_filter, engagement)

    class SkipEmptySteps(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
        """Wraps each ``train()``'s optimizer and scheduler, which TRL creates inside ``train()``."""

        def on_train_begin(self, _args: Any, _state: Any, _control: Any, **kwargs: Any) -> None:
            installed.wrap_optimizer(kwargs["optimizer"])

    trainer.add_callback(SkipEmptySteps())
    return installed


def check_trainer(trainer: Any) -> None:
    """Raises when the filter cannot be installed on ``trainer``, naming the setting."""
    needed = (
        "_calculate_rewards",
        "_generate_and_score_completions",
        "_compute_loss",
        "num_generations",
        "accelerator",
    )
    for name in (*needed, "reward_weights"):
        if not hasattr(trainer, name):
            raise TypeError(
                f"the SNR filter needs a TRL GRPOTrainer or RLOOTrainer; {type(trainer).__name__} has no {name}"
            )
    if not trainer.num_generations or trainer.num_generations < 2:
        raise ValueError(
            "the SNR filter ranks prompt groups by their reward spread: num_generations must be at least 2, "
            f"got {trainer.num_generations}"
        )
    args = getattr(trainer, "args", None)
    if getattr(trainer, "use_liger_kernel", False) or getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "use_liger_kernel: the Liger loss computes its own normalisation from the masks, which the SNR filter "
            "cannot adjust; set use_liger_kernel=False"
        )
    loss_type = getattr(trainer, "loss_type", None)
    micro_batches: int = (
        getattr(args, "steps_per_generation", None) or getattr(args, "gradient_accumulation_steps", None) or 1
    )
    if micro_batches > 1:
        per_micro_batch = [
            name
            for name, is_set in (
                ("loss_type='bnpo'", loss_type == "bnpo"),
                ("entropy_coef", bool(getattr(trainer, "_entropy_bonus_enabled", False))),
            )
            if is_set
        ]
        if per_micro_batch:
            raise ValueError(
                f"{' and '.join(per_micro_batch)} with {micro_batches} micro-batches per generation batch "
                "(steps_per_generation): they divide by each micro-batch's own token count, which the SNR filter "
                "cannot make equal to a run on the kept groups alone; use loss_type='dapo' (normalised over the "
                "generation batch's tokens) and no entropy bonus, or one micro-batch per generation batch"
            )
    if not _is_rloo(trainer) and loss_type not in (*TOKEN_NORMALISED, *SEQUENCE_MEAN):
        raise ValueError(
            f"loss_type must be one of {', '.join((*TOKEN_NORMALISED, *SEQUENCE_MEAN))} for the SNR filter "
            f"(the losses whose normalisation it knows), got {loss_type!r}"
        )


def _is_rloo(trainer: Any) -> bool:
    return any(cls.__name__ == "RLOOTrainer" for cls in type(trainer).__mro__)


def _bool_tensor(values: list[bool], like: Any) -> Any:
    """``values`` as a bool tensor on ``like``'s device (torch is the trainer's; not imported here)."""
    return like.new_tensor([1 if v else 0 for v in values]).bool()
