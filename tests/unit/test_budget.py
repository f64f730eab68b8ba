"""The scoring budget: a batch's predicted cost, the throughput model, the plan, and a step's share of it."""

from __future__ import annotations

import numpy as np
import pytest

from scoring import ScoringBatch, ScoringConfig, score_batch
from scoring.budget import (
    MIN_PLANNED_ROWS,
    MIN_PLANNED_WINDOW,
    BatchCost,
    Throughput,
    batch_cost,
    plan_batch,
    row_priority,
    subset,
)
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, matched_and_marginal
from scoring.window import fit_window
from service.jobs.budget import Budget, ScoringRates
from tests.conftest import VOCAB, random_batch, trajectory_batch

RATE = 1000.0  # tokens per second of the throughput the plans below are made with


def grouped_batch(n_groups: int = 4, per_group: int = 16, reasoning: int = 200, seed: int = 0) -> ScoringBatch:
    """``n_groups`` prompts sharing a 12-token head, ``per_group`` rows each of ``reasoning`` tokens."""
    rng = np.random.default_rng(seed)
    head = [int(t) for t in rng.integers(0, VOCAB, 12)]
    prompts = {g: head + [int(t) for t in rng.integers(0, VOCAB, 6)] for g in range(n_groups)}
    groups = [g for _ in range(per_group) for g in range(n_groups)]
    rng.shuffle(groups)
    reasonings = [[int(t) for t in rng.integers(0, VOCAB, reasoning)] for _ in groups]
    return ScoringBatch.from_rows([prompts[g] for g in groups], reasonings, groups)


def steady(length: float = 200.0) -> Throughput:
    return Throughput().observe(BatchCost(tokens=int(RATE), length=length), 1.0)


@pytest.mark.parametrize(
    "batch",
    [random_batch(0), random_batch(1, n_groups=1), trajectory_batch(2), fit_window(grouped_batch(), 40, None)[0]],
    ids=["shared-system-prompt", "one-prompt", "trajectory", "windowed"],
)
def test_the_predicted_token_count_is_the_kernels_own(llama64, batch):
    cross = score_batch(llama64, batch, ScoringConfig(model="test", dtype="float64", max_batch_tokens=512))
    assert batch_cost(batch).tokens == cross.tokens_processed


def test_the_cost_length_is_the_mean_sequence_of_the_scored_tokens():
    batch = ScoringBatch.from_rows([[1, 2], [3, 4, 5, 6]], [[7, 8, 9], [9]], [0, 1])
    cost = batch_cost(batch)
    # Prompts of 2 and 4 tokens (mean 3); one query of 2 tokens in a 3-token reasoning.
    assert cost.length == pytest.approx(3 + 3)
    assert cost.tokens == (2 + 4) + 2 * 2


def test_throughput_is_unknown_before_a_batch_and_weighs_batches_by_size():
    assert Throughput().predict_seconds(BatchCost(100, 50.0)) is None
    throughput = Throughput().observe(BatchCost(1000, 100.0), 1.0).observe(BatchCost(9000, 100.0), 3.0)
    # Decayed sums: (0.5 * 1000 + 9000) tokens in (0.5 * 1 + 3) seconds.
    assert throughput.tokens_per_second(100.0) == pytest.approx(9500 / 3.5)


def test_an_unmeasured_length_borrows_the_nearest_rate_conservatively():
    throughput = steady(length=200.0)  # bucket 256
    assert throughput.tokens_per_second(150.0) == RATE  # same bucket
    assert throughput.tokens_per_second(50.0) == RATE  # shorter: no faster than measured
    assert throughput.tokens_per_second(1000.0) == RATE / 4  # 1024 is 4x 256: cost grows at most in proportion


def test_no_budget_or_a_batch_within_it_is_scored_whole():
    batch = grouped_batch()
    for budget in (None, 1e9):
        plan, planned, cut = plan_batch(batch, steady(), budget, 512, None)
        assert plan.rows == tuple(range(batch.n_rows))
        assert planned is batch
        assert plan.is_within_budget
        assert plan.planned_rows_ratio == 1.0
        assert cut.rows_cut == 0


def test_over_budget_fewer_rows_are_scored_and_every_prompt_keeps_its_share():
    batch = grouped_batch(n_groups=4, per_group=16)
    full = batch_cost(batch).tokens / RATE
    plan, planned, _ = plan_batch(batch, steady(), full / 2, 512, None)
    assert plan.is_within_budget
    assert plan.predicted_seconds is not None
    assert plan.predicted_seconds <= full / 2
    assert MIN_PLANNED_ROWS <= len(plan.rows) < batch.n_rows
    # The largest row count within the budget: one more row would pass it.
    one_more = subset(batch, sorted(row_priority(batch)[: len(plan.rows) + 1]))
    assert batch_cost(one_more).tokens / RATE > full / 2
    assert planned.n_columns == batch.n_columns
    per_column = np.bincount(planned.column_of_row)
    assert per_column.max() - per_column.min() <= 1
    assert plan.max_reasoning_tokens == 512
    assert "rows to fit the budget" in plan.reason


def test_past_the_row_floor_the_window_shortens_then_the_floors_are_scored_and_said():
    batch = grouped_batch(n_groups=4, per_group=16, reasoning=300)
    at_floor = batch_cost(subset(batch, sorted(row_priority(batch)[:MIN_PLANNED_ROWS]))).tokens / RATE
    plan, planned, cut = plan_batch(batch, steady(length=300), at_floor / 2, 512, None)
    assert len(plan.rows) == MIN_PLANNED_ROWS
    assert plan.max_reasoning_tokens is not None
    assert MIN_PLANNED_WINDOW <= plan.max_reasoning_tokens < 300
    assert cut.max_reasoning_tokens == plan.max_reasoning_tokens
    assert max(len(z) for z in planned.reasonings) == plan.max_reasoning_tokens
    assert plan.is_within_budget

    floors, planned, _ = plan_batch(batch, steady(length=300), 0.001, 512, None)
    assert (len(floors.rows), floors.max_reasoning_tokens) == (MIN_PLANNED_ROWS, MIN_PLANNED_WINDOW)
    assert not floors.is_within_budget
    assert floors.reason.startswith("even the floors")
    assert planned.n_rows == MIN_PLANNED_ROWS


def test_the_row_floor_keeps_every_prompt_and_a_sampler_of_own_columns_goes_below_it():
    batch = grouped_batch(n_groups=20, per_group=2)
    plan, planned, _ = plan_batch(batch, steady(), 0.001, 512, None)
    assert len(plan.rows) == 20  # one row per prompt, more than MIN_PLANNED_ROWS
    assert planned.n_columns == 20
    draws = trajectory_batch(3, draws=40)
    plan, _, _ = plan_batch(draws, steady(), 0.0, 512, None, keeps_columns=False)
    assert len(plan.rows) == MIN_PLANNED_ROWS


def test_plans_are_deterministic_and_keep_rows_in_draw_order():
    batch = grouped_batch(seed=4)
    budget = batch_cost(batch).tokens / RATE / 3
    first, _, _ = plan_batch(batch, steady(), budget, 512, None)
    again, _, _ = plan_batch(batch, steady(), budget, 512, None)
    assert first == again
    assert list(first.rows) == sorted(first.rows)


def test_a_smaller_plan_reports_the_standard_error_of_the_rows_it_scored():
    rng = np.random.default_rng(0)
    n_rows, n_cols = 64, 4
    column_of_row = np.arange(n_rows) % n_cols
    L = rng.normal(-3.0, 1.0, (n_rows, n_cols))
    L[np.arange(n_rows), column_of_row] += 1.0  # input-dependent
    kept = np.arange(16)
    full, _ = compute_diagnostics(L, L, column_of_row, None, EmaState(), EstimatorConfig())
    small, _ = compute_diagnostics(L[kept], L[kept], column_of_row[kept], None, EmaState(), EstimatorConfig())
    # The error of a mean of the 16 rows scored (n = 16 in it), not of the 64 the sampler drew.
    matched, marginal = matched_and_marginal(L[kept], column_of_row[kept])
    terms = matched - marginal
    assert small.standard_errors["mi_estimate"] == pytest.approx(np.std(terms, ddof=1) / np.sqrt(16))
    assert small.standard_errors["mi_estimate"] > 1.2 * full.standard_errors["mi_estimate"]
    low, high = small.intervals["mi_estimate"]
    full_low, full_high = full.intervals["mi_estimate"]
    assert high - low > 1.2 * (full_high - full_low)


def test_a_step_budget_is_shared_by_predicted_seconds_and_passes_on_what_is_left(llama64):
    rates = ScoringRates()
    rates.observe(llama64.name, BatchCost(int(RATE), 100.0), 1.0)
    config = ScoringConfig(model="test", dtype="float64")
    small, large = grouped_batch(per_group=4, reasoning=60), grouped_batch(per_group=12, reasoning=60, seed=1)
    budget = Budget(10.0, rates, llama64, config, 256, 512)
    budget.start({"first_turn": small, "trajectory": large})
    assert budget.rate_source == "measured"
    throughput = rates.of(llama64.name)
    predicted = [throughput.predict_seconds(batch_cost(b)) or 0.0 for b in (small, large)]
    plan, planned, _ = budget.plan("first_turn", small, keeps_columns=True)
    assert plan.budget_seconds == pytest.approx(10.0 * predicted[0] / sum(predicted))
    budget.spent(planned, batch_cost(planned).tokens, 4.0)  # slower than predicted
    plan, _, _ = budget.plan("trajectory", large, keeps_columns=False)
    assert plan.budget_seconds == pytest.approx(6.0)  # the last sampler gets what is left


def test_the_first_budgeted_step_of_a_scorer_times_a_warm_up_and_an_unbudgeted_one_does_not(llama64):
    config = ScoringConfig(model="test", dtype="float64")
    batch = grouped_batch(per_group=4, reasoning=60)
    unbudgeted = Budget(None, ScoringRates(), llama64, config, 256, 512)
    unbudgeted.start({"first_turn": batch})
    assert unbudgeted.rate_source == "none"
    assert unbudgeted.rates.of(llama64.name).is_empty
    budgeted = Budget(10.0, ScoringRates(), llama64, config, 256, 512)
    budgeted.start({"first_turn": batch})
    assert budgeted.rate_source == "warm-up"
    assert not budgeted.rates.of(llama64.name).is_empty
    assert budgeted.left is not None
    assert budgeted.left < 10.0  # the warm-up's seconds count against the step
