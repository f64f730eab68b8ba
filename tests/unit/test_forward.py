"""The kernel's own packed forward equals transformers' forward at every valid position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scoring import ScoringConfig, forward, score_batch, score_batch_naive
from scoring.cascade import CascadePlan, install
from scoring.forward import packed_forward, supports
from tests.conftest import VOCAB, random_batch, tiny_scorer


def test_llama_and_qwen2_run_the_own_forward_and_gpt2_does_not():
    assert supports(tiny_scorer("llama").model)
    assert supports(tiny_scorer("qwen2").model)
    assert not supports(tiny_scorer("gpt2").model)


@pytest.mark.parametrize("mlp_chunk_rows", [None, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_hidden_states_equal_the_padded_transformers_forward(family, mlp_chunk_rows, monkeypatch):
    scorer = tiny_scorer(family, torch.float64)
    if mlp_chunk_rows is not None:  # the MLP in chunks of 3 tokens, as a large model's long forward runs
        intermediate = scorer.model.config.intermediate_size
        monkeypatch.setattr(forward, "CHUNK_BYTES", mlp_chunk_rows * intermediate * 8)
    install(scorer.model)
    rng = np.random.default_rng(0)
    lengths = [7, 1, 4, 7, 2]
    starts = [0, 3, 5, 0, 11]  # positions need not start at 0 (a query after its prompt)
    sequences = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    valid = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    positions = torch.tensor(starts)[:, None] + torch.arange(max(lengths))
    padded = torch.zeros(valid.shape, dtype=torch.long)
    ids = torch.tensor([t for s in sequences for t in s])
    padded[valid] = ids
    base = scorer.model.base_model
    with torch.inference_mode():
        expected = base(input_ids=padded, position_ids=positions, use_cache=False).last_hidden_state[valid]
        got = packed_forward(base, ids, positions[valid], valid, CascadePlan(segments=[]))
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("budget", [40, 100_000])
def test_qwen2_kernel_matches_the_naive_scorer(budget):
    scorer = tiny_scorer("qwen2", torch.float64)
    batch = random_batch(seed=4)
    fast = score_batch(scorer, batch, ScoringConfig(max_batch_tokens=budget, logits_chunk_tokens=7))
    naive = score_batch_naive(scorer, batch, micro_batch_size=4)
    np.testing.assert_allclose(fast.L_seq, naive.L_seq, atol=1e-10, rtol=0)
    for a, b in zip(fast.token_entropy, naive.token_entropy, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-10, rtol=0)
