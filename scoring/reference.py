"""The naive reference scorer: one forward per (column prompt, reasoning row) pair, as RAGEN does.

RAGEN (``collapse_metrics._compute_cross_log_probs``) builds [x_j ; z_r] for every pair, runs the
policy's full forward (logits at every position) and sums log-probs over the reasoning positions.
This module does exactly that, in micro-batches of rows per column, right-padded. It is the test
oracle of the kernel and the baseline of ``bench/cross_scoring.py``. Must not import service/.
"""

from __future__ import annotations

import numpy as np
import torch

from scoring.batch import ScoringBatch
from scoring.config import ScoringConfig
from scoring.cross_scores import CrossScores, entropy_from_logprobs, scaled_log_softmax, score_batch
from scoring.models import ModelLoadError, Scorer


def score_batch_naive(
    scorer: Scorer, batch: ScoringBatch, temperature: float = 1.0, micro_batch_size: int = 1
) -> CrossScores:
    """L_seq[r, j] = sum_t log_softmax(logits([x_j ; z_r])[|x_j| - 1 + t] / tau)[z_r[t]]."""
    device = scorer.device
    n_rows, n_cols = batch.n_rows, batch.n_columns
    L_seq = np.zeros((n_rows, n_cols), dtype=np.float64)
    entropy = [np.full(len(z), np.nan) for z in batch.reasonings]
    tokens = 0
    with torch.inference_mode():
        for j, prompt in enumerate(batch.column_prompts):
            for start in range(0, n_rows, micro_batch_size):
                rows = range(start, min(start + micro_batch_size, n_rows))
                seqs = [prompt + batch.reasonings[r] for r in rows]
                width = max(len(s) for s in seqs)
                ids = torch.zeros(len(seqs), width, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for b, s in enumerate(seqs):
                    ids[b, : len(s)] = torch.tensor(s)
                    mask[b, : len(s)] = 1
                tokens += int(mask.sum())
                logits = scorer.model(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    position_ids=torch.arange(width, device=device).expand(len(seqs), -1),
                ).logits
                logp = scaled_log_softmax(logits, temperature)  # [B, width, V]
                for b, r in enumerate(rows):
                    z = batch.reasonings[r]
                    if not z:
                        continue
                    at = slice(len(prompt) - 1, len(prompt) - 1 + len(z))
                    L_seq[r, j] = float(logp[b, at].gather(1, torch.tensor(z, device=device)[:, None]).double().sum())
                    if batch.column_of_row[r] == j:
                        entropy[r] = entropy_from_logprobs(logp[b, at]).double().cpu().numpy()
    lengths = batch.reasoning_lengths
    return CrossScores(
        L_seq=L_seq,
        L_tok=L_seq / np.maximum(lengths, 1)[:, None],
        reasoning_lengths=lengths,
        token_entropy=tuple(entropy),
        tokens_processed=tokens,
    )


def verify_scorer(scorer: Scorer) -> None:
    """Refuses a model the kernel would score wrongly, by scoring a tiny batch both ways.

    The kernel runs the base model with its own attention over shared segments and applies the
    output embedding itself; a model that soft-caps logits or attention, uses a sliding window or
    otherwise departs from that is caught here, at load, rather than mis-scored later.
    """
    vocab = int(scorer.model.get_output_embeddings().weight.shape[0])
    tokens = [t % vocab for t in range(1, 8)]
    batch = ScoringBatch.from_rows([tokens[:3], tokens[:2] + tokens[4:5]], [tokens[4:7], tokens[5:7]], [0, 1])
    try:
        fast = score_batch(scorer, batch, ScoringConfig())
    except ValueError as e:
        raise ModelLoadError(f"{scorer.name}: {e}") from e
    naive = score_batch_naive(scorer, batch)
    tolerance = 1e-3
    difference = float(np.abs(fast.L_seq - naive.L_seq).max())
    if not difference <= tolerance:
        raise ModelLoadError(
            f"{scorer.name}: the cross-scoring kernel disagrees with the model's own forward by {difference:.3g} "
            "nats (e.g. the model soft-caps or rescales its logits); it cannot be used as a scorer"
        )
