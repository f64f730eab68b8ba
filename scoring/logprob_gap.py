"""The gap between the trainer's log-probabilities of its reasoning tokens and the scorer's.

A trainer that logs the log-probability of every token it sampled (its rollout engine's) can send
them; the scorer computes its own of the same tokens under the same prompt (the matched pair, the
terms the diagonal of L sums). Their mean absolute difference per token measures how far the two
computations disagree: engine against trainer when the scorer holds the policy's weights, the
policy's drift from a fixed reference model otherwise (docs/scoring.md). Must not import service/.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LOGPROB_GAP = "trainer_scorer_logprob_gap"  # the stored series, nats per token


def logprob_gap(trainer: Sequence[np.ndarray], scorer: Sequence[np.ndarray]) -> float | None:
    """Mean |trainer - scorer| log-probability over the tokens both computed, in nats per token.

    ``gap = sum_r sum_{t < n_r} |a_r[t] - b_r[t]| / sum_r n_r`` with ``n_r = len(b_r)``: every compared
    token weighs the same (as verl's rollout/actor probability-difference metrics), so long
    reasonings weigh more than short ones.

    Args:
        trainer: per row, [T_r] float64 log p(token) as the trainer sampled it (nats).
        scorer: per row, [n_r] float64 the scorer's log-probs of the same row's first n_r tokens,
            n_r <= T_r: a reasoning window scores only a reasoning's opening, so only those
            tokens are compared.

    Returns:
        The gap, or None when no token was compared.

    Naive equivalent: a loop over rows and tokens summing ``abs(a[t] - b[t])`` and counting them.
    """
    if len(trainer) != len(scorer):
        raise ValueError(f"trainer and scorer must hold the same rows, got {len(trainer)} and {len(scorer)}")
    for r, (a, b) in enumerate(zip(trainer, scorer, strict=True)):
        if len(b) > len(a):
            raise ValueError(f"row {r}: the scorer has {len(b)} log-probs for the trainer's {len(a)} tokens")
    if not any(len(b) for b in scorer):
        return None
    a = np.concatenate([np.asarray(a, dtype=np.float64)[: len(b)] for a, b in zip(trainer, scorer, strict=True)])
    b = np.concatenate([np.asarray(b, dtype=np.float64) for b in scorer])
    return float(np.abs(a - b).mean())
