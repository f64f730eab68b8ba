"""The scoring budget's cost model against the kernel: predicted vs actual seconds, step after step.

A worker's bookkeeping (``service.jobs.budget``: a warm-up, then the throughput learned from every
scored batch) plans a sequence of steps of a few shapes, each twice in turn, and the kernel scores
each plan. Per step it prints the plan (rows of rows available, window) and the predicted and actual
kernel seconds; the summary gives, per shape, the ratio actual / predicted once the shape was seen
(``measured``) and at its first sight (the warm-up's or another shape's rate, conservative by design).

    python bench/budget.py [--model tiny-random|smollm2-135m] [--budget SECONDS] [--rounds 2] [--quick]

Shapes (rows x distinct prompts x reasoning tokens; prompts of ~200 tokens sharing a 64-token head;
``first_turn`` keeps every prompt, ``trajectory`` rows are their own columns):
    default   64 x 8 x ~300   a default-shaped step (sampler.num_samples 64, 8 prompt groups)
    long      32 x 8 x 1500   windowed to max_reasoning_tokens (512)
    wide      64 x 32 x ~256  many prompts
    draws     64 x 64 x ~200  the trajectory sampler of a multi-prompt batch
    --quick   rows and reasoning halved

Prints one JSON object: the model, threads, budget, the 1-minute load average before and after (the
figures of a shared machine move with it), per-step records and the per-shape summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from scoring import ScoringBatch, ScoringConfig, load_scorer, score_batch
from scoring.config import CACHE_DIR
from scoring.window import DEFAULT_MAX_REASONING_TOKENS, sequence_limit
from service.jobs.budget import Budget, ScoringRates

SHAPES = {  # rows, distinct prompts, reasoning tokens, keeps columns
    "default": (64, 8, 300, True),
    "long": (32, 8, 1500, True),
    "wide": (64, 32, 256, True),
    "draws": (64, 64, 200, False),
}


def build(shape: str, vocab: int, quick: bool, seed: int) -> tuple[ScoringBatch, bool]:
    rows, n_prompts, reasoning, keeps_columns = SHAPES[shape]
    if quick:
        rows, reasoning = rows // 2, reasoning // 2
    rng = np.random.default_rng(seed)
    head = [int(t) for t in rng.integers(3, vocab, 64)]
    prompts = [head + [int(t) for t in rng.integers(3, vocab, int(rng.integers(120, 150)))] for _ in range(n_prompts)]
    groups = [r % n_prompts for r in range(rows)] if keeps_columns else list(range(rows))
    lengths = [max(2, int(reasoning * rng.uniform(0.9, 1.1))) for _ in range(rows)]
    return ScoringBatch.from_rows(
        [prompts[r % n_prompts] for r in range(rows)],
        [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths],
        groups,
    ), keeps_columns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--budget", type=float, default=None, help="kernel seconds per step; default: none")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ScoringConfig(model=args.model, device="cpu")
    scorer = load_scorer(config, CACHE_DIR)
    limit = sequence_limit(scorer.max_positions, config.max_batch_tokens)
    rates = ScoringRates()
    load_before = os.getloadavg()[0]
    steps: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for shape in args.shapes.split(","):
            batch, keeps_columns = build(shape, scorer.vocab_size, args.quick, seed=round_)
            # A budget of none would skip the warm-up: the first step then has no prediction.
            budget = Budget(
                args.budget if args.budget is not None else 1e9,
                rates,
                scorer,
                config,
                limit,
                DEFAULT_MAX_REASONING_TOKENS,
            )
            budget.start({shape: batch})
            plan, planned, cut = budget.plan(shape, batch, keeps_columns=keeps_columns)
            started = time.perf_counter()
            cross = score_batch(scorer, planned, config)
            seconds = time.perf_counter() - started
            budget.spent(planned, cross.tokens_processed, seconds)
            result = budget.result(plan, seconds, cross.tokens_processed, cut.max_reasoning_tokens)
            steps.append({"round": round_, "shape": shape, **result.model_dump()})
    summary = {}
    for shape in args.shapes.split(","):
        ratios = [
            s["seconds"] / s["predicted_seconds"] for s in steps if s["shape"] == shape and s["predicted_seconds"]
        ]
        summary[shape] = {
            "actual_over_predicted_first": round(ratios[0], 3) if ratios else None,
            "actual_over_predicted_later": round(statistics.mean(ratios[1:]), 3) if len(ratios) > 1 else None,
            "seconds_full": next(s["seconds"] for s in steps if s["shape"] == shape),
        }
    print(
        json.dumps(
            {
                "model": args.model,
                "threads": torch.get_num_threads(),
                "budget_seconds": args.budget,
                "quick": args.quick,
                "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # a shared machine's noise
                "steps": steps,
                "summary": summary,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
