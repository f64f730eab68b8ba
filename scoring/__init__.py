"""collapse-monitor scoring core: the cross-scoring kernel and the RAGEN-2 diagnostic estimators.

Pure computation on token ids and matrices. Knows nothing of HTTP, SQL, Prometheus or the
environment; must never import service/.
"""

from scoring.batch import BatchError, ScoringBatch
from scoring.config import ScoringConfig
from scoring.cross_scores import CrossScores, ScoringError, score_batch
from scoring.reference import score_batch_naive
from scoring.scorer import ModelLoadError, Scorer
from scoring.verification import load_scorer, verify_scorer

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
