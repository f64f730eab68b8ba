"""Our kernel and a vLLM server on the same batches, side by side in one run (SmolLM2, CPU here).

    PYTHONPATH=$PWD .venv/bin/python bench/vllm_vs_kernel.py --quick --shapes first-turn,multi-turn \
        --dtypes float32,bfloat16

Needs ``.venv-vllm`` (``scripts/vllm-env``). For each dtype a vLLM server is started on loopback with the
converted SmolLM2 folder (``tests/vllm/server.py``) and our kernel is loaded in that dtype; each shape's
batch (``bench/cross_scoring.py``'s shapes, built with SmolLM2's tokenizer) is scored by both. Prints one
JSON object per (dtype, shape): seconds, tokens processed, tokens per second, ``minimal_tokens`` (each
distinct prompt prefix once, then z_r[:-1] per pair: the fewest any exact scorer runs) and
``minimal_share`` = minimal_tokens / tokens processed (the kernel runs exactly the minimum; vLLM re-prefills
every pair's prompt), ``minimal_tokens_per_second`` (the useful rate, comparable between the two), and the
largest |ΔL_tok| of each against the float32 kernel. A last line gives the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/cross_scoring.py's shapes
from cross_scoring import build_batch, minimal_tokens

from scoring import ScoringBatch, ScoringConfig, load_scorer, score_batch
from scoring.config import CACHE_DIR
from service.jobs.vllm import AnyScorer, load_vllm_scorer, score_with
from service.settings import VllmClientSettings, VllmEndpoint
from tests.vllm.server import environment_missing, running


def measure(scorer: AnyScorer, batch: ScoringBatch, expected_L_tok: np.ndarray) -> dict[str, float]:
    """Seconds, tokens, rates and the largest |ΔL_tok| against the float32 kernel of one scoring of ``batch``."""
    needed = minimal_tokens(batch)
    start = time.perf_counter()
    scores = score_with(scorer, batch, ScoringConfig())
    seconds = time.perf_counter() - start
    has = batch.reasoning_lengths > 0
    return {
        "seconds": round(seconds, 2),
        "tokens": scores.tokens_processed,
        "tokens_per_second": round(scores.tokens_processed / seconds, 1),
        "minimal_share": round(needed / scores.tokens_processed, 3),
        "minimal_tokens_per_second": round(needed / seconds, 1),
        "max_abs_diff_L_tok_vs_kernel_float32": float(np.abs(scores.L_tok - expected_L_tok)[has].max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="first-turn,multi-turn")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quick", action="store_true", help="bench/cross_scoring.py's halved shapes")
    parser.add_argument("--concurrency", type=int, default=4, help="vLLM requests in flight")
    parser.add_argument("--request-tokens", type=int, default=16384, help="prompt tokens per vLLM request")
    parser.add_argument("--server-logs", type=Path, help="keep each server's log here (default: a temporary folder)")
    args = parser.parse_args()
    missing = environment_missing()
    if missing is not None:
        sys.exit(missing)
    load_before = os.getloadavg()
    reference = load_scorer(ScoringConfig(model="smollm2-135m", device="cpu"), CACHE_DIR)  # float32
    shapes = args.shapes.split(",")
    batches = {shape: build_batch(reference.encode, shape, args.quick) for shape in shapes}
    expected = {shape: score_batch(reference, batch, ScoringConfig()).L_tok for shape, batch in batches.items()}
    client = VllmClientSettings(
        timeout_seconds=600, concurrency=args.concurrency, retries=0, request_tokens=args.request_tokens
    )
    for dtype in args.dtypes.split(","):
        rows = {}
        # The kernel first, with no server alive: vLLM's CPU engine keeps its threads busy while it waits.
        kernel = load_scorer(ScoringConfig(model="smollm2-135m", device="cpu", dtype=dtype), CACHE_DIR)  # type: ignore[arg-type]  # checked by ScoringConfig
        score_with(kernel, build_batch(reference.encode, "first-turn", True, prompts=1), ScoringConfig())  # warm-up
        for shape, batch in batches.items():
            rows[shape] = {"dtype": dtype, "shape": shape, "quick": args.quick, "rows": batch.n_rows}
            rows[shape] |= {"columns": batch.n_columns, "minimal_tokens": minimal_tokens(batch)}
            rows[shape]["kernel"] = measure(kernel, batch, expected[shape])
        del kernel
        with (
            tempfile.TemporaryDirectory() as folder,
            running(dtype, (args.server_logs or Path(folder)) / f"vllm-{dtype}.log") as server,
        ):
            endpoint = VllmEndpoint.parse(server.spec)
            assert endpoint is not None
            remote = load_vllm_scorer(server.spec, endpoint, CACHE_DIR, client)
            remote.score(build_batch(reference.encode, "first-turn", True, prompts=1), ScoringConfig())  # warm-up
            for shape, batch in batches.items():
                rows[shape]["vllm"] = measure(remote, batch, expected[shape])
            remote.close()
        for row in rows.values():
            row["vllm_over_kernel_seconds"] = round(row["vllm"]["seconds"] / row["kernel"]["seconds"], 2)
            print(json.dumps(row), flush=True)
    print(json.dumps({"loadavg_before": load_before, "loadavg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
