"""The naive reference scorer: one forward per (column prompt, reasoning row) pair, as RAGEN does.

RAGEN (``collapse_metrics._compute_cross_log_probs``) builds [x_j ; z_r] for every pair, runs the
policy's full forward (logits at every position) and sums log-probs over the reasoning positions.
This module does exactly that, in micro-batches of rows per column, right-padded. It is the test
oracle of the kernel (at every scorer load too, see ``scoring.verification``) and the baseline
of ``bench/cross_scoring.py``. Must not import service/.
"""

from __future__ import annotations

import numpy as np
import torch

from scoring.batch import ScoringBatch
from scoring.cross_scores import CrossScores, entropy_from_logprobs, scaled_log_softmax
from scoring.scorer import Scorer


def score_batch_naive(
    scorer: Scorer,
    batch: ScoringBatch,
    temperature: float = 1.0,
    micro_batch_size: int = 1,
    head_tokens: tuple[int, ...] = (),
) -> CrossScores:
    """L_seq[r, j] = sum_t log_softmax(logits([x_j ; z_r])[|x_j| - 1 + t] / tau)[z_r[t]]; L_head[k] the
    same sum over t < k."""
    device = scorer.device
    n_rows, n_cols = batch.n_rows, batch.n_columns
    L_seq = np.zeros((n_rows, n_cols), dtype=np.float64)
    L_head = {k: np.zeros_like(L_seq) for k in head_tokens}
    entropy = [np.full(len(z), np.nan) for z in batch.reasonings]
    matched = [np.full(len(z), np.nan) for z in batch.reasonings]
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
                    per_token = logp[b, at].gather(1, torch.tensor(z, device=device)[:, None]).double()[:, 0]
                    L_seq[r, j] = float(per_token.sum())
                    for k in head_tokens:
                        L_head[k][r, j] = float(per_token[:k].sum())
                    if batch.column_of_row[r] == j:
                        entropy[r] = entropy_from_logprobs(logp[b, at]).double().cpu().numpy()
                        matched[r] = per_token.cpu().numpy()
    return CrossScores(
        L_seq=L_seq,
        reasoning_lengths=batch.reasoning_lengths,
        token_entropy=tuple(entropy),
        tokens_processed=tokens,
        L_head=L_head,
        matched_logprobs=tuple(matched),
    )
