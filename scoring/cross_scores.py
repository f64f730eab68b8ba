"""The cross-scoring kernel: L[r, j] = log p(z_r | x_j) for every reasoning row r and every column j.

How the work is shared (naive scoring re-encodes [x_j ; z_r] for every pair):
  1. prompts  the distinct prompts form a prefix tree (``scoring.prefix_tree``): every distinct
              token prefix runs once, attending to its ancestors' keys and values (a system prompt
              shared by all, a trajectory's history shared by its later turns, at any depth); each
              prompt's last hidden state gives log p(z_r[0] | x_j) for every row at once;
  2. pairs    every (reasoning, prompt) pair runs only z[:-1], attending to the prompt's tree nodes,
              many pairs per forward; a reasoning several rows carry runs once (its rows copied).
Shared keys and values are never copied per sequence: ``scoring.cascade`` attends to them in
place. Only scored positions are projected onto the vocabulary, in chunks. Every forward holds at
most ``max_batch_tokens`` tokens (sequences x (attended + new)); distinct prompts are processed in
depth-first blocks whose new nodes fit that budget, and a node's keys and values are freed once no
later prompt is below it, so the keys and values held are bounded by it too.
Must not import service/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from scoring import prefix_tree
from scoring.batch import ScoringBatch, Tokens
from scoring.cascade import CascadePlan, Segment, install
from scoring.config import ScoringConfig
from scoring.estimators import per_token
from scoring.forward import CHUNK_BYTES, packed_forward, supports
from scoring.prefix_tree import PrefixTree
from scoring.scorer import Scorer

# At most this many bytes in a vocabulary projection's logits buffer (reused by every chunk of the
# call): 512 rows of SmolLM2's vocabulary (96 MiB), 220 of Qwen2.5's.
LOGITS_BYTES = 128 * 2**20


class ScoringError(ValueError):
    """The batch cannot be scored with this scorer and config; the message names the row."""


@dataclass(frozen=True)
class CrossScores:
    """The cross-scoring matrix of one batch, in nats.

    Attributes:
        L_seq: [R, N] float64, sum over z_r's tokens of log p(token | x_j, earlier tokens).
        reasoning_lengths: [R] int64, T_r.
        token_entropy: R arrays of [T_r] float64: entropy of the full next-token distribution at
            each reasoning position of the matched pair (row r under its own prompt); empty arrays
            from a scorer that never sees the full distribution (``pair_scores``: vLLM).
        tokens_processed: tokens that went through the model (padding excluded).
        L_head: per head budget k (``ScoringConfig.head_tokens``), [R, N] float64: the sum over
            z_r's first min(T_r, k) tokens only.
        matched_logprobs: R arrays of [T_r] float64: log p(z_r[t] | x_r, z_r[:t]) of the matched
            pair (row r under its own prompt), the terms the diagonal L_seq[r, own column] sums;
            compared with the trainer's own log-probs (``scoring.logprob_gap``).
    """

    L_seq: np.ndarray
    reasoning_lengths: np.ndarray
    token_entropy: tuple[np.ndarray, ...]
    tokens_processed: int
    L_head: dict[int, np.ndarray] = field(default_factory=dict)
    matched_logprobs: tuple[np.ndarray, ...] = ()

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
    tree = prefix_tree.build(prompts)
    firsts, reasoning_of_row = batch.distinct_reasonings()
    reasonings = [batch.reasonings[r] for r in firsts]
    run = _Run(scorer, config, reasonings, reasoning_of_row, prompt_of_row, tree, check)
    with torch.inference_mode():
        order = [u for node in tree.nodes for u in node.ends]  # depth-first: a subtree's prompts together
        done = 0
        for block in _prompt_blocks(tree, order, config.max_batch_tokens):
            run.encode_nodes(block)
            for pairs in _pair_batches([prompts[u] for u in block], reasonings, config.max_batch_tokens):
                run.score_pairs([(block[i], d) for i, d in pairs], prompts)
            done += len(block)
            # Later prompts need only the nodes on their own paths: the others are freed.
            run.keep({n for u in order[done:] for n in tree.path(u)})

    return CrossScores(
        # [R, N]: a repeated reasoning's rows share one scored row, duplicate prompts one scored column
        L_seq=run.L[reasoning_of_row][:, prompt_of_column],
        reasoning_lengths=batch.reasoning_lengths,
        token_entropy=tuple(run.entropy),
        tokens_processed=run.tokens_processed,
        L_head={k: L[reasoning_of_row][:, prompt_of_column] for k, L in run.L_head.items()},
        matched_logprobs=tuple(run.matched),
    )


def scored_pairs(batch: ScoringBatch) -> tuple[list[Tokens], list[tuple[int, int]]]:
    """The distinct prompts of ``batch`` and the (prompt index, row) pairs a per-pair scorer runs.

    Every distinct reasoning with at least one token (its first row), under every distinct prompt:
    ``[x_u ; z_r]`` is one sequence of ``len(x_u) + len(z_r)`` tokens (no prefix is shared between pairs).
    """
    prompts, _ = _distinct_prompts(batch.column_prompts)
    firsts, _ = batch.distinct_reasonings()
    pairs = [(u, r) for u in range(len(prompts)) for r in firsts if batch.reasonings[r]]
    return prompts, pairs


def pair_scores(
    batch: ScoringBatch,
    token_logprobs: dict[tuple[int, int], np.ndarray],
    head_tokens: tuple[int, ...],
    tokens_processed: int,
) -> CrossScores:
    """CrossScores from the per-token log-probs of every pair of ``scored_pairs(batch)``.

    ``L_seq[r, j] = sum_t lp[u_j, r][t]`` and ``L_head[k][r, j] = sum_{t < k} lp[u_j, r][t]``, the
    kernel's sums (``score_batch``) over log-probs computed elsewhere (a vLLM server). Rows without
    reasoning score 0. No entropy: ``token_entropy`` holds empty arrays, which
    ``estimators.token_entropy_stats`` leaves out.

    Args:
        batch: the scored batch.
        token_logprobs: (distinct prompt index, row) -> [T_r] float64 log p(z_r[t] | x_u, z_r[:t]), nats.
        head_tokens: the budgets k of ``ScoringConfig.head_tokens``.
        tokens_processed: tokens the scorer ran.
    """
    prompts, prompt_of_column = _distinct_prompts(batch.column_prompts)
    prompt_of_row = prompt_of_column[np.asarray(batch.column_of_row)]  # [R]
    firsts, reasoning_of_row = batch.distinct_reasonings()
    scored_row = [firsts[d] for d in reasoning_of_row]  # [R]: the row whose pairs were scored for each row
    _, pairs = scored_pairs(batch)
    missing = set(pairs) - token_logprobs.keys()
    assert not missing, f"pairs without log-probs: {sorted(missing)[:5]}"
    L = np.zeros((batch.n_rows, len(prompts)), dtype=np.float64)  # [R, U], filled on the scored rows
    L_head = {k: np.zeros_like(L) for k in head_tokens}
    for (u, r), logprobs in token_logprobs.items():
        if len(logprobs) != len(batch.reasonings[r]):
            raise ScoringError(f"row {r}: {len(logprobs)} log-probs for {len(batch.reasonings[r])} reasoning tokens")
        L[r, u] = float(np.sum(logprobs))
        for k, head in L_head.items():
            head[r, u] = float(np.sum(logprobs[:k]))
    return CrossScores(
        L_seq=L[scored_row][:, prompt_of_column],  # [R, N]
        reasoning_lengths=batch.reasoning_lengths,
        token_entropy=tuple(np.empty(0) for _ in range(batch.n_rows)),
        tokens_processed=tokens_processed,
        L_head={k: head[scored_row][:, prompt_of_column] for k, head in L_head.items()},
        matched_logprobs=tuple(
            token_logprobs.get((int(u), r), np.empty(0)) for r, u in zip(scored_row, prompt_of_row, strict=True)
        ),
    )


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) over the last dim, in at least float32 (nats)."""
    # Half-precision logits are upcast: a log-softmax over ~50k entries in bf16 loses digits.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # x / 1.0 == x exactly: the usual temperature skips a pass over [rows, V].
    return torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)


def _log_softmax_(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``scaled_log_softmax`` of float32 (or wider) logits, written over them."""
    if temperature != 1.0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1, out=logits)


def logits_chunk_rows(chunk_tokens: int, vocab: int) -> int:
    """Rows projected onto the vocabulary at a time: ``chunk_tokens``, fewer where their float32 logits
    would pass ``LOGITS_BYTES``."""
    return max(1, min(chunk_tokens, LOGITS_BYTES // (4 * vocab)))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each distribution given as log-probabilities over the last dim."""
    return -(logp.exp() * logp).sum(dim=-1)


Projection = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def vocabulary_projection(head: torch.nn.Module) -> Projection:
    """(hidden [M, H], out [M, V] or None) -> logits [M, V] in at least float32, into ``out`` when given.

    A half-precision head multiplies its half-precision inputs with float32 output: rounding the
    logits themselves to bfloat16 (8 bits of mantissa on values of ~10) is the largest single error
    of a bfloat16 scorer, and it is avoidable at no extra matmul cost on CUDA.
    """
    weight: torch.Tensor = head.weight  # type: ignore[assignment]  # an nn.Linear on every HF causal LM
    bias: torch.Tensor | None = getattr(head, "bias", None)
    if weight.dtype in (torch.bfloat16, torch.float16):
        if weight.is_cuda and _has_float_output_mm(weight):
            bias32 = None if bias is None else bias.float()

            def project_half(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
                logits = torch.mm(hidden.to(weight.dtype), weight.t(), out_dtype=torch.float32)
                logits = logits if bias32 is None else logits + bias32
                return logits if out is None else out.copy_(logits)

            return project_half
        # Elsewhere the weights are upcast once per scoring call (exactly: bf16 and fp16 fit in fp32).
        weight, bias = weight.float(), None if bias is None else bias.float()

    def project(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # The ops F.linear runs on a matrix, with an ``out``.
        hidden = hidden.to(weight.dtype)
        if bias is None:
            return torch.mm(hidden, weight.t(), out=out)
        return torch.addmm(bias, hidden, weight.t(), out=out)

    return project


def _has_float_output_mm(weight: torch.Tensor) -> bool:
    try:
        torch.mm(weight[:1], weight[:1].t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError):  # builds without the half-in, float-out matmul
        return False
    return True


def token_logprobs(
    head: Projection,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    want_entropy: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    check: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token, and the entropy where asked, chunk by chunk.

    Args:
        head: hidden -> vocabulary logits (``vocabulary_projection`` of the output embedding).
        hidden: [M, H] hidden states at scored positions.
        targets: [M] token ids to score.
        want_entropy: [M] bool, where to compute the entropy of the full distribution.
        temperature: logits are divided by it.
        chunk_tokens: rows projected onto the vocabulary at a time (``logits_chunk_rows``).
        check: called before each chunk; an exception it raises abandons the work.

    Returns:
        ([M] float64 log p(target) in nats, [M] float64 entropy in nats, NaN where not asked).
        Naive equivalent: ``log_softmax(head(hidden) / temperature)`` gathered at ``targets``.
    """
    logp = torch.empty(hidden.shape[0], dtype=torch.float64, device=hidden.device)
    entropy = torch.full_like(logp, float("nan"))
    # One logits buffer for every chunk, the log-softmax written over it: chunks of a few hundred
    # rows keep the vocabulary matmul efficient (on SmolLM2, CPU: ~48 GFLOP/s per CPU second at
    # 128 rows, ~73 at 512), and a buffer allocated once is page-faulted once, not at every chunk.
    buffer: torch.Tensor | None = None  # [chunk_tokens, V], the first chunk's logits
    for start in range(0, hidden.shape[0], chunk_tokens):
        if check is not None:
            check()
        end = min(start + chunk_tokens, hidden.shape[0])
        logits = head(hidden[start:end], None if buffer is None else buffer[: end - start])  # [chunk, V]
        buffer = logits if buffer is None else buffer
        lp = _log_softmax_(logits, temperature)
        logp[start:end] = lp.gather(1, targets[start:end, None]).squeeze(1).double()
        wanted = want_entropy[start:end].nonzero().squeeze(1)
        # In slices of at most CHUNK_BYTES of [rows, V] temporaries.
        slice_rows = max(1, CHUNK_BYTES // lp[0].nbytes)
        for i in range(0, wanted.numel(), slice_rows):
            part = wanted[i : i + slice_rows]
            entropy[start + part] = entropy_from_logprobs(lp[part]).double()
    return logp, entropy


class _Run:
    """Accumulates L over the distinct reasonings and the matched pairs' entropies per row of one score_batch call."""

    def __init__(
        self,
        scorer: Scorer,
        config: ScoringConfig,
        reasonings: Sequence[Tokens],
        reasoning_of_row: np.ndarray,
        prompt_of_row: np.ndarray,
        tree: PrefixTree,
        check: Callable[[], None] | None,
    ) -> None:
        self.base = scorer.model.base_model
        self.head = vocabulary_projection(scorer.model.get_output_embeddings())
        self.chunk_rows = logits_chunk_rows(config.logits_chunk_tokens, scorer.vocab_size)
        self.device = scorer.device
        self.config = config
        self.reasonings = reasonings  # distinct: pairs are (prompt u, reasoning d)
        self.rows_of: dict[int, dict[int, list[int]]] = {}  # u -> d -> the rows (u, d) is the matched pair of
        for r, (d, u) in enumerate(zip(reasoning_of_row.tolist(), prompt_of_row.tolist(), strict=True)):
            self.rows_of.setdefault(u, {}).setdefault(d, []).append(r)
        rows = [reasonings[d] for d in reasoning_of_row]
        self.check = check
        self.tree = tree
        self.packed = config.attention == "packed" or (config.attention == "auto" and self.device.type == "cuda")
        # The kernel's own forward runs cascade attention; the packed FlexAttention path is transformers'.
        self.own_forward = not self.packed and supports(scorer.model)
        self.computed: dict[int, Segment] = {}  # tree node -> its keys and values, seen by every row below it
        self.joined: dict[tuple[int, ...], Segment] = {}  # nodes -> their keys and values, concatenated
        self.L = np.zeros((len(reasonings), len(tree.node_of_prompt)), dtype=np.float64)  # [D, U]
        self.L_head = {k: np.zeros_like(self.L) for k in config.head_tokens}  # k -> [D, U], first k tokens
        self.entropy = [np.full(len(z), np.nan) for z in rows]  # per row, under its own prompt
        self.matched = [np.full(len(z), np.nan) for z in rows]  # per row, its matched pair's token log-probs
        self.tokens_processed = 0

    def forward(self, sequences: Sequence[Tokens], start_positions: Sequence[int], plan: CascadePlan) -> torch.Tensor:
        """Runs ``sequences`` with ``plan``; returns the hidden states of their tokens, packed in order [T, H]."""
        plan.check = self.check
        plan.packed = self.packed
        lengths = torch.tensor([len(s) for s in sequences])
        valid = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]  # [B, Q]
        positions = torch.tensor(start_positions)[:, None] + torch.arange(valid.shape[1])  # [B, Q]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)  # [T]
        self.tokens_processed += len(ids)
        if self.own_forward:
            device = self.device
            return packed_forward(self.base, ids.to(device), positions[valid].to(device), valid.to(device), plan)
        padded = torch.zeros(valid.shape, dtype=torch.long)
        padded[valid] = ids
        # No cache and no mask: cascade attention knows each sequence's context from the plan,
        # and right padding is invisible to the valid tokens under causal attention.
        out = self.base(
            input_ids=padded.to(self.device), position_ids=positions.to(self.device), use_cache=False, cascade=plan
        )
        hidden: torch.Tensor = out.last_hidden_state[valid.to(self.device)]
        return hidden

    def segments(self, paths: Sequence[Sequence[int]]) -> list[Segment]:
        """The computed nodes on the batch rows' ``paths``, as segments listing the rows that see them.

        The nodes every row sees form one segment; each row's remaining nodes are joined into one
        segment per distinct remainder (a prompt's own branch). Attention then runs one call per
        group of rows, as many as the batch has prompts, not one per tree node: each call costs
        as much bookkeeping as a large one (measured on SmolLM2, CPU).
        """
        every = set(paths[0]).intersection(*map(set, paths[1:]))
        rows_of: dict[tuple[int, ...], list[int]] = {}
        for b, path in enumerate(paths):
            rows_of.setdefault(tuple(n for n in path if n not in every), []).append(b)
        segments = []
        if every:
            shared = self._joined(tuple(n for n in paths[0] if n in every))
            segments.append(Segment(shared.keys, shared.values))
        for nodes, rows in rows_of.items():
            if nodes:
                joined = self._joined(nodes)
                segments.append(Segment(joined.keys, joined.values, _rows(rows, len(paths), self.device)))
        return segments

    def _joined(self, nodes: tuple[int, ...]) -> Segment:
        if len(nodes) == 1:
            return self.computed[nodes[0]]
        if nodes not in self.joined:
            parts = [self.computed[n] for n in nodes]
            layers = range(len(parts[0].keys))
            self.joined[nodes] = Segment(
                keys=[torch.cat([p.keys[i] for p in parts], dim=1) for i in layers],
                values=[torch.cat([p.values[i] for p in parts], dim=1) for i in layers],
            )
        return self.joined[nodes]

    def encode_nodes(self, prompts: Sequence[int]) -> None:
        """Runs the not yet computed nodes of the prompts' paths, ancestors first, each exactly once."""
        todo = sorted({n for u in prompts for n in self.tree.path(u)} - self.computed.keys())
        by_depth: dict[int, list[int]] = {}
        for n in todo:
            by_depth.setdefault(len(self.tree.nodes[n].path), []).append(n)
        for depth in sorted(by_depth):
            for group in _node_batches(self.tree, by_depth[depth], self.config.max_batch_tokens):
                self._encode(group)

    def keep(self, nodes: set[int]) -> None:
        """Frees the keys and values of every computed node not in ``nodes``."""
        self.computed = {n: s for n, s in self.computed.items() if n in nodes}
        self.joined = {key: s for key, s in self.joined.items() if nodes.issuperset(key)}

    def _encode(self, group: list[int]) -> None:
        nodes = [self.tree.nodes[n] for n in group]
        plan = CascadePlan(segments=self.segments([node.path for node in nodes]), record=True)
        hidden = self.forward([node.tokens for node in nodes], [node.start for node in nodes], plan)
        layers = range(len(plan.recorded))
        for b, (n, node) in enumerate(zip(group, nodes, strict=True)):
            # The node's own keys and values without the batch's padding: [kv_heads, length, D].
            length = len(node.tokens)
            self.computed[n] = Segment(
                keys=[plan.recorded[i][0][b, :, :length] for i in layers],
                values=[plan.recorded[i][1][b, :, :length] for i in layers],
            )
        ends = np.cumsum([len(node.tokens) for node in nodes]) - 1  # each node's last token, packed
        ending = [(b, u) for b, node in enumerate(nodes) for u in node.ends]
        if ending:
            last = torch.tensor([ends[b] for b, _ in ending], device=self.device)
            self._score_first_tokens(hidden[last], [u for _, u in ending])

    def _score_first_tokens(self, last_hidden: torch.Tensor, prompt_ids: list[int]) -> None:
        """log p(z_d[0] | x_u) for every reasoning, from each prompt's last hidden state [n, H].

        One vocabulary projection per prompt serves every reasoning's first token.
        """
        scored = np.array([d for d, z in enumerate(self.reasonings) if z], dtype=np.int64)
        if not scored.size:
            return
        at = {d: i for i, d in enumerate(scored.tolist())}
        first = torch.tensor([self.reasonings[d][0] for d in scored], device=self.device)
        chunk = self.chunk_rows
        for start in range(0, len(prompt_ids), chunk):
            lp = scaled_log_softmax(self.head(last_hidden[start : start + chunk], None), self.config.temperature)
            logp = lp[:, first].double().cpu().numpy()  # [chunk, scored]
            entropy = entropy_from_logprobs(lp).double().cpu().numpy()  # [chunk]
            for i, u in enumerate(prompt_ids[start : start + chunk]):
                self.L[scored, u] += logp[i]
                for L_head in self.L_head.values():
                    L_head[scored, u] += logp[i]
                for d, rows in self.rows_of.get(u, {}).items():
                    if d not in at:  # an empty reasoning: no token to score
                        continue
                    for r in rows:
                        self.entropy[r][0] = entropy[i]
                        self.matched[r][0] = logp[i, at[d]]

    def score_pairs(self, pairs: list[tuple[int, int]], prompts: Sequence[Tokens]) -> None:
        """Runs z_d[:-1] for each (prompt, reasoning) pair after its prompt's nodes."""
        plan = CascadePlan(self.segments([self.tree.path(u) for u, _ in pairs]))
        queries = [self.reasonings[d][:-1] for _, d in pairs]
        hidden = self.forward(queries, [len(prompts[u]) for u, _ in pairs], plan)  # [T, H]
        targets = torch.tensor([t for _, d in pairs for t in self.reasonings[d][1:]], device=self.device)
        lengths = torch.tensor([len(q) for q in queries])
        valid = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).to(self.device)  # [B, Q]
        matched = torch.tensor([d in self.rows_of.get(u, {}) for u, d in pairs])
        logp, entropy = token_logprobs(
            self.head,
            hidden,
            targets,
            matched.repeat_interleave(lengths).to(self.device),
            self.config.temperature,
            self.chunk_rows,
            self.check,
        )
        per_position = torch.zeros(valid.shape, dtype=torch.float64, device=self.device)
        per_position[valid] = logp
        sums = per_position.sum(dim=1).cpu().numpy()
        per_position_np = per_position.cpu().numpy()  # [B, Q]: the matched pairs' rows are kept
        # Position q scores token q + 1: the first k tokens are the first token and positions < k - 1.
        head_sums = {k: per_position[:, : k - 1].sum(dim=1).cpu().numpy() for k in self.L_head}
        entropy_rows = torch.full(valid.shape, float("nan"), dtype=torch.float64, device=self.device)
        entropy_rows[valid] = entropy
        entropy_np = entropy_rows.cpu().numpy()
        for b, (u, d) in enumerate(pairs):
            self.L[d, u] += sums[b]
            for k, L_head in self.L_head.items():
                L_head[d, u] += head_sums[k][b]
            for r in self.rows_of.get(u, {}).get(d, ()):
                self.entropy[r][1:] = entropy_np[b, : len(self.reasonings[d]) - 1]
                self.matched[r][1:] = per_position_np[b, : len(self.reasonings[d]) - 1]


def _rows(rows: list[int], batch: int, device: torch.device) -> torch.Tensor | slice | None:
    """Rows ascending, as cheaply as attention can take them: all (None), a range (a view), or a list."""
    if len(rows) == batch:
        return None
    if rows[-1] - rows[0] + 1 == len(rows):  # pairs are batched prompt by prompt: usually a range
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, device=device)


def _distinct_prompts(column_prompts: Sequence[Tokens]) -> tuple[list[Tokens], np.ndarray]:
    """Distinct prompts (first-seen order) and, per column, the index of its prompt."""
    index: dict[Tokens, int] = {}
    of_column = np.array([index.setdefault(p, len(index)) for p in column_prompts], dtype=np.int64)
    return list(index), of_column


def _prompt_blocks(tree: PrefixTree, order: Sequence[int], budget: int) -> Iterator[list[int]]:
    """Consecutive prompts of ``order`` whose nodes not run before hold at most ``budget`` tokens.

    Bounds the keys and values held at once: a block's new nodes, plus the paths later prompts need.
    """
    seen: set[int] = set()
    block: list[int] = []
    tokens = 0
    for u in order:
        fresh = [n for n in tree.path(u) if n not in seen]
        new = sum(len(tree.nodes[n].tokens) for n in fresh)
        if block and tokens + new > budget:
            yield block
            block, tokens = [], 0
        block.append(u)
        tokens += new
        seen.update(fresh)
    if block:
        yield block


def _node_batches(tree: PrefixTree, nodes: Sequence[int], budget: int) -> Iterator[list[int]]:
    """Groups nodes, shortest first, into forwards of at most ``budget`` tokens (attended + padded)."""
    order = sorted(nodes, key=lambda n: (len(tree.nodes[n].tokens), n))
    batch: list[int] = []
    attended = 0
    for n in order:
        node = tree.nodes[n]
        # Sorted ascending, so the newest member is the longest: the batch's padded width.
        if batch and attended + node.start + (len(batch) + 1) * len(node.tokens) > budget:
            yield batch
            batch, attended = [], 0
        batch.append(n)
        attended += node.start
    if batch:
        yield batch


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
