"""A few GRPO steps of the tiny random policy on CPU, timed step by step: the baseline the trainer-side
benchmarks (bench/client_overhead.py, bench/snr_filter_cost.py) compare a feature's step time against.

One thread, 16 completions of up to 24 tokens per step (4 groups of 4) over 64 distinct room prompts.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [[{"role": "user", "content": f"You are in room {i}. Which door leads out?"}] for i in range(64)]
COMPLETIONS_PER_STEP = 16
Reward = Callable[..., list[float]]


def trainer(folder: Path, index: int, steps: int, reward: Reward) -> Any:
    """A fresh GRPOTrainer (seed ``index``, output in ``folder/run-<index>``) on the tiny random policy."""
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from scoring.models import build_tiny_random

    torch.set_num_threads(1)
    model, tokenizer = build_tiny_random(seed=1)
    tokenizer.chat_template = TEMPLATE
    args = GRPOConfig(
        output_dir=str(folder / f"run-{index}"),
        per_device_train_batch_size=COMPLETIONS_PER_STEP,
        num_generations=4,
        max_completion_length=24,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        seed=index,
        dataloader_num_workers=0,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )


def step_seconds(grpo: Any) -> list[float]:
    """Trains ``grpo`` and returns its steps' wall times, the first two (warm-up) left out."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *_args: Any, **_kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    clock = StepClock()
    grpo.add_callback(clock)
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is for the JSON
        grpo.train()
    return [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)][1:]


def timed(owner: Any, name: str, seconds: list[float]) -> None:
    """Wraps the method ``owner.name`` so that each call's wall time is appended to ``seconds``."""
    original = getattr(owner, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)
