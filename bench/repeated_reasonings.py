"""What scoring a repeated reasoning once saves, on a real multi-turn step.

RAGEN's trajectory sampler draws its turns with replacement, so about a quarter of its 64 rows repeat
another (the same turn of the same episode); ``scoring.cross_scores`` scores each distinct reasoning once
and copies its row. This times the kernel on the trajectory sampler's batch of a recorded agent step,
as the service draws it, against the same batch with each repeat made distinct (its last token changed:
the same lengths, so the work the kernel did before it shared repeats), in one run, and checks that
the rows both batches share score the same.

    PYTHONPATH=$PWD:$PWD/client python bench/repeated_reasonings.py [--arm rooms-healthy-s0] [--step 8]

Prints JSON. One torch thread (a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench.real_run import zoo
from scoring import ScoringBatch, load_scorer, score_batch
from scoring.budget import batch_cost
from scoring.config import CACHE_DIR
from scoring.samplers import draw_samplers
from service.jobs.rollouts import tokenized
from service.schemas.inputs import BatchIn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", default="rooms-healthy-s0", help="a recorded multi-turn arm (envs.AGENT_ARMS)")
    parser.add_argument("--step", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = zoo.zoo_settings(args.cache_dir)
    config = settings.scoring_config("smollm2-135m")
    scorer = load_scorer(config, args.cache_dir)
    record = next(s for s in zoo.read_record(args.arm) if s["step"] == args.step)
    trajectories = tokenized(BatchIn.model_validate(zoo.batch_of(record)), scorer)
    rows = draw_samplers(("trajectory",), trajectories, 64, seed=[0, args.step])["trajectory"]
    assert rows is not None
    shared = rows.batch
    repeats: dict[tuple[int, ...], int] = {}
    distinct_reasonings = []
    for z in shared.reasonings:  # the k-th repeat's last token moved by k: the same length, not a repeat
        k = repeats[z] = repeats.get(z, -1) + 1
        distinct_reasonings.append((*z[:-1], (z[-1] + k) % scorer.vocab_size) if k and z else z)
    unshared = ScoringBatch.from_rows(shared.prompts, distinct_reasonings, shared.group_ids)
    first_rows = [r for r, (a, b) in enumerate(zip(shared.reasonings, distinct_reasonings, strict=True)) if a == b]

    seconds = {}
    scores = {}
    score_batch(scorer, ScoringBatch.from_rows(shared.prompts[:2], shared.reasonings[:2], [0, 1]), config)  # warm-up
    for name, batch in (("unshared", unshared), ("shared", shared)):
        started = time.perf_counter()
        scores[name] = score_batch(scorer, batch, config)
        seconds[name] = time.perf_counter() - started
    delta = np.abs(scores["shared"].L_seq[first_rows] - scores["unshared"].L_seq[first_rows]).max()
    print(
        json.dumps(
            {
                "arm": args.arm,
                "step": args.step,
                "rows": shared.n_rows,
                "distinct_reasonings": len(set(shared.reasonings)),
                "distinct_prompts": len(set(shared.column_prompts)),
                "tokens": {
                    "shared": scores["shared"].tokens_processed,
                    "unshared": scores["unshared"].tokens_processed,
                },
                "tokens_predicted": {"shared": batch_cost(shared).tokens, "unshared": batch_cost(unshared).tokens},
                "seconds": {k: round(v, 2) for k, v in seconds.items()},
                "speedup": round(seconds["unshared"] / seconds["shared"], 3),
                "token_ratio": round(scores["unshared"].tokens_processed / scores["shared"].tokens_processed, 3),
                "max_abs_delta_L_seq_common_rows": float(delta),
                "load_average": os.getloadavg(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
