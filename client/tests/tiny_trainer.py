"""What the TRL tests share: the tiny policy, their GRPO settings, a trainer that records what it generated,
alert pacing.

The policy is the service's own tiny-random Llama (a config and a BPE tokenizer trained on the fly)
with a chat template, so nothing is downloaded.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from pathlib import Path

import datasets
from trl import GRPOConfig, GRPOTrainer

from collapse_monitor import Monitor

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# TemplateCollapse from the first scored step: retrieval must stay above an unreachable level, and
# H(Z|X) may move almost anywhere. The rule and its state machine are the service's own, on the
# figures it scored from the trainer's batches: pending at step 1, firing at step 2 (window 2). A tiny step
# holds 2 or 3 prompts, below the default min_prompts (4), so the rule is told to judge steps of 2.
FIRE_AT_ONCE = {
    "threshold": 1e6,
    "baseline_steps": 1,
    "window": 2,
    "entropy_band": 0.99,
    "entropy_band_above": 100,
    "min_prompts": 2,
}
NUM_GENERATIONS = 4
ROOMS = [[{"role": "user", "content": f"You are in room {i}. Which door leads out?"}] for i in range(8)]


def grpo_config(output_dir: Path | str, **overrides) -> GRPOConfig:
    """The TRL tests' GRPO settings: 8 rows a step in groups of ``NUM_GENERATIONS``, CPU, float32, seed 0,
    every step logged, nothing reported; ``overrides`` (TRL's names) per test."""
    settings = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 8,
        "num_generations": NUM_GENERATIONS,
        "logging_steps": 1,
        "report_to": "none",
        "bf16": False,
        "use_cpu": True,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    return GRPOConfig(**(settings | overrides))


def tiny_policy():
    from scoring.models import build_tiny_random

    model, tokenizer = build_tiny_random(seed=1)
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


class RecordingGRPOTrainer(GRPOTrainer):  # type: ignore[misc]  # trl is untyped here
    """Keeps the prompt and completion ids of every generation (what the policy really saw)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated: list[tuple[list, list]] = []

    def _generate(self, prompts):
        out = super()._generate(prompts)
        self.generated.append(([list(p) for p in out[0]], [list(c) for c in out[1]]))
        return out


def stop_async_loop(trainer) -> None:
    """TRL runs async reward functions on an event loop it stops at exit but never closes."""
    from trl.trainer.utils import shutdown_event_loop_in_daemon

    shutdown_event_loop_in_daemon(trainer.async_loop_thread, trainer.async_loop)
    trainer.async_loop.close()
    atexit.unregister(shutdown_event_loop_in_daemon)


def n_finished(monitor: Monitor) -> int:
    batches = monitor.run_info().get("batches", {})
    return int(batches.get("done", 0)) + int(batches.get("failed", 0))


def paced(monitor: Monitor, trainer_box: list, alert_polls: int = 2) -> Callable[..., list[float]]:
    """A reward function that, on the main process, waits until the previous step is scored and the
    alert watcher has looked ``alert_polls`` times since (0: no watcher): a real step is slower than its
    scoring, this tiny one is not. Other processes wait for the main one in the trainer's collectives."""

    def reward(completions, **_kwargs):
        trainer = trainer_box[0]
        done = trainer.state.global_step
        if done and trainer.accelerator.is_main_process:
            deadline = time.monotonic() + 60
            while n_finished(monitor) < done and time.monotonic() < deadline:
                time.sleep(0.05)
            polls = monitor.stats().alert_polls
            while monitor.stats().alert_polls < polls + alert_polls and time.monotonic() < deadline:
                time.sleep(0.02)
        return [float(len(c[0]["content"])) for c in completions]

    return reward


def paced_trainer(monitor: Monitor, args: GRPOConfig, prompts: list, alert_polls: int = 2) -> GRPOTrainer:
    """A GRPOTrainer of the tiny policy whose one reward function is ``paced`` on ``monitor``."""
    model, tokenizer = tiny_policy()
    box: list = []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[paced(monitor, box, alert_polls)],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    box.append(trainer)
    return trainer
