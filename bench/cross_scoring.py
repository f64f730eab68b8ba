"""Cross-scoring speed: the prefix-shared kernel against the naive per-pair scorer, in one run.

    python bench/cross_scoring.py --model smollm2-135m --shape first-turn [--quick]

Prints one JSON object: naive_seconds, kernel_seconds, speedup, token_ratio (tokens the naive
scorer processes / the fewest tokens exact scoring must process), max_abs_diff_L_seq,
max_abs_diff_entropy, rows, columns, and the settings. Both scorers run on the same batch in the
same process, so the speedup is a ratio measured under the same machine load.

Shapes (prompts share one system prompt; token counts are exact, lengths vary by a seeded +-10%):
    first-turn   8 prompts of ~200 tokens (130 shared), 4 traces each of ~64 tokens
    multi-turn   8 prompts of ~1,000 tokens (dialogue history), 4 traces each of ~128 tokens
    --quick      4 prompts, 2 traces each, prompts and traces halved: under a minute with
                 SmolLM2 on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from scoring import ScoringBatch, ScoringConfig, load_scorer, score_batch, score_batch_naive
from scoring.batch import Tokens

SHAPES = {
    # prompts, traces per prompt, prompt tokens, trace tokens
    "first-turn": (8, 4, 200, 64),
    "multi-turn": (8, 4, 1000, 128),
}
SYSTEM_TOKENS = 130
SENTENCES = (
    "You are an agent solving a puzzle in a grid world.",
    "Each turn you see the board and choose one action.",
    "The player stands left of the box and the target is two tiles up.",
    "Walls surround the room and a hole lies in the middle row.",
    "Reward: 0.0. The episode continues.",
    "I should push the box up twice, then step right to avoid the wall.",
    "Moving left first keeps the box away from the corner where it would get stuck.",
    "The goal is reachable in three moves if I go around the hole.",
    "Answer with one of Up, Down, Left or Right after thinking.",
    "Previous action: Right. The box moved one tile and is now next to the target.",
    "Let me count the tiles between the player and the goal before acting.",
    "If I go down now the hole blocks the only path, so up is safer.",
)


def token_stream(encode, rng: np.random.Generator, n_tokens: int) -> Tokens:
    """Exactly n_tokens ids of natural-looking text (seeded sentence order)."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids.extend(encode(" " + SENTENCES[int(rng.integers(len(SENTENCES)))]))
    return tuple(ids[:n_tokens])


def build_batch(encode, shape: str, quick: bool, seed: int = 0) -> ScoringBatch:
    n_prompts, per_prompt, prompt_len, trace_len = SHAPES[shape]
    if quick:
        n_prompts, per_prompt, prompt_len, trace_len = 4, 2, max(prompt_len // 2, SYSTEM_TOKENS + 20), trace_len // 2
    rng = np.random.default_rng(seed)
    system = token_stream(encode, rng, SYSTEM_TOKENS)
    prompts, reasonings, groups = [], [], []
    for g in range(n_prompts):
        length = round(prompt_len * rng.uniform(0.95, 1.05))
        prompt = system + token_stream(encode, rng, length - SYSTEM_TOKENS)
        for _ in range(per_prompt):
            prompts.append(prompt)
            reasonings.append(token_stream(encode, rng, round(trace_len * rng.uniform(0.9, 1.1))))
            groups.append(g)
    return ScoringBatch.from_rows(prompts, reasonings, groups)


def minimal_tokens(batch: ScoringBatch) -> int:
    """Tokens any exact scorer must run: each distinct prompt prefix once (a trie), then z_r[:-1] per pair."""
    trie: dict[int, dict] = {}
    nodes = 0
    distinct = set(batch.column_prompts)
    for prompt in distinct:
        node = trie
        for token in prompt:
            if token not in node:
                node[token] = {}
                nodes += 1
            node = node[token]
    return nodes + len(distinct) * sum(max(len(z) - 1, 0) for z in batch.reasonings)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help="tiny-random, smollm2-135m, a folder or a .gguf")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="first-turn")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--naive-micro-batch", type=int, default=4, help="pairs per naive forward (RAGEN batches)")
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/collapse-monitor").expanduser())
    args = parser.parse_args()

    config = ScoringConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_batch_tokens=args.max_batch_tokens
    )
    scorer = load_scorer(config, args.cache_dir)
    batch = build_batch(scorer.encode, args.shape, args.quick)
    warmup = ScoringBatch.from_rows([batch.prompts[0][:8]], [batch.reasonings[0][:8]], [0])
    score_batch(scorer, warmup, config)
    score_batch_naive(scorer, warmup)

    kernel, kernel_seconds = timed(lambda: score_batch(scorer, batch, config))
    naive, naive_seconds = timed(lambda: score_batch_naive(scorer, batch, micro_batch_size=args.naive_micro_batch))
    entropy_diff = max(
        (float(np.abs(a - b).max()) for a, b in zip(kernel.token_entropy, naive.token_entropy, strict=True) if len(a)),
        default=0.0,
    )
    needed = minimal_tokens(batch)
    print(
        json.dumps(
            {
                "model": args.model,
                "shape": args.shape,
                "quick": args.quick,
                "device": str(scorer.device),
                "dtype": args.dtype,
                "torch_threads": torch.get_num_threads(),
                "rows": batch.n_rows,
                "columns": batch.n_columns,
                "naive_seconds": round(naive_seconds, 3),
                "kernel_seconds": round(kernel_seconds, 3),
                "speedup": round(naive_seconds / kernel_seconds, 2),
                "token_ratio": round(naive.tokens_processed / needed, 2),
                "naive_tokens": naive.tokens_processed,
                "kernel_tokens": kernel.tokens_processed,
                "minimal_tokens": needed,
                "max_abs_diff_L_seq": float(np.abs(kernel.L_seq - naive.L_seq).max()),
                "max_abs_diff_entropy": entropy_diff,
                "max_batch_tokens": args.max_batch_tokens,
                "naive_micro_batch": args.naive_micro_batch,
            }
        )
    )


if __name__ == "__main__":
    main()
