"""Run by test_trl under torchrun (2 processes, gloo, CPU): GRPO with the integration attached, until an alert stops it.

Reads OUT, URL and RUN from the environment; writes how many batches this rank's monitor sent and
the step it stopped at. The run's TemplateCollapse is pending at step 1 and fires at step 2 (the
settings of test_trl.FIRE_AT_ONCE); only the main process watches the alerts, and both ranks must
save at step 2 and stop at step 3 together (a rank left behind would hang in the next collective).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import datasets
from scoring.models import build_tiny_random
from trl import GRPOConfig, GRPOTrainer

from collapse_monitor import Monitor
from collapse_monitor.integrations.trl import attach

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


FIRE_AT_ONCE = {"threshold": 1e6, "baseline_steps": 1, "window": 2, "entropy_band": 0.99, "entropy_band_above": 100}


def n_finished(monitor: Monitor) -> int:
    batches = monitor.run_info().get("batches", {})
    return int(batches.get("done", 0)) + int(batches.get("failed", 0))


def paced(monitor: Monitor, trainer_box: list) -> Callable[..., list[float]]:
    """The main rank's reward waits until the previous step is scored and the watcher has looked twice
    since (a real step is slower than its scoring); the other rank waits for it in the collectives."""

    def reward(completions, **_kwargs):
        trainer = trainer_box[0]
        done = trainer.state.global_step
        if done and trainer.accelerator.is_main_process:
            deadline = time.monotonic() + 60
            while n_finished(monitor) < done and time.monotonic() < deadline:
                time.sleep(0.05)
            polls = monitor.stats().alert_polls
            while monitor.stats().alert_polls < polls + 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        return [float(len(c[0]["content"])) for c in completions]

    return reward


def main() -> None:
    model, tokenizer = build_tiny_random(seed=1)
    tokenizer.chat_template = CHAT_TEMPLATE
    # per process: 2 rows per micro-step, 2 micro-steps per generation -> 8 rows, 2 groups of 4, per step
    args = GRPOConfig(
        output_dir=os.environ["OUT"],
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=6,
        max_steps=6,
        report_to="none",
        bf16=False,
        use_cpu=True,
        save_strategy="no",  # the only checkpoint is the one the pending alert asks for
        seed=0,
    )
    prompts = [[{"role": "user", "content": f"Room {i}: which door leads out?"}] for i in range(16)]
    monitor = Monitor(
        os.environ["URL"], os.environ["RUN"], spool_dir=os.path.join(os.environ["OUT"], "spool"), alerts=FIRE_AT_ONCE
    )
    box: list = []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[paced(monitor, box)],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    box.append(trainer)
    attach(trainer, monitor, save_on=("pending",), stop_on=("firing",), alert_poll_seconds=0.1)
    trainer.train()
    monitor.close()
    rank = trainer.accelerator.process_index
    sys.stdout.write(f"rank {rank} sent {monitor.stats().sent} stopped at {trainer.state.global_step}\n")


if __name__ == "__main__":
    main()
