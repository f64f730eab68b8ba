"""collapse-monitor scoring core: the cross-scoring kernel and the RAGEN-2 diagnostic estimators.

Pure computation on token ids and matrices. Knows nothing of HTTP, SQL, Prometheus or the
environment; must never import service/.

The names below are loaded on first use, so that importing a torch-free submodule
(``scoring.estimators``, ``scoring.snr_filter``, ...) does not load torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scoring.batch import BatchError, ScoringBatch
    from scoring.config import ScoringConfig
    from scoring.cross_scores import CrossScores, ScoringError, score_batch
    from scoring.reference import score_batch_naive
    from scoring.scorer import ModelLoadError, Scorer
    from scoring.verification import load_scorer, verify_scorer

_HOMES = {
    "BatchError": "scoring.batch",
    "ScoringBatch": "scoring.batch",
    "ScoringConfig": "scoring.config",
    "CrossScores": "scoring.cross_scores",
    "ScoringError": "scoring.cross_scores",
    "score_batch": "scoring.cross_scores",
    "score_batch_naive": "scoring.reference",
    "ModelLoadError": "scoring.scorer",
    "Scorer": "scoring.scorer",
    "load_scorer": "scoring.verification",
    "verify_scorer": "scoring.verification",
}
__all__ = [
    "BatchError",
    "CrossScores",
    "ModelLoadError",
    "Scorer",
    "ScoringBatch",
    "ScoringConfig",
    "ScoringError",
    "load_scorer",
    "score_batch",
    "score_batch_naive",
    "verify_scorer",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'scoring' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
