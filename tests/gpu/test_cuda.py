"""On CUDA, reduced precision agrees with the float64 CPU reference within stated tolerances."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scoring import ScoringConfig, score_batch
from tests.conftest import random_batch, tiny_scorer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none"),
]


@pytest.mark.parametrize(
    ("dtype", "atol_per_token"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1), (torch.float16, 0.02)]
)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cuda_scores_match_the_cpu_float64_reference(family, dtype, atol_per_token):
    batch = random_batch(seed=8)
    reference = score_batch(tiny_scorer(family, torch.float64), batch, ScoringConfig())
    gpu = tiny_scorer(family, torch.float64)
    gpu.model.to(device="cuda", dtype=dtype)
    scores = score_batch(gpu, batch, ScoringConfig(max_batch_tokens=64))
    np.testing.assert_allclose(scores.L_tok, reference.L_tok, atol=atol_per_token, rtol=0)
