"""The load-time check: a scorer is used only once the kernel agrees with the model's own forward.

``load_scorer`` = ``models.load_model`` (float32) -> ``verify_scorer`` -> cast to the configured
dtype. Must not import service/.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from scoring.batch import ScoringBatch
from scoring.config import ScoringConfig
from scoring.cross_scores import score_batch
from scoring.models import load_model
from scoring.reference import score_batch_naive
from scoring.scorer import ModelLoadError, Scorer

TOLERANCE_NATS = 1e-3
_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def load_scorer(config: ScoringConfig, cache_dir: Path) -> Scorer:
    """Loads ``config.model``, verifies it, and casts it to ``config.dtype``.

    Args:
        config: which model, where and in which precision.
        cache_dir: folder for converted GGUF models (created when needed).
    """
    scorer = load_model(config, cache_dir)
    # Verified before any cast to half precision: in bf16 the model's own forward and the kernel
    # each drift from the float32 result by up to nats on long prompts (measured on SmolLM2), which
    # would hide a real disagreement.
    verify_scorer(scorer)
    scorer.model.to(dtype=_TORCH_DTYPES[config.dtype])
    return scorer


def verify_scorer(scorer: Scorer) -> None:
    """Refuses a model the kernel would score wrongly, by scoring a tiny batch both ways.

    The kernel runs the base model with its own attention over shared segments and applies the
    output embedding itself; a model that soft-caps logits or attention, uses a sliding window or
    otherwise departs from that is caught here, at load, rather than mis-scored later.
    """
    tokens = [t % scorer.vocab_size for t in range(1, 8)]
    batch = ScoringBatch.from_rows([tokens[:3], tokens[:2] + tokens[4:5]], [tokens[4:7], tokens[5:7]], [0, 1])
    try:
        fast = score_batch(scorer, batch, ScoringConfig())
    except ValueError as e:
        raise ModelLoadError(f"{scorer.name}: {e}") from e
    naive = score_batch_naive(scorer, batch)
    difference = float(np.abs(fast.L_seq - naive.L_seq).max())
    if not difference <= TOLERANCE_NATS:
        raise ModelLoadError(
            f"{scorer.name}: the cross-scoring kernel disagrees with the model's own forward by {difference:.3g} "
            "nats (e.g. the model soft-caps or rescales its logits); it cannot be used as a scorer"
        )
