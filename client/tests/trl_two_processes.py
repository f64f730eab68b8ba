"""Run by test_trl under torchrun (2 processes, gloo, CPU): GRPO for two steps with the integration attached.

Reads OUT, URL and RUN from the environment; writes how many batches this rank's monitor sent.
"""

from __future__ import annotations

import os
import sys

import datasets
from scoring.models import build_tiny_random
from trl import GRPOConfig, GRPOTrainer

from collapse_monitor import Monitor
from collapse_monitor.integrations.trl import attach

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reward(completions, **_kwargs):
    return [float(len(c[0]["content"])) for c in completions]


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
        max_steps=2,
        report_to="none",
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    prompts = [[{"role": "user", "content": f"Room {i}: which door leads out?"}] for i in range(16)]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    monitor = Monitor(os.environ["URL"], os.environ["RUN"], spool_dir=os.path.join(os.environ["OUT"], "spool"))
    attach(trainer, monitor)
    trainer.train()
    monitor.close()
    sys.stdout.write(f"rank {trainer.accelerator.process_index} sent {monitor.stats().sent}\n")


if __name__ == "__main__":
    main()
