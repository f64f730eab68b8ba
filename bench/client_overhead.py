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
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tiny_grpo
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
    from collapse_monitor import Monitor
    from collapse_monitor.integrations.trl import CollapseMonitorCallback, attach

    def reward(completions: list[Any], **_kwargs: Any) -> list[float]:
        return [len(c[0]["content"]) / 10 for c in completions]

    integration_seconds: list[float] = []
    tiny_grpo.timed(CollapseMonitorCallback, "on_step_end", integration_seconds)

    def run(monitored: bool, index: int) -> list[float]:
        grpo = tiny_grpo.trainer(folder, index, steps, reward)
        if not monitored:
            return tiny_grpo.step_seconds(grpo)
        monitor = Monitor(url, f"bench-trl-{index}", spool_dir=folder / "spool", schedule={"every": 1000})
        attach(grpo, monitor)
        seconds = tiny_grpo.step_seconds(grpo)
        monitor.close()
        return seconds

    plain: list[float] = []
    monitored: list[float] = []
    for r in range(rounds):
        plain += run(False, 2 * r)
        monitored += run(True, 2 * r + 1)
    return {
        "steps_per_run": steps,
        "rounds": rounds,
        "completions_per_step": tiny_grpo.COMPLETIONS_PER_STEP,
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
