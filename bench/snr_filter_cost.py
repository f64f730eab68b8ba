"""What the SNR filter costs a trainer: the selection (pure Python) by batch shape, and a TRL step with and without it.

    PYTHONPATH=.:client python bench/snr_filter_cost.py [--repeats 50] [--trl-steps 10] [--rounds 3]

1. ``SNRFilter.select`` (the client's pure-Python copy, which runs on the training thread each
   generation batch) on random rewards of ``groups x completions`` shapes, for RAGEN's linear and
   softmax top_p and the upstream variant; the median of ``--repeats`` calls, in this process's CPU
   time (what the selection costs) and in wall time (on a loaded machine, calls longer than a
   scheduler slice also wait for the other processes).
2. A TRL ``GRPOTrainer`` training the tiny-random Llama on CPU (one thread, 16 completions of up to
   24 tokens per step, 4 groups), once without and once with ``install_snr_filter`` (RAGEN top_p 0.9,
   engaged from the start), alternated ``--rounds`` times in this process; the ratio of the median step
   times is the overhead, and the filter's own time per generation batch (reading the rewards, the
   selection, the masks and the token recount) is timed around it. The masked completions still go
   through the forward and backward passes: masking saves no compute (RAGEN's drop, ``output="select"``
   in verl, would).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tiny_grpo

SHAPES = ((8, 8), (64, 8), (256, 16), (1024, 16))


def measure_selection(repeats: int) -> list[dict[str, Any]]:
    from collapse_monitor.snr_filter import SNRFilter

    filters = {
        "ragen top_p linear": SNRFilter(),
        "ragen top_p softmax": SNRFilter(top_p_prob_mode="softmax"),
        "upstream top_p": SNRFilter(variant="upstream"),
    }
    rng = random.Random(0)
    out = []
    for n_groups, size in SHAPES:
        rewards = [[float(rng.randint(0, 1)) for _ in range(size)] for _ in range(n_groups)]
        row: dict[str, Any] = {"groups": n_groups, "completions_per_group": size}
        for name, snr in filters.items():
            cpu, wall = [], []
            for _ in range(repeats):
                c0, t0 = time.process_time(), time.perf_counter()
                snr.select(rewards)
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - t0)
            row[f"{name} cpu ms"] = round(statistics.median(cpu) * 1e3, 3)
            row[f"{name} wall ms"] = round(statistics.median(wall) * 1e3, 3)
        out.append(row)
    return out


def measure_trl(steps: int, rounds: int, folder: Path) -> dict[str, Any]:
    from collapse_monitor.integrations.trl_filter import TRLSNRFilter, install_snr_filter
    from collapse_monitor.snr_filter import SNRFilter

    def reward(completions: list[Any], **_kwargs: Any) -> list[float]:
        return [len(c[0]["content"]) % 5 / 4 for c in completions]

    filter_seconds: list[float] = []
    tiny_grpo.timed(TRLSNRFilter, "_filter", filter_seconds)
    kept: list[float] = []

    def run(filtered: bool, index: int) -> list[float]:
        grpo = tiny_grpo.trainer(folder, index, steps, reward)
        if filtered:
            install_snr_filter(grpo, SNRFilter(strategy="top_p", value=0.9))
        seconds = tiny_grpo.step_seconds(grpo)
        if filtered:
            kept.extend(log["rollout/filter_kept_ratio"] for log in grpo.state.log_history if "loss" in log)
        return seconds

    plain: list[float] = []
    with_filter: list[float] = []
    for r in range(rounds):
        plain += run(False, 2 * r)
        with_filter += run(True, 2 * r + 1)
    return {
        "steps_per_run": steps,
        "rounds": rounds,
        "completions_per_step": tiny_grpo.COMPLETIONS_PER_STEP,
        "step_seconds_without": round(statistics.median(plain), 4),
        "step_seconds_with": round(statistics.median(with_filter), 4),
        "step_time_ratio": round(statistics.median(with_filter) / statistics.median(plain), 4),
        "filter_ms_per_generation_p50": round(statistics.median(filter_seconds) * 1e3, 3),
        "filter_ms_per_generation_max": round(max(filter_seconds) * 1e3, 3),
        "kept_group_ratio_mean": round(statistics.mean(kept), 3) if kept else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--trl-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result: dict[str, Any] = {"selection": measure_selection(args.repeats)}
    with tempfile.TemporaryDirectory() as tmp:
        result["trl"] = measure_trl(args.trl_steps, args.rounds, Path(tmp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
