"""The input-dependence signals beyond RAGEN's keys, against naive row-by-row versions and known answers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from scoring import dependence
from scoring.dependence import (
    DEPENDENCE_METRICS,
    HEAD_METRICS,
    DependenceConfig,
    chance_corrected,
    dependence_signals,
    duplicate_row_ratio,
    permutation_p,
    reciprocal_ranks,
)
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics


def signals(L, cols, signature=None, reasonings=None, L_head=None, permutations=200, prompts=None):
    L = np.asarray(L, dtype=np.float64)
    cols = np.asarray(cols)
    signature = np.arange(L.shape[1]) if signature is None else np.asarray(signature)
    prompts = prompts or [[int(s)] for s in signature]
    paper, _ = compute_diagnostics(L, L, cols, prompts, EmaState(), EstimatorConfig(bootstrap_samples=0))
    reasonings = reasonings or [[r] for r in range(L.shape[0])]
    head = None if L_head is None else np.asarray(L_head, dtype=np.float64)
    config = DependenceConfig(permutations)
    return dependence_signals(L, paper.metrics, cols, prompts, reasonings, config, head, L_seq=L)


def naive(L, cols, signature, L_seq=None, prompts=None):
    """The docstring's definitions, written out with Python floats and loops."""
    L_seq = L if L_seq is None else L_seq
    prompts = prompts or [[s] for s in signature]
    n_rows, n_cols = len(L), len(L[0])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    weights = [sum(c == j for c in cols) / n_rows for j in range(n_cols)]
    matched = [L[r][cols[r]] for r in range(n_rows)]
    null = [sum(w * L[r][j] for j, w in enumerate(weights)) for r in range(n_rows)]
    marginal = [math.log(sum(math.exp(v) for v in L[r])) - math.log(n_cols) for r in range(n_rows)]
    reciprocal = []
    for r in range(n_rows):
        best: dict[int, float] = {}
        for j in range(n_cols):
            best[signature[j]] = max(best.get(signature[j], -math.inf), L[r][j])
        own = best[signature[cols[r]]]
        higher = sum(v > own for v in best.values())
        tied = sum(v == own for v in best.values()) - 1
        # every order of the tied prompts equally likely: the own prompt at each place among them
        reciprocal.append(mean([1 / (1 + higher + u) for u in range(tied + 1)]))
    hits = [
        float(signature[max(range(n_cols), key=lambda j: (L[r][j], -j))] == signature[cols[r]]) for r in range(n_rows)
    ]
    chance = 1 / len(set(signature))
    ceiling = mean([math.log(n_cols / sum(s == signature[cols[r]] for s in signature)) for r in range(n_rows)])
    tokens = {signature[j]: set(prompts[j]) for j in range(n_cols)}
    nearest = []
    for r in range(n_rows):
        best = {}
        for j in range(n_cols):
            best[signature[j]] = max(best.get(signature[j], -math.inf), L_seq[r][j])
        own = signature[cols[r]]
        jaccard = {p: len(tokens[p] & tokens[own]) / len(tokens[p] | tokens[own]) for p in best if p != own}
        neighbours = sorted(jaccard, key=lambda p: (-jaccard[p], p))[:3]
        nearest.append(best[own] - mean([best[p] for p in neighbours]))
    return {
        "nearest_log_ratio": mean(nearest),
        "mi_seq_normalized": (mean(matched) - mean(marginal)) / ceiling,
        "retrieval_chance_corrected": (mean(hits) - chance) / (1 - chance),
        "retrieval_mrr": mean(reciprocal),
        "mi_excess": mean(matched) - mean(null),
    }


@pytest.mark.parametrize("seed", range(5))
def test_signals_match_the_naive_definitions_on_random_matrices(seed):
    rng = np.random.default_rng(seed)
    n_rows, n_cols = 12, 4
    L = rng.normal(-3, 2, size=(n_rows, n_cols)).round(1)  # rounded: exact ties happen
    cols = rng.integers(0, n_cols, size=n_rows)
    cols[:n_cols] = np.arange(n_cols)
    signature = [0, 1, 1, 2] if seed % 2 else [0, 1, 2, 3]
    got = signals(L, cols, signature)
    for name, value in naive(L.tolist(), cols.tolist(), signature).items():
        assert got[name] == pytest.approx(value, abs=1e-12), name
    assert set(got) == set(DEPENDENCE_METRICS)


def test_the_head_signals_are_ragens_mi_and_entropy_of_the_head_matrix():
    rng = np.random.default_rng(7)
    L, head = rng.normal(-3, 1, size=(6, 3)), rng.normal(-2, 1, size=(6, 3))
    cols = np.array([0, 0, 1, 1, 2, 2])
    got = signals(L, cols, L_head=head)
    paper, _ = compute_diagnostics(head, head, cols, None, EmaState(), EstimatorConfig(bootstrap_samples=0))
    assert got["mi_head_estimate"] == pytest.approx(paper.metrics["mi_estimate"], abs=1e-12)
    assert got["conditional_entropy_head_est"] == pytest.approx(paper.metrics["conditional_entropy_est"], abs=1e-12)
    assert got["mi_head_excess"] == pytest.approx(naive(head.tolist(), cols.tolist(), [0, 1, 2])["mi_excess"])
    assert set(HEAD_METRICS) <= set(got)


def test_appended_prompt_independent_text_dilutes_mi_but_not_the_head_mi():
    """Each reasoning answers its prompt in 8 tokens, then appends 40 tokens that fit every prompt alike."""
    answer = np.full((4, 4), -4.0 * 8)
    np.fill_diagonal(answer, -1.0 * 8)  # the own prompt explains the answer far better
    cols = np.arange(4)
    short = signals(answer / 8, cols, L_head=answer / 8)
    appended = (answer - 2.0 * 40) / 48  # the generic tail costs the same under every prompt
    long = signals(appended, cols, L_head=answer / 8)
    short_mi = signals(answer / 8, cols)["mi_excess"]
    assert long["mi_excess"] < short_mi / 4  # per-token figures follow the length
    assert long["mi_head_estimate"] == pytest.approx(short["mi_head_estimate"])
    assert long["mi_head_excess"] == pytest.approx(short["mi_head_excess"])


def test_identical_rows_have_no_dependence_and_a_separable_matrix_has_all():
    cols = np.array([0, 0, 1, 1, 2, 2])
    flat = signals(np.full((6, 3), -2.0), cols)
    assert flat["mi_excess"] == 0.0
    assert flat["retrieval_chance_corrected"] == 0.0  # every row retrieves column 0: a third are right
    assert flat["mi_permutation_p"] == 1.0  # every shuffle ties
    separable = np.full((6, 3), -50.0)
    separable[np.arange(6), cols] = -1.0
    sharp = signals(separable, cols)
    assert sharp["retrieval_chance_corrected"] == 1.0
    assert sharp["retrieval_mrr"] == 1.0
    assert sharp["mi_seq_normalized"] == pytest.approx(1.0, abs=1e-12)
    assert sharp["mi_permutation_p"] < 0.05


def test_the_permutation_p_value_matches_a_naive_loop_over_the_same_shuffles():
    rng = np.random.default_rng(3)
    L = rng.normal(size=(9, 3))
    cols = np.array([0, 1, 2] * 3)
    config = DependenceConfig(permutations=50, seed=11)
    draws = np.random.default_rng(11).permuted(np.tile(cols, (50, 1)), axis=1)
    observed = L[np.arange(9), cols].mean()
    nulls = [sum(L[r, perm[r]] for r in range(9)) / 9 for perm in draws]
    expected = (1 + sum(n >= observed - 1e-12 for n in nulls)) / 51
    assert permutation_p(L, cols, config) == pytest.approx(expected)
    assert permutation_p(L, cols, config) == permutation_p(L, cols, config)  # seeded


def test_the_permutation_null_drawn_in_chunks_is_the_null_drawn_at_once(monkeypatch):
    """Chunks bound its memory at the row limit; the generator's stream, and so the p-value, is unchanged."""
    rng = np.random.default_rng(5)
    cols = np.repeat(np.arange(4), 5)
    L = rng.normal(size=(20, 4)) + 0.3 * (np.arange(4)[None, :] == cols[:, None])
    config = DependenceConfig(permutations=97, seed=2)
    at_once = permutation_p(L, cols, config)
    monkeypatch.setattr(dependence, "PERMUTATION_CHUNK_ELEMENTS", 3 * 20 + 7)  # chunks of 3 shuffles, the last of 1
    assert permutation_p(L, cols, config) == at_once
    assert 0.01 < at_once < 0.99  # a p-value the shuffles decide, not a bound


def test_a_permutation_null_is_uniform_when_rows_do_not_depend_on_columns():
    """Under no dependence, p <= 0.1 about 10% of the time (the test's bound is generous)."""
    rng = np.random.default_rng(0)
    cols = np.repeat(np.arange(4), 3)
    small = sum(
        permutation_p(np.repeat(rng.normal(size=(12, 1)), 4, axis=1) + rng.normal(0, 1, (12, 4)), cols,
                      DependenceConfig(99, seed)) <= 0.1
        for seed in range(200)
    )  # fmt: skip
    assert 5 <= small <= 40


def test_reciprocal_ranks_count_identical_prompts_once():
    L = np.array([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]])
    # columns 0 and 1 are one prompt: row 1's own prompt (column 2) is second, not third
    np.testing.assert_allclose(reciprocal_ranks(L, np.array([0, 2]), np.array([0, 0, 1])), [1.0, 0.5])


def test_a_flat_row_has_the_null_reciprocal_rank_not_a_perfect_one():
    # No dependence at all: every prompt ties. The expected reciprocal rank of a random order, H_P / P.
    flat = np.zeros((3, 4))
    got = reciprocal_ranks(flat, np.array([0, 1, 3]), np.array([0, 1, 2, 3]))
    np.testing.assert_allclose(got, [(1 + 1 / 2 + 1 / 3 + 1 / 4) / 4] * 3)


def test_duplicate_rows_count_only_across_prompts():
    reasonings = [[1, 2], [1, 2], [3], [1, 2], [4]]
    prompts = np.array([0, 0, 1, 1, 2])
    assert duplicate_row_ratio(reasonings, prompts) == pytest.approx(3 / 5)  # [1, 2] under prompts 0 and 1
    assert duplicate_row_ratio([[1], [1], [2]], np.array([0, 0, 1])) == 0.0  # a group's own repeats


def test_duplicate_columns_are_the_share_of_columns_repeating_a_prompt():
    got = signals(np.zeros((4, 4)), [0, 1, 2, 3], signature=[0, 0, 0, 1])
    assert got["duplicate_column_ratio"] == 0.5


@pytest.mark.parametrize(("accuracy", "chance", "expected"), [(0.25, 0.25, 0.0), (1.0, 0.25, 1.0), (0.5, 1.0, 0.0)])
def test_chance_correction(accuracy, chance, expected):
    assert chance_corrected(accuracy, chance) == expected


def test_signals_do_not_depend_on_row_order():
    rng = np.random.default_rng(5)
    L, head = rng.normal(size=(8, 4)), rng.normal(size=(8, 4))
    cols = np.array([0, 1, 2, 3] * 2)
    base = signals(L, cols, L_head=head, permutations=0)
    for order in itertools.islice(itertools.permutations(range(8)), 1, 6):
        o = list(order)
        moved = signals(L[o], cols[o], reasonings=[[r] for r in o], L_head=head[o], permutations=0)
        for name, value in base.items():
            assert moved[name] == pytest.approx(value, abs=1e-12), name


def test_columns_of_one_prompt_give_no_chance_corrected_retrieval_to_read_as_a_collapse():
    """Chance is 1 when every column is the same prompt: there is nothing to retrieve, and a 0 would read as lost
    input dependence (TemplateCollapse fired on such batches)."""
    L = np.random.default_rng(1).normal(size=(4, 2))
    assert "retrieval_chance_corrected" not in signals(L, [0, 0, 1, 1], signature=[0, 0])
    assert "retrieval_chance_corrected" in signals(L, [0, 0, 1, 1], signature=[0, 1])


def null_batch(rng, signature, n_rows):
    """A batch with no input dependence: each row's scores per distinct prompt drawn alike whatever its own
    prompt (a row-level offset, as reasoning lengths give), identical prompts scoring identically."""
    n_prompts = max(signature) + 1
    per_prompt = rng.normal(0, 1, (n_rows, n_prompts)) + rng.normal(-3, 1, (n_rows, 1))
    L = per_prompt[:, signature]  # [R, N]: duplicate columns equal
    cols = rng.integers(0, len(signature), n_rows)
    return L, cols


@pytest.mark.parametrize(
    "signature",
    [[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1], [0, 0, 1, 2], [0, 0, 0, 0, 0, 1, 2]],
    ids=lambda s: "".join("ABCDEFGH"[i] for i in s),
)
def test_with_no_input_dependence_each_figure_sits_at_its_stated_chance(signature):
    """1,000 simulated batches without dependence, 2-8 prompts, with and without duplicate prompts: the
    retrieval figures at their chance (accuracy 1/P, the corrected and above-chance ones 0, MRR H_P / P) and
    MI over its permutation null at 0, within 4 standard errors of the simulation."""
    rng = np.random.default_rng(len(signature) * 10 + signature.count(0))
    n_prompts = max(signature) + 1
    draws: dict[str, list[float]] = {}
    for _ in range(1000):
        L, cols = null_batch(rng, signature, n_rows=12)
        got = signals(L, cols, signature, permutations=0)
        paper, _ = compute_diagnostics(
            L, L, cols, [[s] for s in signature], EmaState(), EstimatorConfig(bootstrap_samples=0)
        )
        for name in ("retrieval_chance_corrected", "retrieval_mrr", "mi_excess", "nearest_log_ratio"):
            draws.setdefault(name, []).append(got[name])
        for name in ("retrieval_accuracy", "retrieval_above_chance"):
            draws.setdefault(name, []).append(paper.metrics[name])
    expected = {
        "retrieval_accuracy": 1 / n_prompts,
        "retrieval_above_chance": 0.0,
        "retrieval_chance_corrected": 0.0,
        "nearest_log_ratio": 0.0,
        "retrieval_mrr": sum(1 / k for k in range(1, n_prompts + 1)) / n_prompts,
        "mi_excess": 0.0,
    }
    for name, values in draws.items():
        se = np.std(values) / math.sqrt(len(values))
        assert abs(np.mean(values) - expected[name]) < 4 * se + 1e-9, (name, np.mean(values), expected[name])


def test_sequence_mi_reaches_its_ceiling_with_duplicate_prompts():
    # Perfect dependence: each row scores 0 under its own prompt (all its columns), -1000 elsewhere.
    signature = np.array([0, 0, 0, 1])
    cols = np.array([0, 1, 2, 3, 3])
    L = np.where(signature[None, :] == signature[cols][:, None], 0.0, -1000.0)
    got = signals(L, cols, signature, permutations=0)
    assert got["mi_seq_normalized"] == pytest.approx(1.0, abs=1e-9)


def test_nearest_log_ratio_weighs_a_reasoning_against_the_prompts_most_like_its_own():
    # Two kinds of task, four prompts each: a kind's template tokens (100-102 or 200-202), then its content.
    prompts = [[100, 101, 102, c] for c in range(4)] + [[200, 201, 202, c] for c in range(10, 14)]
    cols = np.repeat(np.arange(8), 2)
    same_kind = (cols // 4)[:, None] == (np.arange(8) // 4)[None, :]  # [R, N]
    # Reasonings that kept their kind but lost their content: likelier under their own kind's prompts than the
    # other kind's by 8 nats, and under their own prompt by a hair (1e-3) more: top-1 retrieval is still perfect.
    L = np.where(same_kind, -1.0, -9.0)
    L[np.arange(16), cols] += 1e-3
    got = signals(L, cols, prompts=prompts, permutations=0)
    assert got["retrieval_chance_corrected"] == 1.0
    assert got["mi_seq_normalized"] == pytest.approx(1 / 3, abs=1e-3)  # ln 2 of ln 8: the kind alone
    assert got["nearest_log_ratio"] == pytest.approx(1e-3)  # against the same kind's prompts: the hair alone
    # With the content read (2 nats more under the own prompt), the ratio says so in nats, uncapped.
    L[np.arange(16), cols] += 2.0
    assert signals(L, cols, prompts=prompts, permutations=0)["nearest_log_ratio"] == pytest.approx(2.001)
