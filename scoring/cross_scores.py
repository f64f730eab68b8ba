"""The cross-scoring kernel: L[r, j] = log p(z_r | x_j) for every reasoning row r and every column j.

How the work is shared (naive scoring re-encodes [x_j ; z_r] for every pair):
  1. prefix   the longest prefix shared by all distinct prompts goes through the model once;
  2. columns  each distinct prompt's remaining tokens run once on top of the prefix cache; its last
              hidden state gives log p(z_r[0] | x_j) for every row at once;
  3. pairs    every (row, prompt) pair runs only z_r[:-1] on top of that prompt's cached keys and
              values, many pairs per forward, rows of different prompts mixed.
Only scored positions are projected onto the vocabulary, in chunks. Every forward holds at most
``max_batch_tokens`` tokens (sequences x (cached + new)); distinct prompts are processed in blocks
that fit that budget, so their caches are bounded by it too.
Must not import service/.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from scoring.batch import ScoringBatch, Tokens
from scoring.config import ScoringConfig
from scoring.models import Scorer


class ScoringError(ValueError):
    """The batch cannot be scored with this scorer and config; the message names the row."""


@dataclass(frozen=True)
class CrossScores:
    """The cross-scoring matrix of one batch, in nats.

    Attributes:
        L_seq: [R, N] float64, sum over z_r's tokens of log p(token | x_j, earlier tokens).
        L_tok: [R, N] float64, L_seq / max(T_r, 1).
        reasoning_lengths: [R] int64, T_r.
        token_entropy: R arrays of [T_r] float64: entropy of the full next-token distribution at
            each reasoning position of the matched pair (row r under its own prompt).
        tokens_processed: tokens that went through the model (padding excluded).
    """

    L_seq: np.ndarray
    L_tok: np.ndarray
    reasoning_lengths: np.ndarray
    token_entropy: tuple[np.ndarray, ...]
    tokens_processed: int


def score_batch(scorer: Scorer, batch: ScoringBatch, config: ScoringConfig) -> CrossScores:
    """Scores every reasoning row of ``batch`` under every column prompt.

    Naive equivalent (``scoring.reference.score_batch_naive``): for each column j and row r, one
    forward of [x_j ; z_r] and ``sum_t log_softmax(logits[|x_j| - 1 + t] / tau)[z_r[t]]``.
    Results do not depend on batch size, row order or padding beyond float rounding.
    """
    prompts, prompt_of_column = _distinct_prompts(batch.column_prompts)
    prompt_of_row = prompt_of_column[batch.column_of_row]  # [R]
    _check_lengths(scorer, batch, prompts, config.max_batch_tokens)
    run = _Run(scorer, config, batch.reasonings, prompt_of_row, n_prompts=len(prompts))
    with torch.inference_mode():
        prefix_len = _shared_prefix_length(prompts)
        prefix_kv = run.forward_prefix(prompts[0][:prefix_len])
        for block in _prompt_blocks(prompts, config.max_batch_tokens):
            run.score_block([prompts[u] for u in block], block, prefix_len, prefix_kv)

    lengths = batch.reasoning_lengths
    L_seq = run.L[:, prompt_of_column]  # [R, N]: duplicate prompts share one scored column
    return CrossScores(
        L_seq=L_seq,
        L_tok=L_seq / np.maximum(lengths, 1)[:, None],
        reasoning_lengths=lengths,
        token_entropy=tuple(run.entropy),
        tokens_processed=run.tokens_processed,
    )


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) over the last dim, in at least float32 (nats)."""
    # Half-precision logits are upcast: a log-softmax over ~50k entries in bf16 loses digits.
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each distribution given as log-probabilities over the last dim."""
    return -(logp.exp() * logp).sum(dim=-1)


def token_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    want_entropy: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token, and the entropy where asked, chunk by chunk.

    Args:
        head: the model's output embedding (hidden -> vocabulary logits).
        hidden: [M, H] hidden states at scored positions.
        targets: [M] token ids to score.
        want_entropy: [M] bool, where to compute the entropy of the full distribution.
        temperature: logits are divided by it.
        chunk_tokens: rows projected onto the vocabulary at a time.

    Returns:
        ([M] float64 log p(target) in nats, [M] float64 entropy in nats, NaN where not asked).
        Naive equivalent: ``log_softmax(head(hidden) / temperature)`` gathered at ``targets``.
    """
    logp = torch.empty(hidden.shape[0], dtype=torch.float64, device=hidden.device)
    entropy = torch.full_like(logp, float("nan"))
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        lp = scaled_log_softmax(head(hidden[start:end]), temperature)  # [chunk, V]
        logp[start:end] = lp.gather(1, targets[start:end, None]).squeeze(1).double()
        wanted = want_entropy[start:end].nonzero().squeeze(1)
        if wanted.numel():
            entropy[start + wanted] = entropy_from_logprobs(lp[wanted]).double()
    return logp, entropy


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, heads, slots, head_dim]


class _Run:
    """Accumulates L and the matched-pair entropies of one score_batch call."""

    def __init__(
        self,
        scorer: Scorer,
        config: ScoringConfig,
        reasonings: Sequence[Tokens],
        prompt_of_row: np.ndarray,
        n_prompts: int,
    ) -> None:
        self.base = scorer.model.base_model
        self.head = scorer.model.get_output_embeddings()
        self.device = scorer.device
        self.config = config
        self.reasonings = reasonings
        self.prompt_of_row = prompt_of_row
        self.L = np.zeros((len(reasonings), n_prompts), dtype=np.float64)  # [R, U]
        self.entropy = [np.full(len(z), np.nan) for z in reasonings]
        self.tokens_processed = 0

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, past: KV | None
    ) -> tuple[torch.Tensor, KV]:
        """Runs the base model on ``ids`` [B, Q] after ``past``; returns hidden [B, Q, H] and the KV."""
        from transformers import DynamicCache

        # A config-less DynamicCache keeps every layer whole (no sliding-window trimming), so
        # cached slots stay addressable by index when they are regrouped into new batches.
        cache = DynamicCache(ddp_cache_data=past) if past else DynamicCache()
        out = self.base(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        kv = [(layer.keys, layer.values) for layer in out.cache.layers]
        self.tokens_processed += int(mask[:, -ids.shape[1] :].sum())
        return out.last_hidden_state, kv

    def forward_prefix(self, prefix: Tokens) -> KV | None:
        if not prefix:
            return None
        ids = torch.tensor([prefix], device=self.device)
        _, kv = self.forward(ids, torch.ones_like(ids), torch.arange(len(prefix), device=self.device)[None], None)
        return kv

    def score_block(self, prompts: list[Tokens], prompt_ids: list[int], prefix_len: int, prefix_kv: KV | None) -> None:
        """Runs a block of distinct prompts, then every row under each of them."""
        n = len(prompts)
        suffixes = [p[prefix_len:] for p in prompts]
        ids, mask_new = _pad(suffixes, self.device)  # [n, S]
        mask = torch.cat([torch.ones(n, prefix_len, dtype=torch.long, device=self.device), mask_new], dim=1)
        positions = prefix_len + torch.arange(ids.shape[1], device=self.device).expand(n, -1)
        past = [(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in prefix_kv] if prefix_kv else None
        hidden, kv = self.forward(ids, mask, positions, past)
        last = torch.tensor([len(s) - 1 for s in suffixes], device=self.device)
        self._score_first_tokens(hidden[torch.arange(n, device=self.device), last], prompt_ids)
        for pairs in _pair_batches(prompts, self.reasonings, self.config.max_batch_tokens):
            self._score_pairs(pairs, prompts, prompt_ids, kv, mask)

    def _score_first_tokens(self, last_hidden: torch.Tensor, prompt_ids: list[int]) -> None:
        """log p(z_r[0] | x_u) for every row, from each prompt's last hidden state [n, H].

        One vocabulary projection per prompt serves every row's first token.
        """
        rows = [r for r, z in enumerate(self.reasonings) if z]
        if not rows:
            return
        first = torch.tensor([self.reasonings[r][0] for r in rows], device=self.device)
        chunk = self.config.logits_chunk_tokens
        for start in range(0, len(prompt_ids), chunk):
            lp = scaled_log_softmax(self.head(last_hidden[start : start + chunk]), self.config.temperature)
            logp = lp[:, first].double().cpu().numpy()  # [chunk, rows]
            entropy = entropy_from_logprobs(lp).double().cpu().numpy()  # [chunk]
            for i, u in enumerate(prompt_ids[start : start + chunk]):
                self.L[rows, u] += logp[i]
                for r in rows:
                    if self.prompt_of_row[r] == u:
                        self.entropy[r][0] = entropy[i]

    def _project(
        self, hidden: torch.Tensor, targets: torch.Tensor, want_entropy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(
            self.head, hidden, targets, want_entropy, self.config.temperature, self.config.logits_chunk_tokens
        )

    def _score_pairs(
        self,
        pairs: list[tuple[int, int]],
        prompts: list[Tokens],
        prompt_ids: list[int],
        kv: KV,
        prompt_mask: torch.Tensor,
    ) -> None:
        """Runs z_r[:-1] for each (block prompt index, row) pair on top of the prompt's cache."""
        device = self.device
        local = torch.tensor([i for i, _ in pairs], device=device)
        context = max(len(prompts[i]) for i, _ in pairs)
        # The block cache holds slots [prefix | suffix | padding]; columns were sorted by length,
        # so slicing to this batch's longest prompt drops only padding.
        slots = context
        past = [(k[local, :, :slots], v[local, :, :slots]) for k, v in kv]
        queries = [self.reasonings[r][:-1] for _, r in pairs]
        ids, query_mask = _pad(queries, device)  # [B, Q]
        mask = torch.cat([prompt_mask[local, :slots], query_mask], dim=1)
        starts = torch.tensor([len(prompts[i]) for i, _ in pairs], device=device)
        positions = starts[:, None] + torch.arange(ids.shape[1], device=device)
        hidden, _ = self.forward(ids, mask, positions, past)

        valid = query_mask.bool()
        targets, _ = _pad([self.reasonings[r][1:] for _, r in pairs], device)
        matched = torch.tensor([self.prompt_of_row[r] == prompt_ids[i] for i, r in pairs], device=device)
        logp, entropy = self._project(hidden[valid], targets[valid], matched[:, None].expand_as(valid)[valid])
        per_position = torch.zeros(valid.shape, dtype=torch.float64, device=device)
        per_position[valid] = logp
        sums = per_position.sum(dim=1).cpu().numpy()
        entropy_rows = torch.full(valid.shape, float("nan"), dtype=torch.float64, device=device)
        entropy_rows[valid] = entropy
        entropy_np = entropy_rows.cpu().numpy()
        for b, (i, r) in enumerate(pairs):
            self.L[r, prompt_ids[i]] += sums[b]
            if self.prompt_of_row[r] == prompt_ids[i]:
                self.entropy[r][1:] = entropy_np[b, : len(self.reasonings[r]) - 1]


def _pad(sequences: Sequence[Tokens], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads token sequences: ids [B, L] (pad id 0, never read) and mask [B, L]."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, : len(s)] = 1
    return ids.to(device), mask.to(device)


def _distinct_prompts(column_prompts: Sequence[Tokens]) -> tuple[list[Tokens], np.ndarray]:
    """Distinct prompts (first-seen order) and, per column, the index of its prompt."""
    index: dict[Tokens, int] = {}
    of_column = np.array([index.setdefault(p, len(index)) for p in column_prompts], dtype=np.int64)
    return list(index), of_column


def _shared_prefix_length(prompts: Sequence[Tokens]) -> int:
    """Longest common prefix, leaving each prompt at least its last token for the column phase."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def _prompt_blocks(prompts: Sequence[Tokens], budget: int) -> Iterator[list[int]]:
    """Groups distinct prompts, shortest first, into column forwards of at most ``budget`` tokens."""
    order = sorted(range(len(prompts)), key=lambda u: (len(prompts[u]), u))
    block: list[int] = []
    for u in order:
        # Sorted ascending, so the newest member is the longest: the block's padded width.
        if block and (len(block) + 1) * len(prompts[u]) > budget:
            yield block
            block = []
        block.append(u)
    if block:
        yield block


def _pair_batches(
    prompts: Sequence[Tokens], reasonings: Sequence[Tokens], budget: int
) -> Iterator[list[tuple[int, int]]]:
    """Batches of (block prompt index, row) pairs, longest queries first, within ``budget``.

    A batch of B pairs holds B x (longest prompt + longest query) tokens.
    """
    pairs = [(i, r) for r, z in enumerate(reasonings) if len(z) >= 2 for i in range(len(prompts))]
    pairs.sort(key=lambda p: (-len(reasonings[p[1]]), -len(prompts[p[0]]), p[1], p[0]))
    batch: list[tuple[int, int]] = []
    width = 0
    for i, r in pairs:
        need = len(prompts[i]) + len(reasonings[r]) - 1
        if batch and (len(batch) + 1) * max(width, need) > budget:
            yield batch
            batch, width = [], 0
        batch.append((i, r))
        width = max(width, need)
    if batch:
        yield batch


def _check_lengths(scorer: Scorer, batch: ScoringBatch, prompts: Sequence[Tokens], budget: int) -> None:
    longest_prompt = max(len(p) for p in prompts)
    limit = scorer.max_positions
    vocab = int(scorer.model.get_output_embeddings().weight.shape[0])
    for r, z in enumerate(batch.reasonings):
        need = longest_prompt + max(len(z) - 1, 0)
        if limit is not None and need > limit:
            raise ScoringError(
                f"row {r}: its longest (prompt, reasoning) pair needs {need} positions; the scorer's context is {limit}"
            )
        if need > budget:
            raise ScoringError(
                f"row {r}: its longest (prompt, reasoning) pair needs {need} tokens in one forward, "
                f"more than max_batch_tokens={budget}; raise max_batch_tokens"
            )
        if z and max(z) >= vocab:
            raise ScoringError(f"row {r}: reasoning token id {max(z)} is outside the vocabulary of {vocab}")
    for j, p in enumerate(batch.column_prompts):
        if max(p) >= vocab:
            raise ScoringError(f"column {j}: prompt token id {max(p)} is outside the vocabulary of {vocab}")
