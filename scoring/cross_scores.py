"""The cross-scoring kernel: L[r, j] = log p(z_r | x_j) for every reasoning row r and every column j.

How the work is shared (naive scoring re-encodes [x_j ; z_r] for every pair):
  1. prefix   the longest prefix shared by all distinct prompts goes through the model once;
  2. prompts  each distinct prompt's remaining tokens run once, attending to the prefix; its last
              hidden state gives log p(z_r[0] | x_j) for every row at once;
  3. pairs    every (row, prompt) pair runs only z_r[:-1], attending to the prefix and the prompt,
              many pairs per forward.
Shared keys and values are never copied per sequence: ``scoring.cascade`` attends to them in
place. Only scored positions are projected onto the vocabulary, in chunks. Every forward holds at
most ``max_batch_tokens`` tokens (sequences x (attended + new)); distinct prompts are processed in
blocks within that budget, so their keys and values are bounded by it too.
Must not import service/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from scoring.batch import ScoringBatch, Tokens
from scoring.cascade import CascadePlan, Segment, install
from scoring.config import ScoringConfig
from scoring.estimators import per_token
from scoring.scorer import Scorer


class ScoringError(ValueError):
    """The batch cannot be scored with this scorer and config; the message names the row."""


@dataclass(frozen=True)
class CrossScores:
    """The cross-scoring matrix of one batch, in nats.

    Attributes:
        L_seq: [R, N] float64, sum over z_r's tokens of log p(token | x_j, earlier tokens).
        reasoning_lengths: [R] int64, T_r.
        token_entropy: R arrays of [T_r] float64: entropy of the full next-token distribution at
            each reasoning position of the matched pair (row r under its own prompt).
        tokens_processed: tokens that went through the model (padding excluded).
    """

    L_seq: np.ndarray
    reasoning_lengths: np.ndarray
    token_entropy: tuple[np.ndarray, ...]
    tokens_processed: int

    @property
    def L_tok(self) -> np.ndarray:
        """[R, N] float64 per-token log-probabilities (``estimators.per_token``)."""
        return per_token(self.L_seq, self.reasoning_lengths)


def score_batch(
    scorer: Scorer, batch: ScoringBatch, config: ScoringConfig, check: Callable[[], None] | None = None
) -> CrossScores:
    """Scores every reasoning row of ``batch`` under every column prompt.

    Naive equivalent (``scoring.reference.score_batch_naive``): for each column j and row r, one
    forward of [x_j ; z_r] and ``sum_t log_softmax(logits[|x_j| - 1 + t] / tau)[z_r[t]]``.
    Results do not depend on batch size, row order or padding beyond float rounding.

    ``check`` is called at every layer of every forward and before every vocabulary chunk; an
    exception it raises abandons the batch and propagates (the caller's time limit or shutdown).
    """
    prompts, prompt_of_column = _distinct_prompts(batch.column_prompts)
    prompt_of_row = prompt_of_column[np.asarray(batch.column_of_row)]  # [R]
    _check_lengths(scorer, batch, prompts, config.max_batch_tokens)
    install(scorer.model)
    run = _Run(scorer, config, batch.reasonings, prompt_of_row, len(prompts), check)
    with torch.inference_mode():
        prefix_len = _shared_prefix_length(prompts)
        prefix = run.encode_prefix(prompts[0][:prefix_len])
        for block in _prompt_blocks(prompts, config.max_batch_tokens):
            run.score_block(block, [prompts[u] for u in block], prefix_len, prefix)

    return CrossScores(
        L_seq=run.L[:, prompt_of_column],  # [R, N]: duplicate prompts share one scored column
        reasoning_lengths=batch.reasoning_lengths,
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
    check: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token, and the entropy where asked, chunk by chunk.

    Args:
        head: the model's output embedding (hidden -> vocabulary logits).
        hidden: [M, H] hidden states at scored positions.
        targets: [M] token ids to score.
        want_entropy: [M] bool, where to compute the entropy of the full distribution.
        temperature: logits are divided by it.
        chunk_tokens: rows projected onto the vocabulary at a time.
        check: called before each chunk; an exception it raises abandons the work.

    Returns:
        ([M] float64 log p(target) in nats, [M] float64 entropy in nats, NaN where not asked).
        Naive equivalent: ``log_softmax(head(hidden) / temperature)`` gathered at ``targets``.
    """
    logp = torch.empty(hidden.shape[0], dtype=torch.float64, device=hidden.device)
    entropy = torch.full_like(logp, float("nan"))
    for start in range(0, hidden.shape[0], chunk_tokens):
        if check is not None:
            check()
        end = min(start + chunk_tokens, hidden.shape[0])
        lp = scaled_log_softmax(head(hidden[start:end]), temperature)  # [chunk, V]
        logp[start:end] = lp.gather(1, targets[start:end, None]).squeeze(1).double()
        wanted = want_entropy[start:end].nonzero().squeeze(1)
        if wanted.numel():
            entropy[start + wanted] = entropy_from_logprobs(lp[wanted]).double()
    return logp, entropy


class _Run:
    """Accumulates L and the matched-pair entropies of one score_batch call."""

    def __init__(
        self,
        scorer: Scorer,
        config: ScoringConfig,
        reasonings: Sequence[Tokens],
        prompt_of_row: np.ndarray,
        n_prompts: int,
        check: Callable[[], None] | None,
    ) -> None:
        self.base = scorer.model.base_model
        self.head = scorer.model.get_output_embeddings()
        self.device = scorer.device
        self.config = config
        self.reasonings = reasonings
        self.prompt_of_row = prompt_of_row
        self.check = check
        self.L = np.zeros((len(reasonings), n_prompts), dtype=np.float64)  # [R, U]
        self.entropy = [np.full(len(z), np.nan) for z in reasonings]
        self.tokens_processed = 0

    def forward(
        self, sequences: Sequence[Tokens], start_positions: Sequence[int], plan: CascadePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs right-padded ``sequences`` with ``plan``; returns hidden [B, Q, H] and the valid mask [B, Q]."""
        plan.check = self.check
        ids, mask = _pad(sequences, self.device)
        positions = torch.tensor(start_positions, device=self.device)[:, None] + torch.arange(
            ids.shape[1], device=self.device
        )
        # No cache and no mask: cascade attention knows each sequence's context from the plan,
        # and right padding is invisible to the valid tokens under causal attention.
        out = self.base(input_ids=ids, position_ids=positions, use_cache=False, cascade=plan)
        self.tokens_processed += int(mask.sum())
        return out.last_hidden_state, mask.bool()

    def encode_prefix(self, prefix: Tokens) -> Segment | None:
        """Keys and values of the shared prefix, seen by every later sequence."""
        if not prefix:
            return None
        plan = CascadePlan(segments=[], record=True)
        self.forward([prefix], [0], plan)
        layers = range(len(plan.recorded))
        return Segment(keys=[plan.recorded[i][0][0] for i in layers], values=[plan.recorded[i][1][0] for i in layers])

    def score_block(
        self, prompt_ids: list[int], prompts: list[Tokens], prefix_len: int, prefix: Segment | None
    ) -> None:
        """Encodes a block of distinct prompts once, then scores every row under each of them."""
        plan = CascadePlan(segments=[prefix] if prefix else [], record=True)
        suffixes = [p[prefix_len:] for p in prompts]
        hidden, _ = self.forward(suffixes, [prefix_len] * len(prompts), plan)
        last = torch.tensor([len(s) - 1 for s in suffixes], device=self.device)
        self._score_first_tokens(hidden[torch.arange(len(prompts), device=self.device), last], prompt_ids)
        layers = range(len(plan.recorded))
        # Each prompt's own keys and values, without the block's padding: [kv_heads, length, D].
        own = [
            (
                [plan.recorded[i][0][b, :, : len(s)] for i in layers],
                [plan.recorded[i][1][b, :, : len(s)] for i in layers],
            )
            for b, s in enumerate(suffixes)
        ]
        for pairs in _pair_batches(prompts, self.reasonings, self.config.max_batch_tokens):
            self._score_pairs(pairs, prompt_ids, prompts, prefix, own)

    def _score_first_tokens(self, last_hidden: torch.Tensor, prompt_ids: list[int]) -> None:
        """log p(z_r[0] | x_u) for every row, from each prompt's last hidden state [n, H].

        One vocabulary projection per prompt serves every row's first token.
        """
        rows = np.array([r for r, z in enumerate(self.reasonings) if z], dtype=np.int64)
        if not rows.size:
            return
        first = torch.tensor([self.reasonings[r][0] for r in rows], device=self.device)
        chunk = self.config.logits_chunk_tokens
        for start in range(0, len(prompt_ids), chunk):
            lp = scaled_log_softmax(self.head(last_hidden[start : start + chunk]), self.config.temperature)
            logp = lp[:, first].double().cpu().numpy()  # [chunk, rows]
            entropy = entropy_from_logprobs(lp).double().cpu().numpy()  # [chunk]
            for i, u in enumerate(prompt_ids[start : start + chunk]):
                self.L[rows, u] += logp[i]
                for r in rows[self.prompt_of_row[rows] == u]:
                    self.entropy[r][0] = entropy[i]

    def _score_pairs(
        self,
        pairs: list[tuple[int, int]],
        prompt_ids: list[int],
        prompts: list[Tokens],
        prefix: Segment | None,
        own: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    ) -> None:
        """Runs z_r[:-1] for each (block prompt index, row) pair after its prompt."""
        segments = [prefix] if prefix else []
        for i in sorted({i for i, _ in pairs}):
            rows = torch.tensor([b for b, (j, _) in enumerate(pairs) if j == i], device=self.device)
            segments.append(Segment(keys=own[i][0], values=own[i][1], rows=rows))
        hidden, valid = self.forward(
            [self.reasonings[r][:-1] for _, r in pairs], [len(prompts[i]) for i, _ in pairs], CascadePlan(segments)
        )
        targets, _ = _pad([self.reasonings[r][1:] for _, r in pairs], self.device)
        matched = torch.tensor([self.prompt_of_row[r] == prompt_ids[i] for i, r in pairs], device=self.device)
        logp, entropy = token_logprobs(
            self.head,
            hidden[valid],
            targets[valid],
            matched[:, None].expand_as(valid)[valid],
            self.config.temperature,
            self.config.logits_chunk_tokens,
            self.check,
        )
        per_position = torch.zeros(valid.shape, dtype=torch.float64, device=self.device)
        per_position[valid] = logp
        sums = per_position.sum(dim=1).cpu().numpy()
        entropy_rows = torch.full(valid.shape, float("nan"), dtype=torch.float64, device=self.device)
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
    """Longest common prefix, leaving each prompt at least its last token for the prompt phase."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def _prompt_blocks(prompts: Sequence[Tokens], budget: int) -> Iterator[list[int]]:
    """Groups distinct prompts, shortest first, into prompt forwards of at most ``budget`` tokens."""
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
    """Batches of (block prompt index, row) pairs within ``budget``, one prompt's pairs together.

    Keeping a prompt's pairs together lets each batch attend to few prompt segments, in large
    matmuls. A batch of B pairs holds B x (longest prompt + longest query) tokens.
    """
    pairs = [(i, r) for i in range(len(prompts)) for r, z in enumerate(reasonings) if len(z) >= 2]
    pairs.sort(key=lambda p: (p[0], -len(reasonings[p[1]]), p[1]))
    batch: list[tuple[int, int]] = []
    context = query = 0
    for i, r in pairs:
        wider_context, wider_query = max(context, len(prompts[i])), max(query, len(reasonings[r]) - 1)
        if batch and (len(batch) + 1) * (wider_context + wider_query) > budget:
            yield batch
            batch, wider_context, wider_query = [], len(prompts[i]), len(reasonings[r]) - 1
        batch.append((i, r))
        context, query = wider_context, wider_query
    if batch:
        yield batch


def _check_lengths(scorer: Scorer, batch: ScoringBatch, prompts: Sequence[Tokens], budget: int) -> None:
    longest_prompt = max(len(p) for p in prompts)
    limit = scorer.max_positions
    vocab = scorer.vocab_size
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
