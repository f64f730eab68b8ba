"""TRL end to end: a real GRPOTrainer trains a tiny Llama on CPU and feeds a real service.

The trainer records what it generated from (``_generate``'s prompt and completion ids) so the test
can check what the service received (tiny_trainer.py).
"""

from __future__ import annotations

import logging
import math

import datasets
import pytest
from tiny_trainer import (
    FIRE_AT_ONCE,
    NUM_GENERATIONS,
    ROOMS,
    RecordingGRPOTrainer,
    grpo_config,
    paced_trainer,
    stop_async_loop,
    tiny_policy,
)

from collapse_monitor import Monitor


def length_reward(completions, completion_ids, **_kwargs):
    """A number for most completions; None (TRL: could not score) for lengths divisible by 4."""
    return [None if len(ids) % 4 == 0 else len(c[0]["content"]) / 10 for c, ids in zip(completions, completion_ids)]


async def parity_reward(completion_ids, **_kwargs):
    """An async reward function; None for lengths divisible by 3, so both are None at 12 (the limit)."""
    return [None if len(ids) % 3 == 0 else float(len(ids) % 2) for ids in completion_ids]


WEIGHTS = [1.0, 0.5]


def expected_reward(text: str, ids: list[int]) -> float | None:
    """TRL's total: the weighted sum of the rewards that are not None; None when all are."""
    length = None if len(ids) % 4 == 0 else len(text) / 10
    parity = None if len(ids) % 3 == 0 else float(len(ids) % 2)
    parts = [w * r for w, r in zip(WEIGHTS, [length, parity]) if r is not None]
    return sum(parts) if parts else None


# TRL 1.16's GRPOConfig still sets the name transformers 5.24 deprecated; nothing for us to change.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_a_grpo_run_sends_each_step_with_its_prompts_rewards_groups_and_checkpoints(service, run_name, tmp_path):
    model, tokenizer = tiny_policy()
    output_dir = service.folder / "checkpoints" / run_name
    args = grpo_config(
        output_dir,
        max_completion_length=12,
        max_steps=3,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
        reward_weights=WEIGHTS,
    )
    trainer = RecordingGRPOTrainer(
        model=model,
        reward_funcs=[length_reward, parity_reward],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ROOMS}),
        processing_class=tokenizer,
    )
    # policy mode: the saved checkpoint is announced; no step is scheduled for scoring, so the
    # service stays idle while the trainer runs
    monitor = Monitor(
        service.url, run_name, spool_dir=tmp_path, scorer_mode="policy", schedule={"every": 1000}, strict=True
    )
    from collapse_monitor.integrations.trl import attach

    attach(trainer, monitor)
    trainer.train()
    assert monitor.flush(60)

    batches = service.payloads(run_name)
    assert [b["step"] for b in batches] == [1, 2, 3]
    assert len(trainer.generated) == 3
    for batch, (prompt_ids, completion_ids) in zip(batches, trainer.generated):
        sent = batch["trajectories"]
        assert len(sent) == 8
        assert [t["group_id"] for t in sent] == [i // NUM_GENERATIONS for i in range(8)]
        for t, p_ids, c_ids in zip(sent, prompt_ids, completion_ids):
            [turn] = t["turns"]
            # the prompt text tokenizes to exactly the ids the trainer generated from
            assert tokenizer(turn["prompt"], add_special_tokens=False)["input_ids"] == p_ids
            text = tokenizer.decode(c_ids, skip_special_tokens=True)
            assert turn["response"] == text
            expected = expected_reward(text, c_ids)
            assert (t["reward"] is None) == (expected is None)
            if expected is not None:
                assert math.isclose(t["reward"], expected, rel_tol=1e-6)
        # one prompt per group, NUM_GENERATIONS completions each
        assert len({t["turns"][0]["prompt"] for t in sent}) == 2

    rewards = [t["reward"] for b in batches for t in b["trajectories"]]
    assert None in rewards  # sent as null, and the service took them
    saved = [(str(output_dir / f"checkpoint-{step}"), "full", step) for step in (2, 3)]  # save_steps, last step
    assert service.checkpoints(run_name) == saved
    assert service.checkpoint_of_batches(run_name) == [(1, None), (2, None), (3, saved[0][0])]
    stats = monitor.stats()
    assert (stats.sent, stats.rejected, stats.checkpoints_sent) == (3, 0, 2)
    monitor.close()
    stop_async_loop(trainer)


def test_with_two_processes_the_main_process_sends_each_step_once_and_every_rank_stops_on_its_alert(
    service, run_name, tmp_path
):
    """torchrun, two CPU processes (gloo): every rank gathers its shard, rank 0 sends and watches the alerts."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "URL": service.url,
        "RUN": run_name,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore::FutureWarning",
    }
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(here / "trl_two_processes.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # both ranks stop together, at the end of the step that began after the alert fired (step 2), and
    # both engaged the SNR filter for the step after it became pending (step 1)
    assert sorted(line for line in run.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 sent 3 stopped at 3 engaged True",
        "rank 1 sent 0 stopped at 3 engaged True",
    ]
    with Monitor(service.url, run_name, spool_dir=tmp_path / "reader") as reader:
        engaged = {p["step"]: p["value"] for p in reader.metrics(["rollout/filter_engaged"], sampler="trainer")}
        kept = {p["step"]: p["value"] for p in reader.metrics(["rollout/filter_kept_count"], sampler="trainer")}
    assert engaged == {1: 0.0, 2: 1.0, 3: 1.0}
    assert kept == {1: 2.0, 2: 1.0, 3: 1.0}
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]  # pending at step 1
    batches = service.payloads(run_name)
    assert [b["step"] for b in batches] == [1, 2, 3]
    for batch in batches:
        sent = batch["trajectories"]
        assert [t["group_id"] for t in sent] == [0, 0, 0, 0, 1, 1, 1, 1]
        prompts = [t["turns"][0]["prompt"] for t in sent]
        # each group is one prompt's num_generations completions, although each rank held half of them
        assert len(set(prompts[:4])) == 1
        assert len(set(prompts[4:])) == 1
        assert prompts[0] != prompts[4]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_an_alert_saves_a_checkpoint_when_pending_and_stops_training_within_one_step_of_firing(
    service, run_name, tmp_path, caplog
):
    """The run's TemplateCollapse is made to hold from the first scored step (FIRE_AT_ONCE: the service's
    own rule on the figures it scored from this trainer's batches): pending at step 1, firing at 2.
    A real step takes longer than scoring it; this tiny one does not, so its reward function waits
    until the service has scored the previous step and the watcher has looked twice since."""
    from collapse_monitor.integrations.trl import attach

    monitor = Monitor(service.url, run_name, spool_dir=tmp_path / "spool", alerts=FIRE_AT_ONCE, strict=True)
    # save_strategy "no": the only checkpoints are the ones the alert asks for
    args = grpo_config(tmp_path / "out", max_completion_length=8, max_steps=20, save_strategy="no")
    trainer = paced_trainer(monitor, args, ROOMS)
    callback = attach(trainer, monitor, save_on=("pending",), stop_on=("firing",), alert_poll_seconds=0.1)
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        trainer.train()

    firing = monitor.alerts(rule="TemplateCollapse", state="firing")
    assert firing, monitor.alerts()
    fired_step = min(a["fired_step"] for a in firing)
    onset_step = min(a["onset_step"] for a in firing)
    assert (onset_step, fired_step) == (1, 2)
    # stopped at the end of the first step that began after the alert fired
    assert trainer.state.global_step == fired_step + 1
    assert callback.alert_actions is not None
    assert [
        (step, d.save, d.stop) for step, d in callback.alert_actions.history if d.events[0].sampler == "first_turn"
    ] == [
        (onset_step + 1, True, False),
        (fired_step + 1, False, True),
    ]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == [f"checkpoint-{onset_step + 1}"]
    assert f"firing at step {fired_step}" in caplog.text
    assert f"stopping training at training step {fired_step + 1}" in caplog.text
    assert [b["step"] for b in service.payloads(run_name)] == [1, 2, 3]
    monitor.close()
