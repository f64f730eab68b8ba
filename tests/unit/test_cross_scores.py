"""The kernel equals the naive per-pair scorer, whatever the batching; budgets are honoured."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from scoring import ScoringBatch, ScoringConfig, ScoringError, cascade, cross_scores, score_batch, score_batch_naive
from scoring.cross_scores import LOGITS_BYTES, logits_chunk_rows
from tests.conftest import VOCAB, random_batch, tiny_scorer, trajectory_batch


def assert_scores_close(a, b, atol):
    np.testing.assert_allclose(a.L_seq, b.L_seq, atol=atol, rtol=0)
    assert a.L_head.keys() == b.L_head.keys()
    for k in a.L_head:
        np.testing.assert_allclose(a.L_head[k], b.L_head[k], atol=atol, rtol=0)
    np.testing.assert_allclose(a.L_tok, b.L_tok, atol=atol, rtol=0)
    np.testing.assert_array_equal(a.reasoning_lengths, b.reasoning_lengths)
    for ea, eb in zip(a.token_entropy, b.token_entropy, strict=True):
        np.testing.assert_allclose(ea, eb, atol=atol, rtol=0)  # NaN positions must agree too


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("budget", [40, 97, 100_000])
def test_batched_scores_match_pairwise_reference(family, dtype, atol, budget):
    scorer = tiny_scorer(family, dtype)
    batch = random_batch(seed=1)
    config = ScoringConfig(max_batch_tokens=budget, logits_chunk_tokens=7, temperature=0.7)
    fast = score_batch(scorer, batch, config)
    naive = score_batch_naive(scorer, batch, temperature=0.7, micro_batch_size=4)
    assert_scores_close(fast, naive, atol)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("budget", [40, 100_000])
def test_head_sums_are_the_first_k_tokens_of_each_pair(family, budget):
    scorer = tiny_scorer(family, torch.float64)
    batch = random_batch(seed=3)
    heads = (1, 2, 5, 1000)
    fast = score_batch(scorer, batch, ScoringConfig(max_batch_tokens=budget, head_tokens=heads))
    naive = score_batch_naive(scorer, batch, micro_batch_size=4, head_tokens=heads)
    assert_scores_close(fast, naive, 1e-10)
    # past every reasoning's length the head is the whole reasoning; one token is the first token alone
    np.testing.assert_allclose(fast.L_head[1000], fast.L_seq, atol=1e-10, rtol=0)
    assert not np.allclose(fast.L_head[2], fast.L_seq)
    lengths = batch.reasoning_lengths
    assert (fast.L_head[1][lengths == 0] == 0).all()


@pytest.mark.parametrize("fold_below", [0, 10**9])  # segments attended by the queries in place, or folded
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_segment_attention_in_place_or_folded_matches_pairwise_reference(family, fold_below, monkeypatch):
    monkeypatch.setattr(cascade, "FOLD_BELOW_QUERIES", fold_below)
    scorer = tiny_scorer(family, torch.float64)
    batch = random_batch(seed=1)
    for budget in (40, 100_000):
        fast = score_batch(scorer, batch, ScoringConfig(max_batch_tokens=budget, logits_chunk_tokens=7))
        assert_scores_close(fast, score_batch_naive(scorer, batch, micro_batch_size=4), 1e-10)


def test_micro_batched_reference_equals_one_pair_per_forward(llama64):
    batch = random_batch(seed=2)
    assert_scores_close(
        score_batch_naive(llama64, batch, micro_batch_size=1),
        score_batch_naive(llama64, batch, micro_batch_size=6),
        1e-10,
    )


def test_results_do_not_depend_on_row_order(llama64):
    batch = random_batch(seed=3)
    order = np.random.default_rng(0).permutation(batch.n_rows)
    shuffled = ScoringBatch.from_rows(
        [batch.prompts[i] for i in order], [batch.reasonings[i] for i in order], [batch.group_ids[i] for i in order]
    )
    a = score_batch(llama64, batch, ScoringConfig())
    b = score_batch(llama64, shuffled, ScoringConfig())
    np.testing.assert_allclose(b.L_seq, a.L_seq[order], atol=1e-10, rtol=0)
    for i, row in enumerate(order):
        np.testing.assert_allclose(b.token_entropy[i], a.token_entropy[row], atol=1e-10)


def test_a_row_scores_the_same_alone_and_beside_long_padded_rows(llama64):
    prompts = [[1, 2, 3, 4], [1, 2, 9]]
    alone = ScoringBatch.from_rows(prompts, [[5, 6], [7]], [0, 1])
    crowded = ScoringBatch.from_rows(
        [*prompts, [1, 2, 3, 4, *list(range(10, 60))]], [[5, 6], [7], list(range(40))], [0, 1, 2]
    )
    a = score_batch(llama64, alone, ScoringConfig(max_batch_tokens=100_000))
    b = score_batch(llama64, crowded, ScoringConfig(max_batch_tokens=100_000))
    np.testing.assert_allclose(b.L_seq[:2, :2], a.L_seq, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "prompts",
    [
        [[7, 7, 7], [7, 7, 7]],  # one distinct prompt: prefix stops before its last token
        [[1], [2]],  # single-token prompts, nothing shared
        [[3, 4, 5, 6], [3, 4, 5, 6, 8, 9]],  # one prompt is a prefix of the other
        [[9, 1], [8, 1]],  # differ at the first token
    ],
)
def test_prefix_sharing_edge_cases_match_reference(gpt2_64, prompts):
    batch = ScoringBatch.from_rows(prompts, [[1, 2, 3], [4]], [0, 1])
    assert_scores_close(score_batch(gpt2_64, batch, ScoringConfig()), score_batch_naive(gpt2_64, batch), 1e-10)


def test_duplicate_prompts_get_identical_columns_and_are_scored_once(llama64):
    batch = ScoringBatch.from_rows([[1, 2, 3], [1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10], [11]], [5, 2, 9])
    scores = score_batch(llama64, batch, ScoringConfig())
    assert batch.column_group_ids == (2, 5, 9)
    np.testing.assert_array_equal(scores.L_seq[:, 0], scores.L_seq[:, 1])
    # prefix [1, 2] shared? No: [4, 5] differs at once. Distinct prompts [1,2,3], [4,5]: 5 tokens, then
    # one query token per pair with T >= 2: rows 0 and 1 under 2 prompts.
    assert scores.tokens_processed == 5 + (1 + 2) * 2


def test_tokens_processed_is_the_minimum_exact_scoring_needs(llama64):
    batch = random_batch(seed=4)
    scores = score_batch(llama64, batch, ScoringConfig())
    distinct = set(batch.column_prompts)
    # Every distinct prompt prefix runs once (the system prompt once for all), and every distinct
    # reasoning's z[:-1] once per distinct prompt.
    prefixes = {p[:n] for p in distinct for n in range(1, len(p) + 1)}
    queries = sum(max(len(z) - 1, 0) for z in set(batch.reasonings)) * len(distinct)
    assert scores.tokens_processed == len(prefixes) + queries
    naive = score_batch_naive(llama64, batch)
    assert naive.tokens_processed == sum(len(p) + len(z) for p in batch.column_prompts for z in batch.reasonings)


def test_empty_and_single_token_reasoning(llama64):
    batch = ScoringBatch.from_rows([[1, 2], [3, 4]], [[], [5]], [0, 1])
    scores = score_batch(llama64, batch, ScoringConfig())
    np.testing.assert_array_equal(scores.L_seq[0], [0.0, 0.0])
    assert scores.token_entropy[0].shape == (0,)
    assert scores.token_entropy[1].shape == (1,)
    assert_scores_close(scores, score_batch_naive(llama64, batch), 1e-10)


def test_temperature_divides_the_logits(llama64):
    batch = random_batch(seed=5)
    hot = score_batch(llama64, batch, ScoringConfig(temperature=100.0))
    # At a very high temperature every token is close to uniform: log p -> -ln V.
    per_token = hot.L_seq / np.maximum(hot.reasoning_lengths, 1)[:, None]
    has_tokens = hot.reasoning_lengths > 0
    np.testing.assert_allclose(per_token[has_tokens], -math.log(VOCAB), atol=0.05)
    entropies = np.concatenate([e for e in hot.token_entropy if len(e)])
    np.testing.assert_allclose(entropies, math.log(VOCAB), atol=0.01)


class _ForwardLog:
    """Records what every forward held (at its first layer's attention) and every vocabulary projection.

    Both forwards (transformers' and the kernel's own, ``scoring.forward``) attend through
    ``scoring.cascade.cascade_attention``, and the kernel projects onto the vocabulary through
    ``cross_scores.vocabulary_projection``, both looked up at call time: this log wraps them.
    """

    def __init__(self):
        self.forward_tokens: list[int] = []
        self.head_rows: list[int] = []
        self.attend = cascade.cascade_attention
        self.projection = cross_scores.vocabulary_projection
        cascade.cascade_attention = self._on_attention
        cross_scores.vocabulary_projection = self._on_projection

    def _on_attention(self, query, key, value, segments, layer, *args, **kwargs):
        if layer == 0:
            attended = torch.zeros(query.shape[0], dtype=torch.long)
            for segment in segments:
                length = segment.keys[0].shape[1]
                if segment.rows is None:
                    attended += length
                else:
                    attended[segment.rows if isinstance(segment.rows, slice) else segment.rows.cpu()] += length
            self.forward_tokens.append(int((attended + query.shape[2]).sum()))  # [B, heads, Q, D]
        return self.attend(query, key, value, segments, layer, *args, **kwargs)

    def _on_projection(self, head):
        project = self.projection(head)

        def logged(hidden, out):
            self.head_rows.append(hidden.shape[0])
            return project(hidden, out)

        return logged

    def close(self):
        cascade.cascade_attention = self.attend
        cross_scores.vocabulary_projection = self.projection


@pytest.mark.parametrize("budget", [30, 64, 500])
def test_every_forward_stays_within_the_token_budget_and_logits_are_chunked(budget):
    scorer = tiny_scorer("llama", torch.float64)
    log = _ForwardLog()
    try:
        score_batch(scorer, random_batch(seed=6), ScoringConfig(max_batch_tokens=budget, logits_chunk_tokens=16))
    finally:
        log.close()
    assert log.forward_tokens, "the base model never ran"
    assert max(log.forward_tokens) <= budget
    assert max(log.head_rows) <= 16


def test_a_pair_larger_than_the_budget_is_refused_with_the_fix(llama64):
    batch = ScoringBatch.from_rows([list(range(20))], [list(range(30))], [0])
    with pytest.raises(ScoringError, match=r"row 0: .* needs 49 tokens .* max_batch_tokens=32; raise max_batch_tokens"):
        score_batch(llama64, batch, ScoringConfig(max_batch_tokens=32))


def test_a_pair_longer_than_the_context_is_refused(gpt2_64):
    batch = ScoringBatch.from_rows([list(range(60)) * 4], [[1] * 20], [0])  # 240 + 19 > 256 positions
    with pytest.raises(ScoringError, match=r"row 0: .* needs 259 positions; the scorer's context is 256"):
        score_batch(gpt2_64, batch, ScoringConfig())


def test_token_ids_outside_the_vocabulary_are_refused(llama64):
    batch = ScoringBatch.from_rows([[1, 2]], [[VOCAB + 3]], [0])
    with pytest.raises(ScoringError, match=f"row 0: reasoning token id {VOCAB + 3} is outside the vocabulary of 64"):
        score_batch(llama64, batch, ScoringConfig())


class Abandon(Exception):
    pass


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_check_is_called_at_every_layer_and_its_exception_abandons_the_batch(family):
    scorer = tiny_scorer(family)
    batch = random_batch(seed=3)
    config = ScoringConfig(max_batch_tokens=40)
    calls = 0

    def count() -> None:
        nonlocal calls
        calls += 1

    unchecked = score_batch(scorer, batch, config)
    checked = score_batch(scorer, batch, config, check=count)
    assert_scores_close(checked, unchecked, 0.0)  # checking changes nothing
    layers = scorer.model.config.num_hidden_layers
    assert calls > 3 * layers  # many forwards, each checked at every layer

    def give_up_later() -> None:
        nonlocal calls
        calls -= 1
        if calls == 0:
            raise Abandon

    calls = layers + 1  # gives up at the first layer of the second forward
    with pytest.raises(Abandon):
        score_batch(scorer, batch, config, check=give_up_later)
    assert calls == 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("budget", [45, 100_000])
@pytest.mark.parametrize("seed", [0, 1])
def test_trajectory_shaped_batches_match_the_reference_and_run_each_prefix_once(family, budget, seed):
    scorer = tiny_scorer(family, torch.float64)
    batch = trajectory_batch(seed)
    fast = score_batch(scorer, batch, ScoringConfig(max_batch_tokens=budget, logits_chunk_tokens=5))
    assert_scores_close(fast, score_batch_naive(scorer, batch, micro_batch_size=3), 1e-10)
    distinct = set(batch.column_prompts)
    prefixes = {p[:n] for p in distinct for n in range(1, len(p) + 1)}
    queries = sum(max(len(z) - 1, 0) for z in set(batch.reasonings)) * len(distinct)
    assert fast.tokens_processed == len(prefixes) + queries


@pytest.mark.parametrize("budget", [45, 500])
def test_trajectory_batches_stay_within_the_token_budget(budget):
    scorer = tiny_scorer("llama", torch.float64)
    log = _ForwardLog()
    try:
        score_batch(
            scorer, trajectory_batch(2, trajectories=4, turns=4, draws=12), ScoringConfig(max_batch_tokens=budget)
        )
    finally:
        log.close()
    assert max(log.forward_tokens) <= budget


def test_bfloat16_kernel_errs_no_more_than_the_naive_bfloat16_forward():
    """Against float32, per-token RMS and per-sequence p99 errors are within 1.25x the naive bf16 forward's."""
    fp32 = tiny_scorer("llama", torch.float32, seed=3)
    bf16 = tiny_scorer("llama", torch.float32, seed=3)
    bf16.model.to(dtype=torch.bfloat16)
    batch = random_batch(seed=9, n_groups=6, per_group=4, system_len=24)
    truth = score_batch_naive(fp32, batch, micro_batch_size=8)
    kernel = score_batch(bf16, batch, ScoringConfig())
    naive = score_batch_naive(bf16, batch, micro_batch_size=8)
    scored = batch.reasoning_lengths > 0

    def errors(scores):
        token_rms = float(np.sqrt(np.mean((scores.L_tok - truth.L_tok)[scored] ** 2)))
        sequence_p99 = float(np.percentile(np.abs(scores.L_seq - truth.L_seq)[scored], 99))
        return token_rms, sequence_p99

    (kernel_rms, kernel_p99), (naive_rms, naive_p99) = errors(kernel), errors(naive)
    assert naive_rms > 0
    assert kernel_rms <= 1.25 * naive_rms
    assert kernel_p99 <= 1.25 * naive_p99


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("shape", ["first-turn", "trajectory", "nested-edge-cases"])
@pytest.mark.parametrize("budget", [45, 100_000])
def test_the_packed_flex_attention_path_matches_the_reference(family, shape, budget):
    """The CUDA path's masks, run eagerly on CPU: which keys each packed token sees, for every shape."""
    scorer = tiny_scorer(family, torch.float64)
    if shape == "first-turn":
        batch = random_batch(seed=11)
    elif shape == "trajectory":
        batch = trajectory_batch(3, trajectories=3, turns=3, draws=8)
    else:
        batch = ScoringBatch.from_rows(
            [[3, 4, 5, 6], [3, 4, 5, 6, 8, 9], [3, 4], [9, 1], [7]],
            [[1, 2, 3], [4], [], [5, 6], [2, 2, 2, 2]],
            range(5),
        )
    config = ScoringConfig(max_batch_tokens=budget, attention="packed")
    fast = score_batch(scorer, batch, config)
    assert_scores_close(fast, score_batch_naive(scorer, batch, micro_batch_size=4), 1e-10)


def test_vocabulary_chunks_keep_their_logits_under_the_byte_bound():
    assert logits_chunk_rows(512, 49_152) == 512  # SmolLM2: 96 MiB of float32 logits
    assert logits_chunk_rows(512, 151_936) == 220  # Qwen2.5
    assert logits_chunk_rows(7, 49_152) == 7  # a smaller setting is kept
    assert logits_chunk_rows(512, 10**9) == 1  # never zero rows
    for vocab in (512, 49_152, 151_936):
        assert logits_chunk_rows(10**6, vocab) * 4 * vocab <= LOGITS_BYTES


def test_a_repeated_reasoning_is_scored_once_and_every_row_gets_its_scores(llama64):
    # Row 1 repeats row 0 under the same prompt (a trajectory sampler's repeated draw); row 3 repeats row 0's
    # reasoning under another prompt (a template answer): its own-prompt entropy is its own matched pair's.
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5], [6, 7, 8]]
    reasonings = [[9, 10, 11], [9, 10, 11], [12, 13], [9, 10, 11]]
    batch = ScoringBatch.from_rows(prompts, reasonings, [0, 0, 1, 2])
    fast = score_batch(llama64, batch, ScoringConfig(max_batch_tokens=40, logits_chunk_tokens=7))
    assert_scores_close(fast, score_batch_naive(llama64, batch, micro_batch_size=1), 1e-10)
    np.testing.assert_array_equal(fast.L_seq[0], fast.L_seq[3])
    assert not np.allclose(fast.token_entropy[0], fast.token_entropy[3])  # different own prompts
    np.testing.assert_allclose(fast.matched_logprobs[3].sum(), fast.L_seq[3, 2], atol=1e-10)
    np.testing.assert_allclose(fast.matched_logprobs[1].sum(), fast.L_seq[1, 0], atol=1e-10)
    # 8 tokens of distinct prompts, then 2 distinct reasonings (queries of 2 and 1 tokens) under 3 prompts.
    assert fast.tokens_processed == 3 + 2 + 3 + (2 + 1) * 3
