"""On CUDA, reduced precision agrees with the float64 CPU reference within stated tolerances.

The packed path (one FlexAttention call per layer, compiled) is CUDA's default; its masks are
tested eagerly on CPU too (tests/unit), but only here does the compiled kernel run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scoring import ScoringConfig, score_batch, score_batch_naive
from tests.conftest import random_batch, tiny_scorer, trajectory_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none"),
]


@pytest.fixture(autouse=True)
def _no_tf32():
    # float32 means float32: the 1e-3 nats checks would not hold under TF32 matmuls.
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def on_cuda(family, dtype, seed=0):
    scorer = tiny_scorer(family, torch.float64, seed=seed)
    scorer.model.to(device="cuda", dtype=dtype)
    return scorer


@pytest.mark.parametrize("attention", ["packed", "cascade"])
@pytest.mark.parametrize(
    ("dtype", "atol_per_token"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1), (torch.float16, 0.02)]
)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cuda_scores_match_the_cpu_float64_reference(family, dtype, atol_per_token, attention):
    batch = random_batch(seed=8)
    reference = score_batch(tiny_scorer(family, torch.float64), batch, ScoringConfig())
    scores = score_batch(on_cuda(family, dtype), batch, ScoringConfig(max_batch_tokens=64, attention=attention))
    np.testing.assert_allclose(scores.L_tok, reference.L_tok, atol=atol_per_token, rtol=0)


@pytest.mark.parametrize("budget", [45, 100_000])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_float32_is_within_1e_3_nats_per_sequence_on_trajectory_batches(family, budget):
    batch = trajectory_batch(5, trajectories=4, turns=3, draws=10)
    reference = score_batch_naive(tiny_scorer(family, torch.float64), batch)
    scores = score_batch(on_cuda(family, torch.float32), batch, ScoringConfig(max_batch_tokens=budget))
    np.testing.assert_allclose(scores.L_seq, reference.L_seq, atol=1e-3, rtol=0)
    for got, expected in zip(scores.token_entropy, reference.token_entropy, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def test_packed_bfloat16_errs_no_more_than_the_naive_bfloat16_forward():
    """Per-token RMS and per-sequence p99 against float32: within 1.25x the naive bf16 forward's."""
    batch = random_batch(seed=9, n_groups=8, per_group=4, system_len=40)
    truth = score_batch_naive(on_cuda("llama", torch.float32, seed=3), batch, micro_batch_size=8)
    kernel = score_batch(on_cuda("llama", torch.bfloat16, seed=3), batch, ScoringConfig())
    naive = score_batch_naive(on_cuda("llama", torch.bfloat16, seed=3), batch, micro_batch_size=8)
    scored = batch.reasoning_lengths > 0
    for measure in (
        lambda s: np.sqrt(np.mean((s.L_tok - truth.L_tok)[scored] ** 2)),
        lambda s: np.percentile(np.abs(s.L_seq - truth.L_seq)[scored], 99),
    ):
        assert measure(kernel) <= 1.25 * measure(naive)
