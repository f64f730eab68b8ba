"""The SNR filter inside real TRL trainers (tiny-random policy, CPU): dropped groups contribute no gradient.

A trainer with the filter installed takes one optimizer step; a second trainer, from the same weights,
takes one step on the kept groups alone (the same completions, rewards and advantages, the dropped rows
removed), with the same gradient accumulation over half the rows. The two updates are equal, with the
kept rows spread unevenly over the micro-batches (TRL shuffles the generation batch before splitting
it). Plain SGD without clipping, so that a wrongly scaled gradient shows (Adam's first step and
clipping would hide a scale). A third trainer, on every group, moves the weights differently,
so the comparison can fail.
"""

from __future__ import annotations

import logging

import datasets
import pytest
import torch
from alert_matrices import ALERTS, post_matrices
from tiny_trainer import FIRE_AT_ONCE, NUM_GENERATIONS, ROOMS, grpo_config, paced_trainer, tiny_policy
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from collapse_monitor import Monitor
from collapse_monitor.integrations.trl_filter import KEPT, SCALE, install_snr_filter
from collapse_monitor.snr_filter import SNRFilter

ROWS = 16  # four prompts of NUM_GENERATIONS completions: four groups, two of which the filter keeps
KEEP_TWO = SNRFilter(strategy="top_k_abs", value=2)


def id_reward(completion_ids, **_kwargs):
    """A reward that spreads differently in each group: the completion's token ids summed, modulo 7."""
    return [float(sum(ids) % 7) for ids in completion_ids]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny policy saved to a folder: TRL loads its reference model (for the KL term) from the policy's path."""
    folder = tmp_path_factory.mktemp("policy")
    model, tokenizer = tiny_policy()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def make_trainer(kind: str, policy: str, output_dir, **overrides):
    settings = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": ROWS,
        "num_generations": NUM_GENERATIONS,
        "max_completion_length": 8,
        "max_steps": 1,
        "learning_rate": 0.5,
        "optim": "sgd",
        "max_grad_norm": 0.0,  # no clipping: it would rescale both updates alike
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,  # float32 throughout: bf16 autocast would round the two updates differently
        "seed": 0,
        "save_strategy": "no",
        "logging_steps": 1,
        "dataloader_num_workers": 0,
    } | overrides
    config_class, trainer_class = (RLOOConfig, RLOOTrainer) if kind == "rloo" else (GRPOConfig, GRPOTrainer)
    trainer = trainer_class(
        model=policy,
        reward_funcs=[id_reward],
        args=config_class(**settings),
        train_dataset=datasets.Dataset.from_dict({"prompt": ROOMS}),
        processing_class=AutoTokenizer.from_pretrained(policy),
    )
    if trainer.ref_model is not None:
        # A reference away from the policy, the same in every trainer: at the policy itself the KL term's
        # gradient is 0 and a wrongly weighted KL would not show in one step.
        with torch.no_grad():
            for p in trainer.ref_model.parameters():
                p.add_(0.05 * torch.sin(torch.arange(p.numel(), dtype=p.dtype)).view_as(p))
    return trainer


def capture_generation(trainer) -> dict:
    """Keeps the batch TRL generated (before any filter installed after this) and what the step trained on."""
    seen: dict = {}
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        output = generate(inputs)
        seen["raw"] = dict(output)  # the filter replaces tensors in the dict, never edits them in place
        seen["trained"] = output
        return output

    trainer._generate_and_score_completions = recorded
    return seen


def replay(trainer, batch: dict) -> None:
    """Makes ``trainer`` train on ``batch`` instead of generating (the same completions, scores and advantages)."""
    trainer._generate_and_score_completions = lambda _inputs: {
        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()
    }


def rows_of(batch: dict, rows: torch.Tensor) -> dict:
    """``batch`` restricted to ``rows``, its token count taken again over them (as TRL counts its batch)."""
    out = {}
    for key, value in batch.items():
        if key in (KEPT, SCALE, "num_items_in_batch"):
            continue
        out[key] = value[rows] if isinstance(value, torch.Tensor) and value.ndim >= 1 else value
    if "num_items_in_batch" in batch:
        out["num_items_in_batch"] = out["completion_mask"].sum()
    return out


def weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def update(trainer, before: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.detach() - before[name]).flatten() for name, p in trainer.model.named_parameters()])


def micro_batch_kept_rows(trainer) -> list[int]:
    """Records the kept rows of each micro-batch the loss sees (installed after the filter, so it sees its inputs)."""
    seen: list[int] = []
    compute = trainer._compute_loss

    def recorded(model, inputs):
        seen.append(int(inputs[KEPT].sum()))
        return compute(model, inputs)

    trainer._compute_loss = recorded
    return seen


def accumulated(accumulation: int, rows: int) -> dict:
    """``rows`` per generation batch over ``accumulation`` micro-batches, one generation per optimizer step."""
    return {"gradient_accumulation_steps": accumulation, "per_device_train_batch_size": rows // accumulation}


# bnpo and the entropy bonus divide by each micro-batch's tokens: exact with one micro-batch, refused with more.
ONE_MICRO_BATCH = [
    pytest.param("grpo", {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01}, 1, id="dapo-kl-entropy-acc1"),
    pytest.param("grpo", {"loss_type": "bnpo", "beta": 0.04}, 1, id="bnpo-kl-acc1"),
    pytest.param("grpo", {"loss_type": "grpo", "beta": 0.04, "entropy_coef": 0.01}, 1, id="grpo-kl-entropy-acc1"),
]
ACCUMULATED = [
    pytest.param(kind, settings, accumulation, id=f"{name}-acc{accumulation}")
    for accumulation in (1, 2, 4)
    for kind, settings, name in (
        ("grpo", {"loss_type": "dapo"}, "dapo"),  # TRL's default: normalised by tokens
        ("grpo", {"loss_type": "grpo"}, "grpo"),  # averaged over sequences: rescaled
        ("grpo", {"loss_type": "grpo", "beta": 0.04}, "grpo-kl"),
        ("grpo", {"loss_type": "dr_grpo"}, "dr_grpo"),
        ("rloo", {"beta": 0.05}, "rloo-kl"),
    )
]


# TRL 1.16's configs still set the name transformers 5.24 deprecated; nothing for us to change.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("kind", "settings", "accumulation"), ONE_MICRO_BATCH + ACCUMULATED)
def test_dropped_groups_contribute_no_gradient_the_update_is_the_kept_groups_alone(
    kind, settings, accumulation, policy, tmp_path
):
    filtered = make_trainer(kind, policy, tmp_path / "filtered", **settings, **accumulated(accumulation, ROWS))
    seen = capture_generation(filtered)
    install_snr_filter(filtered, KEEP_TWO)
    spread = micro_batch_kept_rows(filtered)
    start = weights(filtered)
    filtered.train()
    raw, trained = seen["raw"], seen["trained"]
    kept = trained[KEPT]
    by_group = kept.view(-1, NUM_GENERATIONS)
    assert (by_group == by_group[:, :1]).all()  # whole groups are kept or dropped ...
    assert by_group[:, 0].tolist().count(True) == 2  # ... two of each
    assert sum(spread) == 2 * NUM_GENERATIONS
    assert len(spread) == accumulation
    if accumulation > 1:
        assert len(set(spread)) > 1  # unevenly: a per-micro-batch weight would show
    rows = kept.nonzero().flatten()
    dropped = (~kept).nonzero().flatten()
    # Kept groups are unchanged; dropped ones are out of every loss term (mask) and have no advantage.
    assert torch.equal(trained["completion_mask"][rows], raw["completion_mask"][rows])
    assert torch.equal(trained["advantages"][rows], raw["advantages"][rows])
    assert int(trained["completion_mask"][dropped].sum()) == 0
    assert not trained["advantages"][dropped].any()
    if "num_items_in_batch" in raw:
        assert int(trained["num_items_in_batch"]) == int(raw["completion_mask"][rows].sum())
    step_filtered = update(filtered, start)

    alone_settings = settings | accumulated(accumulation, len(rows))
    alone = make_trainer(kind, policy, tmp_path / "alone", **alone_settings)
    assert all(torch.equal(p, start[name]) for name, p in alone.model.named_parameters())  # the same start
    replay(alone, rows_of(raw, rows))
    alone.train()
    step_alone = update(alone, start)

    every = make_trainer(kind, policy, tmp_path / "every", **settings, **accumulated(accumulation, ROWS))
    replay(every, {k: v for k, v in raw.items() if k not in (KEPT, SCALE)})
    every.train()
    step_every = update(every, start)

    assert step_filtered.abs().max() > 1e-4  # the step moved the weights
    torch.testing.assert_close(step_filtered, step_alone, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(step_filtered, step_every, rtol=1e-2, atol=1e-5)  # the dropped groups did matter
    logged = filtered.state.log_history[0]
    assert logged["rollout/filter_kept_count"] == 2
    assert logged["rollout/filter_kept_rows"] == 2 * NUM_GENERATIONS
    assert logged["rollout/filter_engaged"] == 1


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_vagen_trains_on_the_kept_groups_alone_with_their_advantages_scaled_by_the_root_of_the_kept_share(
    policy, tmp_path
):
    """VAGEN drops the rows and multiplies the kept ones' advantages by sqrt(kept groups / groups): the filtered
    update equals a trainer's on the kept rows alone with advantages so scaled (KL unscaled in both), under a
    sequence-mean loss with KL and two micro-batches, where the rows-over-kept weight applies too."""
    settings = {"loss_type": "grpo", "beta": 0.04} | accumulated(2, ROWS)
    filtered = make_trainer("grpo", policy, tmp_path / "filtered", **settings)
    seen = capture_generation(filtered)
    # top_p 0.3: the largest variance is at least a quarter of the total, so one or two groups reach it
    install_snr_filter(filtered, SNRFilter(variant="vagen", value=0.3))
    start = weights(filtered)
    filtered.train()
    raw, trained = seen["raw"], seen["trained"]
    rows = trained[KEPT].nonzero().flatten()
    n_kept = len(rows) // NUM_GENERATIONS
    assert 1 <= n_kept <= 2
    scale = (n_kept / (ROWS // NUM_GENERATIONS)) ** 0.5
    torch.testing.assert_close(trained["advantages"][rows], raw["advantages"][rows] * scale)
    step_filtered = update(filtered, start)

    alone = make_trainer("grpo", policy, tmp_path / "alone", **settings | accumulated(2, len(rows)))
    scaled = rows_of(raw, rows)
    scaled["advantages"] = scaled["advantages"] * scale
    replay(alone, scaled)
    alone.train()
    unscaled = make_trainer("grpo", policy, tmp_path / "unscaled", **settings | accumulated(2, len(rows)))
    replay(unscaled, rows_of(raw, rows))
    unscaled.train()

    assert step_filtered.abs().max() > 1e-4
    torch.testing.assert_close(step_filtered, update(alone, start), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(step_filtered, update(unscaled, start), rtol=1e-2, atol=1e-5)  # the scale did matter


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_on_alert_the_filter_engages_for_the_step_after_the_alert_state_and_its_series_are_stored(
    service, run_name, tmp_path, caplog
):
    """The run's TemplateCollapse holds from the first scored step (FIRE_AT_ONCE, the service's own rule on the
    figures it scored from this trainer's batches): pending at step 1, firing at 2. Each step's reward function
    waits until the previous step is scored and the watcher has looked twice (tiny_trainer.paced), as a real step
    outlasts its scoring; the filter then acts from step 3 on, the step after the firing (pending does not engage
    it by default)."""
    from collapse_monitor.integrations.trl import attach

    monitor = Monitor(service.url, run_name, spool_dir=tmp_path / "spool", alerts=FIRE_AT_ONCE, strict=True)
    args = grpo_config(tmp_path / "out", max_completion_length=8, max_steps=3, save_strategy="no")
    trainer = paced_trainer(monitor, args, ROOMS)
    snr_filter = SNRFilter(strategy="top_k_abs", value=1, engage="on_alert")  # TemplateCollapse firing
    callback = attach(trainer, monitor, snr_filter=snr_filter, alert_poll_seconds=0.1)
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        trainer.train()
    assert monitor.flush(60)

    assert callback.snr_filter is not None
    [(step, event)] = callback.snr_filter.engagement.history
    assert (step, event.rule, event.state, event.step) == (3, "TemplateCollapse", "firing", 2)
    assert "SNR filter engaged at training step 3" in caplog.text
    assert "SNR filter (ragen top_k_abs 1) keeps 1 of 2 groups (4 rows) for step 3" in caplog.text

    def series(name: str) -> dict[int, float]:
        return {p["step"]: p["value"] for p in monitor.metrics([name], sampler="trainer")}

    assert series("rollout/filter_engaged") == {1: 0.0, 2: 0.0, 3: 1.0}
    assert series("rollout/filter_kept_count") == {1: 2.0, 2: 2.0, 3: 1.0}
    assert series("rollout/filter_kept_rows") == {1: 8.0, 2: 8.0, 3: 4.0}
    # What TRL logged after each step followed its batch: the policy's own entropy among it.
    assert set(series("actor/entropy")) == {1, 2, 3}
    assert set(series("loss")) == {1, 2, 3}
    # Every group reached the service, before the filter: the diagnostics see what the policy generated.
    assert [len(b["trajectories"]) for b in service.payloads(run_name)] == [8, 8, 8]
    stats = monitor.stats()
    assert (stats.sent, stats.figures_sent, stats.figures_rejected, stats.rejected) == (3, 3, 0, 0)
    monitor.close()


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
def test_settings_the_filter_cannot_work_with_are_refused_at_install_naming_them(policy, tmp_path):
    trainer = make_trainer("grpo", policy, tmp_path / "out")
    with pytest.raises(ValueError, match="SNRFilter engage='on_alert' needs a monitor's alerts"):
        install_snr_filter(trainer, SNRFilter(engage="on_alert"))
    trainer.use_liger_kernel = True
    with pytest.raises(ValueError, match="use_liger_kernel: the Liger loss computes its own normalisation"):
        install_snr_filter(trainer, KEEP_TWO)
    trainer.use_liger_kernel = False
    trainer.loss_type = "new_loss"
    with pytest.raises(
        ValueError, match="loss_type must be one of dapo, bnpo, cispo, vespo, grpo, sapo, dr_grpo, luspo"
    ):
        install_snr_filter(trainer, KEEP_TWO)
    trainer.loss_type = "dapo"
    trainer.args.steps_per_generation = 2
    trainer.loss_type = "bnpo"
    with pytest.raises(ValueError, match=r"loss_type='bnpo' with 2 micro-batches per generation batch"):
        install_snr_filter(trainer, KEEP_TWO)
    trainer.loss_type = "dapo"
    trainer._entropy_bonus_enabled = True
    with pytest.raises(ValueError, match=r"^entropy_coef with 2 micro-batches .* use loss_type='dapo'"):
        install_snr_filter(trainer, KEEP_TWO)
    trainer._entropy_bonus_enabled = False
    trainer.args.steps_per_generation = 1
    trainer.num_generations = 1
    with pytest.raises(ValueError, match="num_generations must be at least 2, got 1"):
        install_snr_filter(trainer, KEEP_TWO)
    with pytest.raises(TypeError, match="needs a TRL GRPOTrainer or RLOOTrainer; object has no _calculate_rewards"):
        install_snr_filter(object(), KEEP_TWO)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_a_rollback_returns_to_the_newest_checkpoint_before_the_onset_and_resumes_with_the_filter_engaged(
    service, run_name, tmp_path
):
    """TemplateCollapse (the service's rule on posted matrices) pending at step 3, firing at 4: training stops at
    the end of step 5, the step that began after the firing was seen. A checkpoint every step, three kept, and
    checkpoint-1 with them: its policy generated step 2's batch, the last before the onset (checkpoint-2's
    generated step 3's). Training resumes from it, as TRL resumes, with the filter engaged from then on."""
    from transformers import TrainerCallback

    from collapse_monitor.integrations.trl import attach

    monitor = Monitor(service.url, run_name, spool_dir=tmp_path / "spool", alerts=ALERTS, strict=True)
    out = tmp_path / "out"
    args = grpo_config(out, max_completion_length=8, max_steps=5, save_strategy="steps", save_steps=1)
    trainer = paced_trainer(monitor, args, ROOMS)
    posted: set[int] = set()

    class Collapse(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
        """The service scores each step's matrix with its batch: collapsed from step 3 on."""

        def on_step_end(self, _args, state, _control, **_kwargs):
            if state.global_step not in posted:
                posted.add(state.global_step)
                post_matrices(service.url, run_name, {state.global_step: state.global_step >= 3})

    trainer.add_callback(Collapse())
    snr_filter = SNRFilter(strategy="top_k_abs", value=1, engage="on_alert")  # TemplateCollapse firing
    callback = attach(trainer, monitor, snr_filter=snr_filter, rollback_on=("firing",), alert_poll_seconds=0.1)
    trainer.train()
    assert trainer.state.global_step == 5
    checkpoint = callback.take_rollback()
    assert checkpoint == str(out / "checkpoint-1")
    assert callback.take_rollback() is None  # handed back once
    # the three newest, and the one the rollback needs; checkpoint-2 deleted
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (1, 3, 4, 5)]
    assert callback.snr_filter is not None
    [(step, event)] = callback.snr_filter.engagement.history  # engaged for step 5's batch, when firing was seen
    assert (step, event.rule, event.sampler, event.state, event.onset_step) == (
        5,
        "TemplateCollapse",
        "matrix",
        "firing",
        3,
    )

    trainer.args.max_steps = 3
    trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == 3
    assert monitor.flush(60)
    # Steps 2 and 3 again, from the checkpoint: the service keeps the resumed history as the run's current one.
    assert [b["step"] for b in service.payloads(run_name) if "trajectories" in b] == [1, 2, 3, 4, 5, 2, 3]
    engaged = {p["step"]: p["value"] for p in monitor.metrics(["rollout/filter_engaged"], sampler="trainer")}
    assert engaged == {1: 0.0, 2: 1.0, 3: 1.0}  # the resumed steps, engaged for good
    monitor.close()


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
def test_a_rollback_needs_the_filter_and_the_trainers_own_checkpoints(service, run_name, tmp_path, policy):
    from collapse_monitor.integrations.trl import attach

    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, enabled=False)
    trainer = make_trainer("grpo", policy, tmp_path / "out", save_strategy="steps", save_steps=1)
    with pytest.raises(ValueError, match=r"rollback_on resumes training with the SNR filter engaged: pass snr_filter"):
        attach(trainer, monitor, rollback_on=("firing",))
    with pytest.raises(ValueError, match="states must be among pending, firing, resolved, dropped, got burning"):
        attach(trainer, monitor, snr_filter=KEEP_TWO, rollback_on=("burning",))
    with pytest.raises(ValueError, match="rollback_keep must be a whole number of checkpoints >= 1, got 0"):
        attach(trainer, monitor, snr_filter=KEEP_TWO, rollback_on=("firing",), rollback_keep=0)
    trainer.args.save_total_limit = 2
    with pytest.raises(
        ValueError, match=r"rollback_on keeps its own checkpoints .* leave save_total_limit unset, got 2"
    ):
        attach(trainer, monitor, snr_filter=KEEP_TWO, rollback_on=("firing",))
    no_saves = make_trainer("grpo", policy, tmp_path / "out")
    with pytest.raises(ValueError, match="set save_strategy='steps' and save_steps"):
        attach(no_saves, monitor, snr_filter=KEEP_TWO, rollback_on=("firing",))


def flat_reward(completion_ids, **_kwargs):
    """Every completion scores the same: no group spreads, so RAGEN's linear top_p keeps none."""
    return [1.0 for _ in completion_ids]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_a_step_that_keeps_no_group_is_skipped_and_training_stops_after_the_limit(policy, tmp_path, caplog):
    """AdamW with weight decay and warm-up: a zero-gradient step would still move the weights (decay) and
    the learning rate (scheduler). Neither moves; each skipped step is warned; the third in a row stops."""
    trainer = make_trainer(
        "grpo", policy, tmp_path / "out", max_steps=6, optim="adamw_torch", weight_decay=0.1, warmup_steps=3
    )
    trainer.reward_funcs = [flat_reward]
    installed = install_snr_filter(trainer, SNRFilter(max_skipped_in_a_row=3))
    start = weights(trainer)
    with (
        caplog.at_level(logging.WARNING, logger="collapse_monitor"),
        pytest.raises(
            RuntimeError, match=r"kept no group for 3 steps in a row \(up to step 3; max_skipped_in_a_row=3\)"
        ),
    ):
        trainer.train()
    assert not update(trainer, start).any()  # no decay, no momentum: the weights never moved
    assert trainer.lr_scheduler.last_epoch == 0  # the warm-up never advanced
    assert (installed.engagement.empty.n_skipped, installed.engagement.empty.n_in_a_row) == (3, 3)
    warned = [r.getMessage() for r in caplog.records if "update is skipped" in r.getMessage()]
    assert len(warned) == 3
    assert "kept no group for step 1: its update is skipped (1 in a row, training stops at 3)" in warned[0]
    assert [entry["rollout/filter_skipped"] for entry in trainer.state.log_history] == [1.0, 1.0]
    assert all(entry["rollout/filter_kept_count"] == 0 for entry in trainer.state.log_history)
