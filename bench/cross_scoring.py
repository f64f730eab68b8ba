"""Cross-scoring speed: the prefix-tree kernel against the naive per-pair scorer, in one run.

    python bench/cross_scoring.py --model smollm2-135m --shape first-turn [--quick] [--prompts N]
    python bench/cross_scoring.py --model qwen2.5-1.5b-shape --shape trajectory --dtype bfloat16
    python bench/cross_scoring.py --model smollm2-135m --shape long-reasoning --skip-naive

Prints one JSON object: naive_seconds, kernel_seconds, speedup, token_ratio (tokens the naive
scorer processes / minimal_tokens, the fewest tokens exact scoring must process: every distinct
prompt prefix once, then z_r[:-1] per pair), limit_share (speedup / token_ratio: the share of the
token-count limit the kernel reaches), max_abs_diff_L_seq, max_abs_diff_entropy, the model's FLOPs
per scored token, the kernel's achieved FLOP/s, MFU on a GPU with a known bf16 dense peak, and the
settings. The same run measures the matmul peak of this device and thread count (``torch.mm`` of
two N x N matrices, float32 and bfloat16, best of a few, just before and just after the kernel)
and prints kernel_share_of_fp32_peak: kernel_flops_per_second over the better float32 figure
(kernel_cpu_share_of_fp32_peak: the same per CPU second of this process, steadier under load).
On CPU, cpu_limit_share is limit_share from this process's CPU seconds, steadier than
wall time on a machine shared with other work. Both scorers run on the same batch in the same
process, so the ratios are measured under the same machine load.

Shapes (prompts share one system prompt; token counts are exact, lengths vary by a seeded +-10%):
    first-turn   8 prompts of ~200 tokens (130 shared), 4 traces each of ~64 tokens
    multi-turn   8 prompts of ~1,000 tokens (dialogue history), 4 traces each of ~128 tokens
    long-reasoning  8 prompts of ~200 tokens, 4 traces each of 1,000-2,000 tokens (math, code)
    many-rows    32 prompts of ~200 tokens, 8 traces each of ~256 tokens (256 rows)
    trajectory   the trajectory sampler: 8 trajectories of 4 turns (each turn adds ~120 tokens of
                 observation to the previous turn's prompt and response), 16 (trajectory, turn)
                 draws with replacement, each its own column; turns of one trajectory share its
                 history, other trajectories only the system prompt
    --quick      halved: 4 prompts (trajectories: 4 of 3 turns, 8 draws), 2 traces each, prompts
                 and traces halved: under a minute with SmolLM2 on 2 CPU cores; long-reasoning
                 4 prompts x 2 traces of 500-1,000 tokens and many-rows 4 prompts x 16 traces of
                 ~64 tokens (64 rows): a few minutes each
    --kernel-repeats K  the fastest of K kernel runs (the matmul peak is a best of 4 too)
    --skip-naive the kernel alone (no speedup, no differences): the full long shapes' naive runs
                 take hours on a CPU
    --prompts N  N distinct prompts instead (first-turn, multi-turn)

Models: the scorer names of ``scoring.models`` (tiny-random, smollm2-135m, a folder, a .gguf), or a
random-weight model built from a published configuration (no download; weights do not change
speed): smollm2-135m-shape, qwen2.5-0.5b-shape, qwen2.5-1.5b-shape, llama-3.2-1b-shape. These use
the tiny-random tokenizer's ids (all below 512), valid in every vocabulary here.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scoring import Scorer, ScoringBatch, ScoringConfig, load_scorer, score_batch, score_batch_naive, verify_scorer
from scoring.batch import Tokens
from scoring.config import CACHE_DIR
from scoring.models import build_tiny_random, resolve_device
from scoring.prefix_tree import build as build_tree
from scoring.samplers import Trajectory, Turn, sample_trajectory_uniform

SHAPES = {
    # prompts, traces per prompt, prompt tokens, trace tokens
    "first-turn": (8, 4, 200, 64),
    "multi-turn": (8, 4, 1000, 128),
    "long-reasoning": (8, 4, 200, 1500),
    "many-rows": (32, 8, 200, 256),
    # trajectories, turns, observation tokens per turn, trace tokens; draws below
    "trajectory": (8, 4, 120, 64),
}
QUICK_SHAPES = {
    "first-turn": (4, 2, 150, 32),
    "multi-turn": (4, 2, 500, 64),
    "long-reasoning": (4, 2, 150, 750),
    "many-rows": (4, 16, 150, 64),
}
# Relative spread of the trace lengths (uniform): +-10% unless listed.
TRACE_SPREAD = {"long-reasoning": 1 / 3}
TRAJECTORY_DRAWS = 16
MATMUL_SIZE = 2048
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
# Published configurations (the models' config.json on the Hugging Face hub), as transformers kwargs.
MODEL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m-shape": (
        "llama",
        {
            "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
            "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        },
    ),
    "qwen2.5-0.5b-shape": (
        "qwen2",
        {
            "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
        },
    ),
    "qwen2.5-1.5b-shape": (
        "qwen2",
        {
            "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
            "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
        },
    ),
    "llama-3.2-1b-shape": (
        "llama",
        {
            "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "rope_scaling": {
                "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3",
            },
        },
    ),
}  # fmt: skip
# Dense bf16 tensor-core peaks (vendor datasheets, without sparsity), by device-name substring.
BF16_DENSE_PEAK_FLOPS = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
    ("L40S", 362.1e12),
)


def token_stream(encode, rng: np.random.Generator, n_tokens: int) -> Tokens:
    """Exactly n_tokens ids of natural-looking text (seeded sentence order)."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids.extend(encode(" " + SENTENCES[int(rng.integers(len(SENTENCES)))]))
    return tuple(ids[:n_tokens])


def build_batch(encode, shape: str, quick: bool, prompts: int | None = None, seed: int = 0) -> ScoringBatch:
    if shape == "trajectory":
        return trajectory_batch(encode, quick, seed)
    n_prompts, per_prompt, prompt_len, trace_len = (QUICK_SHAPES if quick else SHAPES)[shape]
    n_prompts = prompts or n_prompts
    spread = TRACE_SPREAD.get(shape, 0.1)
    rng = np.random.default_rng(seed)
    system = token_stream(encode, rng, SYSTEM_TOKENS)
    rows_prompts, reasonings, groups = [], [], []
    seen: set[Tokens] = set()
    for g in range(n_prompts):
        length = round(prompt_len * rng.uniform(0.95, 1.05))
        prompt = system + token_stream(encode, rng, length - SYSTEM_TOKENS)
        while prompt in seen:  # distinct prompts (short tails of few sentences can repeat)
            prompt = system + token_stream(encode, rng, length - SYSTEM_TOKENS)
        seen.add(prompt)
        for _ in range(per_prompt):
            rows_prompts.append(prompt)
            reasonings.append(token_stream(encode, rng, round(trace_len * rng.uniform(1 - spread, 1 + spread))))
            groups.append(g)
    return ScoringBatch.from_rows(rows_prompts, reasonings, groups)


def trajectory_batch(encode, quick: bool, seed: int) -> ScoringBatch:
    """Rows the trajectory sampler draws from multi-turn rollouts (prompt t = prompt t-1 + response + observation)."""
    n_traj, n_turns, obs_len, trace_len = SHAPES["trajectory"]
    draws = TRAJECTORY_DRAWS
    if quick:
        n_traj, n_turns, obs_len, trace_len, draws = 4, 3, obs_len // 2, trace_len // 2, draws // 2
    rng = np.random.default_rng(seed)
    system = token_stream(encode, rng, SYSTEM_TOKENS)
    trajectories = []
    for m in range(n_traj):
        history, turns = system, []
        for _ in range(n_turns):
            history = history + token_stream(encode, rng, round(obs_len * rng.uniform(0.9, 1.1)))
            reasoning = token_stream(encode, rng, round(trace_len * rng.uniform(0.9, 1.1)))
            turns.append(Turn(prompt_ids=history, reasoning_ids=reasoning))
            history = history + reasoning + token_stream(encode, rng, 8)  # the answer after the reasoning
        trajectories.append(Trajectory(group_id=m, turns=tuple(turns)))
    sampled = sample_trajectory_uniform(trajectories, draws, seed)
    assert sampled is not None
    return sampled.batch


def minimal_tokens(batch: ScoringBatch) -> int:
    """Tokens any exact scorer must run: each distinct prompt prefix once (a trie), then each distinct
    reasoning's z[:-1] under each distinct prompt."""
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
    return nodes + len(distinct) * sum(max(len(z) - 1, 0) for z in set(batch.reasonings))


def one_level_tokens(batch: ScoringBatch) -> int:
    """What sharing only the prefix common to all prompts (the kernel before the prefix tree) runs."""
    distinct = list(set(batch.column_prompts))
    shared = 0
    while shared < min(map(len, distinct)) - 1 and len({p[shared] for p in distinct}) == 1:
        shared += 1
    queries = len(distinct) * sum(max(len(z) - 1, 0) for z in batch.reasonings)
    return shared + sum(len(p) - shared for p in distinct) + queries


def model_flops(scorer: Scorer, batch: ScoringBatch) -> tuple[float, int]:
    """FLOPs of exact scoring and the number of scored tokens.

    Per token run: 2 x the dense (linear) parameters of the layers, plus attention, 4 x heads x
    head_dim per layer per attended position (QK^T and PV, each position attending to itself and
    all before it). The vocabulary projection, 2 x hidden x vocabulary, only at scored positions.
    Counts the work of the minimal token set; the naive scorer does more.
    """
    config = scorer.model.config
    base = scorer.model.base_model
    dense = sum(
        m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
    )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    head = scorer.model.get_output_embeddings().weight
    prompts = list(set(batch.column_prompts))
    tree = build_tree(prompts)
    tokens = tree.tokens
    attended = sum(sum(range(n.start + 1, n.start + len(n.tokens) + 1)) for n in tree.nodes)
    scored = 0
    for p in prompts:
        for z in batch.reasonings:
            queries = max(len(z) - 1, 0)
            tokens += queries
            attended += sum(range(len(p) + 1, len(p) + queries + 1))
            scored += len(z)
    flops = 2.0 * dense * tokens + 4.0 * heads * head_dim * layers * attended + 2.0 * head.numel() * scored
    return flops, scored


def bf16_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_DENSE_PEAK_FLOPS if key in name), None)


def matmul_peak(
    dtype: torch.dtype, device: torch.device, size: int = MATMUL_SIZE, repeats: int = 4
) -> tuple[float, float]:
    """FLOP/s of the best of ``repeats`` ``torch.mm`` calls on two [size, size] matrices of ``dtype``,
    per wall second and per CPU second of this process.

    Same process, so same thread count as the kernel. Best of a few, since other work on a shared
    machine only ever slows a call down.
    """
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=generator, device=device).to(dtype)
    b = torch.randn(size, size, generator=generator, device=device).to(dtype)
    torch.mm(a, b)  # first use: allocation, kernel selection
    best = best_cpu = float("inf")
    for _ in range(repeats):
        _, seconds, cpu_seconds = timed(lambda: torch.mm(a, b))
        best, best_cpu = min(best, seconds), min(best_cpu, cpu_seconds)
    return 2.0 * size**3 / best, 2.0 * size**3 / best_cpu


def matmul_peaks(device: torch.device) -> dict[str, tuple[float, float]]:
    return {name: matmul_peak(getattr(torch, name), device) for name in ("float32", "bfloat16")}


def load(args: argparse.Namespace, config: ScoringConfig) -> Scorer:
    if args.model not in MODEL_SHAPES:
        return load_scorer(config, args.cache_dir)
    import transformers

    family, kwargs = MODEL_SHAPES[args.model]
    model_config = getattr(transformers, "Qwen2Config" if family == "qwen2" else "LlamaConfig")(
        **kwargs, initializer_range=0.02, attn_implementation="sdpa"
    )
    device = resolve_device(config.device)
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(model_config).eval()
    _, tokenizer = build_tiny_random()
    scorer = Scorer(name=args.model, model=model, tokenizer=tokenizer)
    verify_scorer(scorer)  # in float32, as load_scorer
    model.to(dtype=getattr(torch, config.dtype))
    return scorer


def timed(fn):
    """The result, wall seconds and this process's CPU seconds (all threads)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start, time.process_time() - start_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help=f"a scorer name or one of {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="first-turn")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prompts", type=int, help="distinct prompts (first-turn, multi-turn)")
    parser.add_argument("--skip-naive", action="store_true", help="time the kernel only")
    parser.add_argument("--kernel-repeats", type=int, default=1, help="kernel runs; the fastest is reported")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--naive-micro-batch", type=int, default=4, help="pairs per naive forward (RAGEN batches)")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (the 1e-3 nats check)
    config = ScoringConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_batch_tokens=args.max_batch_tokens
    )
    scorer = load(args, config)
    batch = build_batch(scorer.encode, args.shape, args.quick, args.prompts)
    warmup = ScoringBatch.from_rows([batch.prompts[0][:8]], [batch.reasonings[0][:8]], [0])
    score_batch(scorer, warmup, config)
    score_batch_naive(scorer, warmup)

    peaks_before = matmul_peaks(scorer.device)
    kernel, kernel_seconds, kernel_cpu = timed(lambda: score_batch(scorer, batch, config))
    for _ in range(args.kernel_repeats - 1):  # best of a few: others' load only ever slows a run down
        _, seconds, cpu_seconds = timed(lambda: score_batch(scorer, batch, config))
        kernel_seconds, kernel_cpu = min(kernel_seconds, seconds), min(kernel_cpu, cpu_seconds)
    peaks_after = matmul_peaks(scorer.device)
    needed = minimal_tokens(batch)
    flops, scored = model_flops(scorer, batch)
    peak = bf16_peak(scorer.device)
    fp32_peak = max(peaks_before["float32"][0], peaks_after["float32"][0])
    fp32_peak_cpu = max(peaks_before["float32"][1], peaks_after["float32"][1])
    kernel_figures = {
        "model": args.model,
        "shape": args.shape,
        "quick": args.quick,
        "device": torch.cuda.get_device_name(scorer.device) if scorer.device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "rows": batch.n_rows,
        "columns": batch.n_columns,
        "distinct_prompts": len(set(batch.column_prompts)),
        "mean_reasoning_tokens": round(float(batch.reasoning_lengths.mean()), 1),
        "kernel_seconds": round(kernel_seconds, 3),
        "kernel_cpu_seconds": round(kernel_cpu, 3),
        "kernel_tokens": kernel.tokens_processed,
        "minimal_tokens": needed,
        "flops_per_scored_token": round(flops / scored),
        "kernel_flops_per_second": round(flops / kernel_seconds),
        # Same process, same threads, measured just before and just after the kernel.
        "matmul_fp32_flops_per_second": [round(peaks_before["float32"][0]), round(peaks_after["float32"][0])],
        "matmul_bf16_flops_per_second": [round(peaks_before["bfloat16"][0]), round(peaks_after["bfloat16"][0])],
        "kernel_share_of_fp32_peak": round(flops / kernel_seconds / fp32_peak, 3),
        # The same per CPU second of this process (kernel and matmul): steadier under others' load.
        "kernel_cpu_share_of_fp32_peak": round(flops / kernel_cpu / fp32_peak_cpu, 3),
        "mfu_bf16_dense": None if peak is None else round(flops / kernel_seconds / peak, 4),
        "max_batch_tokens": args.max_batch_tokens,
        "kernel_repeats": args.kernel_repeats,
    }
    if args.skip_naive:
        print(json.dumps({**kernel_figures, "load_average_1m": round(os.getloadavg()[0], 2)}))
        return
    naive, naive_seconds, naive_cpu = timed(
        lambda: score_batch_naive(scorer, batch, micro_batch_size=args.naive_micro_batch)
    )
    entropy_diff = max(
        (float(np.abs(a - b).max()) for a, b in zip(kernel.token_entropy, naive.token_entropy, strict=True) if len(a)),
        default=0.0,
    )
    speedup = naive_seconds / kernel_seconds
    token_ratio = naive.tokens_processed / needed
    print(
        json.dumps(
            {
                **kernel_figures,
                "naive_seconds": round(naive_seconds, 3),
                "speedup": round(speedup, 2),
                "token_ratio": round(token_ratio, 2),
                "limit_share": round(speedup / token_ratio, 3),
                "naive_tokens": naive.tokens_processed,
                "one_level_prefix_tokens": one_level_tokens(batch),
                # On a shared CPU the wall-clock ratio moves with other work's load between the two
                # runs; CPU seconds of this process do much less so.
                "naive_cpu_seconds": round(naive_cpu, 3),
                "cpu_limit_share": round(naive_cpu / kernel_cpu / token_ratio, 3),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "max_abs_diff_L_seq": float(np.abs(kernel.L_seq - naive.L_seq).max()),
                "max_abs_diff_entropy": entropy_diff,
                "naive_micro_batch": args.naive_micro_batch,
            }
        )
    )


if __name__ == "__main__":
    main()
