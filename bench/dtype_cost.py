"""What bfloat16 costs against float32 on the committed SmolLM2 corpus (issue 19, item 4).

A sample of the corpus traces (``--healthy-per-prompt`` healthy traces of every task prompt and
``--templates-per-style`` template traces of every style) is rescored under every corpus column
(the task prompts and the template styles) by the kernel in float32 and in bfloat16, CPU, one
thread, in one batch per dtype. Printed as JSON:

- ``dL_tok``: max and mean |L_tok(bf16) - L_tok(fp32)| over every (trace, column) cell, nats per
  token; ``dL_seq`` the same per sequence; ``d_token_entropy`` for the matched entropies.
- per dtype, a healthy batch (the healthy traces, each in its own prompt's group) and a template
  batch (the template traces spread over the same prompts' groups, round robin), both against
  the task columns: ``mi_estimate``, its standard error, ``retrieval_accuracy``,
  ``retrieval_above_chance``, and the healthy-minus-template gap of each;
- per dtype the kernel's CPU and wall seconds for the whole batch (after a one-row warm-up);
- ``top1_flips``: traces whose best task column differs between the dtypes;
- ``fp32_vs_corpus``: max |dL_seq| of the float32 rescoring against the committed matrix.

    python bench/dtype_cost.py [--healthy-per-prompt 2] [--templates-per-style 8]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from bench.corpus.simulate import load
from scoring import ScoringBatch, ScoringConfig, load_scorer, score_batch
from scoring.config import CACHE_DIR, Dtype
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, per_token

DTYPES: tuple[Dtype, ...] = ("float32", "bfloat16")


def sample(healthy_per_prompt: int, templates_per_style: int, seed: int) -> tuple[list[int], list[int]]:
    """(healthy trace indices, template trace indices) of the corpus, drawn without replacement."""
    corpus = load()
    rng = np.random.default_rng(seed)
    healthy = [
        int(r) for p in range(corpus.n_prompts) for r in rng.choice(corpus.healthy(p), healthy_per_prompt, False)
    ]
    templates = [
        int(r) for s in range(corpus.n_styles) for r in rng.choice(corpus.templates(s), templates_per_style, False)
    ]
    return healthy, templates


def diagnostics(L_seq: np.ndarray, lengths: np.ndarray, own: np.ndarray) -> dict[str, float]:
    """MI and retrieval of rows against the task columns (own: each row's task column)."""
    d, _ = compute_diagnostics(
        per_token(L_seq, lengths), L_seq, own, None, EmaState(), EstimatorConfig(bootstrap_samples=0)
    )
    return {
        "mi_estimate": d.metrics["mi_estimate"],
        "mi_estimate_se": d.standard_errors["mi_estimate"],
        "retrieval_accuracy": d.metrics["retrieval_accuracy"],
        "retrieval_above_chance": d.metrics["retrieval_above_chance"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--healthy-per-prompt", type=int, default=2)
    parser.add_argument("--templates-per-style", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    corpus = load()
    raw = corpus.raw
    healthy, templates = sample(args.healthy_per_prompt, args.templates_per_style, args.seed)
    traces = healthy + templates
    n_task = corpus.n_prompts
    # Own task column: a healthy trace's prompt; a template trace is spread over the prompts' groups.
    own = np.array(
        [corpus.prompt_of_trace[r] for r in healthy] + [i % n_task for i in range(len(templates))], dtype=np.int64
    )
    scorer_config = {d: ScoringConfig(model="smollm2-135m", device="cpu", dtype=d) for d in DTYPES}
    scorer = load_scorer(scorer_config["float32"], CACHE_DIR)
    columns = [tuple(scorer.encode(c["text"])) for c in raw["columns"]]
    reasonings = [tuple(raw["traces"][r]["token_ids"]) for r in traces]
    # Every column as one group: each trace appears once, in its own column's group, and the
    # remaining columns are carried by one-token placeholder rows (as tests/slow/test_corpus_matrix.py).
    own_corpus_column = [int(raw["traces"][r]["column"]) for r in traces]
    present = set(own_corpus_column)
    filler = [j for j in range(len(columns)) if j not in present]
    batch = ScoringBatch.from_rows(
        [columns[j] for j in own_corpus_column] + [columns[j] for j in filler],
        reasonings + [reasonings[0][:1]] * len(filler),
        own_corpus_column + filler,
    )
    warmup = ScoringBatch.from_rows([columns[0], columns[1]], [reasonings[0], reasonings[0]], [0, 1])
    lengths = np.array([len(z) for z in reasonings], dtype=np.int64)
    n = len(traces)

    results: dict[str, Any] = {}
    L: dict[str, np.ndarray] = {}
    entropy: dict[str, tuple[np.ndarray, ...]] = {}
    for dtype in DTYPES:
        scorer.model.to(dtype=getattr(torch, dtype))
        score_batch(scorer, warmup, scorer_config[dtype])
        cpu, wall = time.process_time(), time.perf_counter()
        scores = score_batch(scorer, batch, scorer_config[dtype])
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        L[dtype] = scores.L_seq[:n]  # [traces, columns]: batch columns are the corpus columns in order
        entropy[dtype] = scores.token_entropy[:n]
        h = diagnostics(L[dtype][: len(healthy), :n_task], lengths[: len(healthy)], own[: len(healthy)])
        t = diagnostics(L[dtype][len(healthy) :, :n_task], lengths[len(healthy) :], own[len(healthy) :])
        results[dtype] = {
            "kernel_cpu_seconds": round(cpu, 2),
            "kernel_wall_seconds": round(wall, 2),
            "tokens_processed": scores.tokens_processed,
            "healthy": h,
            "template": t,
            "gap": {k: h[k] - t[k] for k in ("mi_estimate", "retrieval_accuracy", "retrieval_above_chance")},
        }
    d_seq = np.abs(L["bfloat16"] - L["float32"])
    d_tok = d_seq / lengths[:, None]
    d_entropy = np.concatenate([np.abs(a - b) for a, b in zip(entropy["bfloat16"], entropy["float32"], strict=True)])
    committed = corpus.L_seq[traces]
    scored = ~np.isnan(committed)
    report = {
        "model": "smollm2-135m",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "healthy_traces": len(healthy),
        "template_traces": len(templates),
        "columns": len(columns),
        "task_columns": n_task,
        "reasoning_tokens": {"min": int(lengths.min()), "mean": float(lengths.mean()), "max": int(lengths.max())},
        "dL_tok": {"max": float(d_tok.max()), "mean": float(d_tok.mean())},
        "dL_seq": {"max": float(d_seq.max()), "mean": float(d_seq.mean())},
        "d_token_entropy": {"max": float(d_entropy.max()), "mean": float(d_entropy.mean())},
        "top1_flips": int((L["bfloat16"][:, :n_task].argmax(1) != L["float32"][:, :n_task].argmax(1)).sum()),
        "fp32_vs_corpus_max_dL_seq": float(np.abs(L["float32"][scored] - committed[scored]).max()),
        **results,
        "bf16_cpu_speedup": results["float32"]["kernel_cpu_seconds"] / results["bfloat16"]["kernel_cpu_seconds"],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
