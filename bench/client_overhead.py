"""What the client costs a training loop: ``monitor.log`` latency, and a TRL step with and without it.

    python bench/client_overhead.py [--log-calls 500] [--trl-steps 12] [--rounds 3]

Starts ``collapse-monitor serve`` (scoring paused, so the service takes no CPU from the trainer
beyond ingest), then:

1. ``monitor.log`` on realistic 64-trajectory batches (2 turns, ~1 KB of text per turn, as
   bench/ingest.py), with the background thread posting every batch to the service meanwhile;
   one call every 20 ms, so the sender keeps up as it does at real step times.
2. A TRL ``GRPOTrainer`` training the tiny-random Llama on CPU (one thread, 16 completions of up
   to 24 tokens per step), once without and once with ``attach``, alternated ``--rounds`` times in
   this process; the ratio of the median step times is the overhead. The tiny policy is the worst
   case: the integration's cost per step is fixed while a real policy's step is much longer.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serving import percentiles, served


def batch(step: int) -> list[dict[str, Any]]:
    filler = "The box sits next to the wall; the goal is two tiles away and the hole blocks the middle row. "
    return [
        {
            "group_id": t // 8,
            "reward": float(t % 2),
            "turns": [
                {
                    "prompt": f"<|im_start|>user\nStep {step}, trajectory {t}, turn {k}. "
                    + filler * 7
                    + "<|im_end|>\n<|im_start|>assistant\n",
                    "response": "<think>"
                    + filler * 2
                    + f"So I move {'Up' if k else 'Left'}.</think><answer>Up</answer>",
                }
                for k in range(2)
            ],
        }
        for t in range(64)
    ]


def measure_log(url: str, calls: int, spool: Path) -> dict[str, Any]:
    from collapse_monitor import Monitor

    monitor = Monitor(url, "bench-log", spool_dir=spool, schedule={"every": 1000})
    batches = [batch(step) for step in range(calls + 20)]
    for step in range(20):  # warm-up: run creation, connection, first inserts
        monitor.log(step, batches[step])
    monitor.flush(60)
    latencies = []
    for step in range(20, calls + 20):
        t0 = time.perf_counter()
        monitor.log(step, batches[step])
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.02)
    delivered = monitor.flush(120)
    stats = monitor.stats()
    monitor.close()
    return {
        "trajectories_per_batch": 64,
        "calls": calls,
        "log": percentiles(latencies, digits=3),
        "delivered": delivered,
        "sent": stats.sent,
        "spilled": stats.spilled,
    }


def measure_trl(url: str, steps: int, rounds: int, folder: Path) -> dict[str, Any]:
    import datasets
    import torch
    from collapse_monitor import Monitor
    from collapse_monitor.integrations.trl import CollapseMonitorCallback, attach
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from scoring.models import build_tiny_random

    torch.set_num_threads(1)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    prompts = [[{"role": "user", "content": f"You are in room {i}. Which door leads out?"}] for i in range(64)]

    def reward(completions: list[Any], **_kwargs: Any) -> list[float]:
        return [len(c[0]["content"]) / 10 for c in completions]

    class StepClock(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *_args: Any, **_kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    integration_seconds: list[float] = []
    original = CollapseMonitorCallback.on_step_end

    def timed_step_end(self: Any, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        original(self, *args, **kwargs)
        integration_seconds.append(time.perf_counter() - t0)

    CollapseMonitorCallback.on_step_end = timed_step_end  # type: ignore[method-assign]  # timing only

    def run(monitored: bool, index: int) -> list[float]:
        model, tokenizer = build_tiny_random(seed=1)
        tokenizer.chat_template = template
        args = GRPOConfig(
            output_dir=str(folder / f"run-{index}"),
            per_device_train_batch_size=16,
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
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
        )
        clock = StepClock()
        trainer.add_callback(clock)
        if monitored:
            monitor = Monitor(url, f"bench-trl-{index}", spool_dir=folder / "spool", schedule={"every": 1000})
            attach(trainer, monitor)
        with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is for the JSON
            trainer.train()
        if monitored:
            monitor.close()
        return [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)][1:]  # the first steps warm up

    plain: list[float] = []
    monitored: list[float] = []
    for r in range(rounds):
        plain += run(False, 2 * r)
        monitored += run(True, 2 * r + 1)
    return {
        "steps_per_run": steps,
        "rounds": rounds,
        "completions_per_step": 16,
        "step_seconds_without": round(statistics.median(plain), 4),
        "step_seconds_with": round(statistics.median(monitored), 4),
        "step_time_ratio": round(statistics.median(monitored) / statistics.median(plain), 4),
        "integration_ms_per_step": percentiles(integration_seconds, digits=3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-calls", type=int, default=500)
    parser.add_argument("--trl-steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        settings = {
            "DATABASE_URL": f"sqlite:///{folder / 'bench.db'}",
            "DATA_DIR": str(folder),
            "DEFAULT_SCORER": "tiny-random",
            "SCORING_PAUSED": "true",
            "MAX_QUEUE_DEPTH": "1000000",
        }
        with served(settings) as url:
            result = {"log": measure_log(url, args.log_calls, folder / "spool")}
            result["trl"] = measure_trl(url, args.trl_steps, args.rounds, folder)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
