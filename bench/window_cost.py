"""What reasoning windows cost on long real traces (issue 19, items 1 and 4).

The service scores each reasoning on its first ``max_reasoning_tokens`` tokens (``scoring/window.py``).
This measures what that costs on long SmolLM2 traces, in two stages:

    generate   samples the long traces once and writes them, gzipped, to --traces (committed):
               healthy traces of a few task prompts and template traces of every template style
               (``bench/corpus/prompts.py``), in one batched, left-padded generation. Sampling is the
               corpus's (ancestral: top_k=0, top_p=1; healthy at temperature 1.0, each template style
               at the temperature the corpus matched to the healthy NLL). The length is forced: for the
               first --min-new-tokens tokens no special token (the end of turn) may be sampled, nor
               ``think`` after a token ending in ``</`` (the ``</think>`` that ends the reasoning), so
               each trace is renormalised sampling from the model with those tokens removed; after that
               it ends when the model closes it, or at --max-new-tokens. The reasoning is cut at
               ``</think>`` and cleaned as the corpus does (``scoring.partition.clean_reasoning``).
    score      the kernel (``scoring.score_batch``), float32 and bfloat16, CPU, over two batches
               against the task prompts, at each window: the batch is windowed by
               ``scoring.window.fit_window`` with the service's sequence limit, as the worker does.
               The batches are ``bench/dtype_cost.py``'s: healthy = the healthy traces, each in its own
               prompt's group; template = the template traces spread over the same prompts' groups,
               round robin; gap = healthy minus template. Printed as JSON: per dtype and window, MI
               (+SE), retrieval accuracy, above-chance and their gap, tokens processed, kernel CPU
               and wall seconds (after a warm-up); per window, bfloat16 against float32 (|dL_tok|,
               best-column flips).

    nice -n 10 python bench/window_cost.py generate       # 12 traces: 738 s on one busy core
    nice -n 10 python bench/window_cost.py score > bench/corpus/window_cost.json   # ~800 CPU s

Run from the repository root. ``--windows`` splits the score stage over processes (each scores both
dtypes at its windows); the metrics do not depend on the split.
One torch thread by default: on a shared 2-core machine a thread pool spins against other processes.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from bench.corpus.generate import PILOT_PROMPTS, scorer_record
from bench.corpus.prompts import TASKS, TEMPLATE_STYLES, task_prompt, template_prompt
from bench.corpus.simulate import load
from bench.dtype_cost import DTYPES, diagnostics
from scoring import Scorer, ScoringBatch, ScoringConfig, load_scorer, score_batch
from scoring.config import CACHE_DIR
from scoring.partition import THINK_CLOSE, clean_reasoning
from scoring.window import DEFAULT_MAX_REASONING_TOKENS, fit_window, sequence_limit

TRACES = Path("bench/corpus/long_traces.json.gz")
WINDOWS = "full,512,256,128,64"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class LongSampling(LogitsProcessor):  # type: ignore[misc]  # transformers is untyped
    """Each row at its own temperature, and no end of the reasoning before ``min_new_tokens``."""

    def __init__(self, scorer: Scorer, temperatures: list[float], prompt_width: int, min_new_tokens: int) -> None:
        tokenizer = scorer.tokenizer
        self.temperatures = torch.tensor(temperatures)[:, None]
        self.prompt_width = prompt_width
        self.min_new_tokens = min_new_tokens
        self.special = torch.tensor(sorted(set(tokenizer.all_special_ids)))
        # "</think>" is "</" (or " </", ...) then "think" then ">": "think" after any of those is held back.
        self.think = tokenizer.convert_tokens_to_ids("think")
        vocab = len(tokenizer)
        self.opens_close = torch.zeros(max(vocab, scorer.model.config.vocab_size), dtype=torch.bool)
        for i in range(vocab):
            if tokenizer.decode([i]).endswith("</"):
                self.opens_close[i] = True

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_width
        if generated % 256 == 0:
            log(f"generated {generated} tokens")
        scores = scores / self.temperatures.to(scores.dtype)
        if generated < self.min_new_tokens:
            scores[:, self.special] = -torch.inf
            scores[self.opens_close[input_ids[:, -1]], self.think] = -torch.inf
        return scores


def stage_generate(args: argparse.Namespace) -> None:
    scorer = load_scorer(ScoringConfig(model=args.model, device="cpu"), CACHE_DIR)
    tokenizer = scorer.tokenizer
    prompts = [int(p) for p in args.prompts.split(",")]
    style_temperature = {int(b["style"]): float(b["temperature"]) for b in load().raw["bisection"]}
    rows: list[dict[str, Any]] = [
        {"kind": "healthy", "prompt": p, "temperature": 1.0} for p in prompts for _ in range(args.per_prompt)
    ]
    rows += [
        {"kind": "template", "style": s, "temperature": style_temperature[s]}
        for s in range(len(TEMPLATE_STYLES))
        for _ in range(args.per_style)
    ]
    texts = [task_prompt(r["prompt"]) if r["kind"] == "healthy" else template_prompt(r["style"]) for r in rows]
    ids = [scorer.encode(t) for t in texts]
    width = max(len(x) for x in ids)
    pad = tokenizer.eos_token_id
    # Left padding: every row's next token sits in the same last column.
    input_ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids])
    attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    sampling = LongSampling(scorer, [r["temperature"] for r in rows], width, args.min_new_tokens)
    torch.manual_seed(args.seed)
    t0 = time.time()
    out = scorer.model.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        temperature=1.0,  # per row, in LongSampling
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.max_new_tokens,
        pad_token_id=pad,
        logits_processor=LogitsProcessorList([sampling]),
    )
    seconds = time.time() - t0
    for row, generated in zip(rows, out[:, width:].tolist(), strict=True):
        ended = pad in generated
        generated = generated[: generated.index(pad)] if ended else generated
        text = tokenizer.decode(generated, skip_special_tokens=True)
        row["generated_tokens"] = len(generated)
        row["ended"] = ended
        row["closed_think"] = THINK_CLOSE in text
        row["text"] = clean_reasoning(text.split(THINK_CLOSE)[0])
        row["reasoning_tokens"] = len(scorer.encode(row["text"]))
    traces = {
        "format": 1,
        "command": "bench/window_cost.py generate",
        "settings": {
            "prompts": prompts,
            "per_prompt": args.per_prompt,
            "per_style": args.per_style,
            "min_new_tokens": args.min_new_tokens,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "sampling": "ancestral (top_k=0, top_p=1), one batched left-padded generate call, torch.manual_seed(seed)",
            "length": "before min_new_tokens: special tokens and 'think' after '</' are masked (-inf)",
            "template_temperatures": "the corpus's matched temperature per style (smollm2.json.gz bisection)",
            "threads": torch.get_num_threads(),
            "generation_seconds": round(seconds, 1),
        },
        "scorer": scorer_record(),
        "traces": rows,
    }
    with gzip.open(args.traces, "wt", encoding="utf-8") as f:
        json.dump(traces, f, separators=(",", ":"))
    lengths = [r["reasoning_tokens"] for r in rows]
    log(f"wrote {args.traces} ({args.traces.stat().st_size} bytes): {len(rows)} traces, tokens {lengths}")


def parse_windows(text: str) -> list[int | None]:
    return [None if w == "full" else int(w) for w in text.split(",")]


def batches(scorer: Scorer, traces: dict[str, Any]) -> dict[str, ScoringBatch]:
    """The healthy and the template batch, both against the task prompts of the traces file."""
    prompts = traces["settings"]["prompts"]
    x = [scorer.encode(task_prompt(p)) for p in prompts]
    healthy = [t for t in traces["traces"] if t["kind"] == "healthy"]
    templates = [t for t in traces["traces"] if t["kind"] == "template"]
    own = [prompts.index(t["prompt"]) for t in healthy]
    spread = [i % len(prompts) for i in range(len(templates))]
    return {
        "healthy": ScoringBatch.from_rows([x[j] for j in own], [scorer.encode(t["text"]) for t in healthy], own),
        "template": ScoringBatch.from_rows(
            [x[j] for j in spread], [scorer.encode(t["text"]) for t in templates], spread
        ),
    }


def stage_score(args: argparse.Namespace) -> None:
    with gzip.open(args.traces, "rt", encoding="utf-8") as f:
        traces = json.load(f)
    dtypes = args.dtypes.split(",")
    windows = parse_windows(args.windows)
    config = {d: ScoringConfig(model=args.model, device="cpu", dtype=d) for d in dtypes}
    base = load_scorer(config[dtypes[0]], CACHE_DIR)
    # One model per dtype: casting one model back and forth would round the float32 weights.
    scorers = {d: replace(base, model=copy.deepcopy(base.model).to(dtype=getattr(torch, d))) for d in dtypes}
    whole = batches(base, traces)
    limit = sequence_limit(base.max_positions, config[dtypes[0]].max_batch_tokens)
    warmup = ScoringBatch.from_rows([whole["healthy"].prompts[0]], [whole["healthy"].reasonings[0][:16]], [0])
    for dtype in dtypes:
        score_batch(scorers[dtype], warmup, config[dtype])
    results: list[dict[str, Any]] = []
    bf16_vs_fp32: list[dict[str, Any]] = []
    # Window outermost, both dtypes in turn: a run stopped early has logged (stderr) its windows whole.
    for window in windows:
        L: dict[str, np.ndarray] = {}
        for dtype in dtypes:
            record: dict[str, Any] = {"dtype": dtype, "max_reasoning_tokens": window or "full"}
            seconds = {"cpu": 0.0, "wall": 0.0}
            tokens = 0
            parts = []
            for kind, batch in whole.items():
                windowed, cut = fit_window(batch, window, limit)
                cpu, wall = time.process_time(), time.perf_counter()
                scores = score_batch(scorers[dtype], windowed, config[dtype])
                seconds["cpu"] += time.process_time() - cpu
                seconds["wall"] += time.perf_counter() - wall
                tokens += scores.tokens_processed
                parts.append(scores.L_tok)
                # diagnostics() passes no column prompts: none is cut here, so no column merges.
                assert cut.merged_columns == 0, cut
                record[kind] = {
                    **diagnostics(scores.L_seq, scores.reasoning_lengths, np.asarray(windowed.column_of_row)),
                    "reasoning_tokens_mean": float(scores.reasoning_lengths.mean()),
                    "truncated_reasoning_ratio": cut.truncated_reasoning_ratio,
                }
            L[dtype] = np.concatenate(parts)  # [rows of both batches, task prompts] nats per token
            h, t = record["healthy"], record["template"]
            record["gap"] = {k: h[k] - t[k] for k in ("mi_estimate", "retrieval_accuracy", "retrieval_above_chance")}
            record["tokens_processed"] = tokens
            record["kernel_cpu_seconds"] = round(seconds["cpu"], 2)
            record["kernel_wall_seconds"] = round(seconds["wall"], 2)
            log(json.dumps(record))
            results.append(record)
        if set(DTYPES) <= set(L):
            a, b = (L[d] for d in DTYPES)
            d_tok = np.abs(b - a)
            bf16_vs_fp32.append(
                {
                    "max_reasoning_tokens": window or "full",
                    "dL_tok": {"max": float(d_tok.max()), "mean": float(d_tok.mean())},
                    "top1_flips": int((a.argmax(1) != b.argmax(1)).sum()),
                }
            )
            log(json.dumps(bf16_vs_fp32[-1]))
    lengths = [t["reasoning_tokens"] for t in traces["traces"]]
    report = {
        "command": "bench/window_cost.py score",
        "traces": str(args.traces),
        "model": args.model,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "sequence_limit": limit,
        "default_max_reasoning_tokens": DEFAULT_MAX_REASONING_TOKENS,
        "task_prompts": [TASKS[p][0] + f" {p}" for p in traces["settings"]["prompts"]],
        "healthy_traces": len(whole["healthy"].reasonings),
        "template_traces": len(whole["template"].reasonings),
        "reasoning_tokens": {"min": min(lengths), "mean": float(np.mean(lengths)), "max": max(lengths)},
        "results": results,
        "bf16_vs_fp32": bf16_vs_fp32,
    }
    print(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("generate", "score"))
    parser.add_argument("--traces", type=Path, default=TRACES, help="the long traces file (written by generate)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", default=",".join(str(p) for p in PILOT_PROMPTS), help="generate: task prompts")
    parser.add_argument("--per-prompt", type=int, default=2, help="generate: healthy traces per task prompt")
    parser.add_argument("--per-style", type=int, default=2, help="generate: template traces per template style")
    parser.add_argument("--min-new-tokens", type=int, default=768, help="generate: tokens before the end may come")
    parser.add_argument("--max-new-tokens", type=int, default=832, help="generate")
    parser.add_argument("--seed", type=int, default=0, help="generate")
    parser.add_argument("--windows", default=WINDOWS, help="score: max_reasoning_tokens values ('full': none)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="score")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"generate": stage_generate, "score": stage_score}[args.stage](args)


if __name__ == "__main__":
    main()
