"""Estimators on hand-built matrices with known answers, and against a naive per-row oracle."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from scoring import estimators
from scoring.estimators import (
    PAPER_METRICS,
    EmaState,
    EstimatorConfig,
    MatrixError,
    bootstrap_intervals,
    compute_diagnostics,
    prompt_posterior,
    token_entropy_stats,
)

NO_BOOT = EstimatorConfig(bootstrap_samples=0)


def diagnose(L, cols, prompts=None, ema=None, config=NO_BOOT, L_seq=None):
    L = np.asarray(L, dtype=np.float64)
    ema = ema or EmaState()
    return compute_diagnostics(
        L, L if L_seq is None else np.asarray(L_seq, float), np.asarray(cols), prompts, ema, config
    )


def naive_metrics(L_tok, L_seq, cols, eps=1e-3):
    """RAGEN's definitions written out row by row with Python floats."""
    n_rows, n_cols = len(L_tok), len(L_tok[0])

    def stats(L):
        matched = [L[r][cols[r]] for r in range(n_rows)]
        marginal = [math.log(sum(math.exp(v) for v in L[r])) - math.log(n_cols) for r in range(n_rows)]
        return matched, marginal

    m, g = stats(L_tok)
    ms, gs = stats(L_seq)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    std = lambda xs: math.sqrt(mean([(x - mean(xs)) ** 2 for x in xs]))  # noqa: E731
    return {
        "mi_estimate": mean(m) - mean(g),
        "mi_seq_estimate": mean([a - b for a, b in zip(ms, gs, strict=True)]),
        "conditional_entropy_est": -mean(m),
        "reasoning_entropy_seq_est": -mean(gs),
        "marginal_std": std(g),
        "mi_zscore": mean([(a - b) / (std(g) + eps) for a, b in zip(m, g, strict=True)]),
        "retrieval_accuracy": mean(
            [float(max(range(n_cols), key=lambda j: (L_tok[r][j], -j)) == cols[r]) for r in range(n_rows)]
        ),
    }


def test_metric_names_are_exactly_ragens():
    diagnostics, _ = diagnose([[-1.0, -2.0], [-3.0, -1.0]], [0, 1])
    assert list(diagnostics.metrics) == list(PAPER_METRICS)
    assert len(PAPER_METRICS) == 29


@pytest.mark.parametrize("seed", range(5))
def test_estimators_match_a_row_by_row_oracle(seed):
    rng = np.random.default_rng(seed)
    n_rows, n_cols = 12, 4
    cols = rng.integers(0, n_cols, n_rows)
    L_seq = rng.normal(-40, 8, (n_rows, n_cols))
    L_tok = L_seq / rng.integers(1, 30, n_rows)[:, None]
    diagnostics, _ = diagnose(L_tok, cols, L_seq=L_seq)
    for name, expected in naive_metrics(L_tok.tolist(), L_seq.tolist(), cols.tolist()).items():
        assert diagnostics.metrics[name] == pytest.approx(expected, rel=1e-12, abs=1e-12), name


def test_identical_columns_carry_no_information_and_retrieval_sits_at_chance():
    row = [-2.0, -2.0, -2.0, -2.0]
    diagnostics, _ = diagnose([row] * 8, [0, 1, 2, 3] * 2)
    m = diagnostics.metrics
    assert m["mi_estimate"] == pytest.approx(0.0, abs=1e-12)
    assert m["mi_seq_estimate"] == pytest.approx(0.0, abs=1e-12)
    assert m["retrieval_chance_level"] == 0.25
    # Exact ties go to the first column: only rows of column 0 are "retrieved".
    assert m["retrieval_accuracy"] == 0.25
    assert m["retrieval_above_chance"] == pytest.approx(0.0)


def test_block_diagonal_matrix_gives_mi_near_ln_n():
    n = 6
    L = np.full((n, n), -1000.0)
    np.fill_diagonal(L, -1.0)
    m = diagnose(L, range(n))[0].metrics
    assert m["mi_estimate"] == pytest.approx(math.log(n), abs=1e-9)
    assert m["mi_upper_bound"] == pytest.approx(math.log(n))
    assert m["retrieval_accuracy"] == 1.0
    assert m["retrieval_accuracy@2"] == 1.0
    assert m["retrieval_chance_level@2"] == pytest.approx(2 / 6)
    assert m["retrieval_chance_level@8"] == 1.0  # k_eff = min(8, N) = 6


def test_mutual_information_is_reasoning_entropy_minus_conditional_entropy():
    rng = np.random.default_rng(7)
    L = rng.normal(-5, 2, (10, 5))
    m = diagnose(L, rng.integers(0, 5, 10))[0].metrics
    assert m["mi_estimate"] == pytest.approx(m["reasoning_entropy_est"] - m["conditional_entropy_est"], abs=1e-12)
    assert m["mi_seq_estimate"] == pytest.approx(
        m["reasoning_entropy_seq_est"] - m["conditional_entropy_seq_est"], abs=1e-12
    )


def test_duplicate_prompts_count_as_one_answer_and_in_n():
    # Columns 0 and 1 carry the same prompt; row 0 (column 1) peaks on column 0: still correct.
    L = [[-1.0, -1.5, -9.0], [-9.0, -9.0, -1.0], [-1.0, -1.0, -9.0]]
    prompts = [[5, 6], [5, 6], [7]]
    m = diagnose(L, [1, 2, 0], prompts)[0].metrics
    assert m["retrieval_accuracy"] == 1.0
    assert m["retrieval_chance_level"] == 0.5  # two distinct prompts, each as likely first with no dependence
    assert m["retrieval_chance_level@2"] == 1.0  # k_eff = min(2, P)
    assert m["mi_upper_bound"] == pytest.approx(math.log(3))  # duplicates counted in N
    without = diagnose(L, [1, 2, 0])[0].metrics
    assert without["retrieval_accuracy"] == pytest.approx(2 / 3)
    assert without["retrieval_chance_level"] == pytest.approx(1 / 3)


def test_a_single_column_yields_no_metrics_and_says_why():
    diagnostics, ema = diagnose([[-1.0], [-2.0]], [0, 0], ema=EmaState(0.5, 2.0))
    assert diagnostics.metrics == {}
    assert "fewer than two columns (N=1)" in diagnostics.skipped_reason
    assert ema == EmaState(0.5, 2.0)


def test_extreme_magnitudes_do_not_overflow():
    L = np.array([[-1e6, -1e6 - 3.0], [-2e6, -1e6]])
    m = diagnose(L, [0, 1])[0].metrics
    assert all(math.isfinite(v) for v in m.values())
    assert m["marginal_log_prob_mean"] == pytest.approx(
        np.mean([-1e6 + math.log1p(math.exp(-3.0)) - math.log(2), -1e6 - math.log(2)]), rel=1e-12
    )
    tiny = diagnose(np.array([[700.0, 0.0], [0.0, 710.0]]), [0, 1])[0].metrics
    assert math.isfinite(tiny["mi_estimate"])


def test_ema_starts_at_the_first_std_and_is_updated_before_use():
    rng = np.random.default_rng(3)
    config = EstimatorConfig(bootstrap_samples=0, ema_decay=0.9, std_eps=1e-3)
    ema, expected = EmaState(), None
    for _ in range(4):
        L = rng.normal(-5, 3, (6, 3))
        diagnostics, ema = diagnose(L, [0, 1, 2, 0, 1, 2], ema=ema, config=config)
        std = diagnostics.metrics["marginal_std"]
        expected = std if expected is None else 0.9 * expected + 0.1 * std
        assert diagnostics.metrics["marginal_std_ema"] == pytest.approx(expected, rel=1e-14)
        assert ema.marginal_std == pytest.approx(expected, rel=1e-14)
        mi = diagnostics.metrics["mi_estimate"]
        assert diagnostics.metrics["mi_zscore_ema"] == pytest.approx(mi / (expected + 1e-3), rel=1e-9)


def test_bootstrap_interval_is_seeded_and_brackets_the_estimate():
    rng = np.random.default_rng(11)
    L = rng.normal(-5, 1, (40, 4))
    L[np.arange(40), np.arange(40) % 4] += 2.0
    config = EstimatorConfig(bootstrap_samples=500, bootstrap_seed=4)
    a = diagnose(L, np.arange(40) % 4, config=config)[0]
    b = diagnose(L, np.arange(40) % 4, config=config)[0]
    assert a.intervals == b.intervals
    low, high = a.intervals["mi_estimate"]
    assert low < a.metrics["mi_estimate"] < high
    acc_low, acc_high = a.intervals["retrieval_accuracy"]
    assert 0 <= acc_low <= a.metrics["retrieval_accuracy"] <= acc_high <= 1
    other_seed = diagnose(L, np.arange(40) % 4, config=EstimatorConfig(bootstrap_samples=500, bootstrap_seed=5))[0]
    assert other_seed.intervals != a.intervals


def old_bootstrap_intervals(mi_terms, correct, config):
    """The implementation that drew all [B, R] indices at once (3.1 GB at R = 200,000): the oracle."""
    rng = np.random.default_rng(config.bootstrap_seed)
    idx = rng.integers(0, len(mi_terms), size=(config.bootstrap_samples, len(mi_terms)))
    tail = 100 * (1 - config.confidence) / 2
    intervals = {}
    for name, values in (("mi_estimate", mi_terms), ("retrieval_accuracy", correct.astype(np.float64))):
        low, high = np.percentile(values[idx].mean(axis=1), [tail, 100 - tail])
        intervals[name] = (float(low), float(high))
    return intervals


@pytest.mark.parametrize("chunk_cells", [1, 7, 1000, estimators.BOOTSTRAP_CHUNK_CELLS])
@pytest.mark.parametrize(("n_rows", "samples"), [(1, 50), (2, 1), (3, 1000), (37, 333), (5000, 100), (20_000, 40)])
def test_chunked_bootstrap_is_bit_identical_to_drawing_all_resamples_at_once(monkeypatch, chunk_cells, n_rows, samples):
    rng = np.random.default_rng(n_rows)
    mi_terms, correct = rng.normal(size=n_rows), rng.random(n_rows) < 0.4
    config = EstimatorConfig(bootstrap_samples=samples, bootstrap_seed=n_rows + samples)
    expected = old_bootstrap_intervals(mi_terms, correct, config)
    monkeypatch.setattr(estimators, "BOOTSTRAP_CHUNK_CELLS", chunk_cells)
    assert bootstrap_intervals(mi_terms, correct, config) == expected


def test_bootstrap_memory_does_not_grow_with_resamples_times_rows():
    n_rows, samples = 200_000, 200  # all at once: 320 MB of indices and 320 MB per gather
    rng = np.random.default_rng(0)
    mi_terms, correct = rng.normal(size=n_rows), rng.random(n_rows) < 0.5
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    try:
        bootstrap_intervals(mi_terms, correct, EstimatorConfig(bootstrap_samples=samples))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 80 * 2**20, f"peak {peak / 2**20:.0f} MiB"


def test_per_prompt_breakdown_shows_which_prompt_lost_input_dependence():
    # Column 0's rows are retrieved; column 1's rows prefer column 0 (lost dependence).
    L = [[-1.0, -5.0], [-1.0, -5.0], [-1.0, -3.0], [-2.0, -4.0]]
    diagnostics, _ = diagnose(L, [0, 0, 1, 1])
    c0, c1 = diagnostics.columns
    assert (c0.n_rows, c0.retrieval_rate, c1.retrieval_rate) == (2, 1.0, 0.0)
    assert c0.mi_term > 0 > c1.mi_term
    assert c0.matched_mean == -1.0
    assert c1.matched_mean == -3.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"L_seq": np.zeros((2, 3))}, r"L_seq must have the shape of L_tok \(2, 2\), got \(2, 3\)"),
        ({"cols": [0, 2]}, r"column_of_row values must lie in \[0, 1\]"),
        ({"L": [[0.0, np.nan], [0.0, 0.0]]}, r"L_tok\[0\]\[1\] must be a finite number, got nan"),
        ({"prompts": [[1]]}, r"column_prompt_tokens must list one prompt per column \(2\), got 1"),
    ],
)
def test_malformed_matrices_are_refused_naming_the_field(kwargs, message):
    args = {"L": [[0.0, -1.0], [-1.0, 0.0]], "cols": [0, 1], "prompts": None} | kwargs
    L_seq = kwargs.get("L_seq")
    with pytest.raises(MatrixError, match=message):
        diagnose(args["L"], args["cols"], args["prompts"], L_seq=L_seq)


def test_token_entropy_stats_weigh_tokens_for_the_mean_and_rows_for_percentiles():
    stats = token_entropy_stats([np.array([1.0, 1.0, 1.0, 1.0]), np.array([3.0]), np.array([])])
    assert stats["token_entropy_mean"] == pytest.approx(7 / 5)
    assert stats["token_entropy_p50"] == pytest.approx(2.0)
    assert stats["token_entropy_p10"] == pytest.approx(1.2)
    assert stats["token_entropy_p90"] == pytest.approx(2.8)
    assert token_entropy_stats([np.array([])]) == {}


def test_prompt_posterior_is_each_row_softmaxed_and_stable_for_long_reasoning():
    rng = np.random.default_rng(0)
    L = rng.normal(-3, 1, (6, 4))
    naive = np.exp(L) / np.exp(L).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(prompt_posterior(L), naive, rtol=1e-12)
    long = L * 400  # sequence log-probs of thousands of tokens: exp() underflows to 0 naively
    posterior = prompt_posterior(long)
    assert np.isfinite(posterior).all()
    np.testing.assert_allclose(posterior.sum(axis=1), 1.0)
    np.testing.assert_allclose(prompt_posterior(np.zeros((2, 5))), 0.2)
