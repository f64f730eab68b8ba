"""collapse-monitor scoring core: the cross-scoring kernel and the RAGEN-2 diagnostic estimators.

Pure computation on token ids and matrices. Knows nothing of HTTP, SQL, Prometheus or the
environment; must never import service/.
"""

from scoring.batch import BatchError, ScoringBatch
from scoring.config import ScoringConfig
from scoring.cross_scores import CrossScores, ScoringError, score_batch
from scoring.models import ModelLoadError, Scorer, load_scorer
from scoring.reference import score_batch_naive

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
]
