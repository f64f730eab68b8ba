"""A scored step's budget: the worker's measured throughput of its scorers, and each sampler's share and plan.

The pure parts (a batch's cost, the throughput model, the plan) live in ``scoring.budget``; this
module keeps the throughput of every scorer in the worker process (``ScoringRates``, learned from
every scored batch), times a warm-up batch before a scorer's first budgeted step, and splits a step's
budget between its samplers (``Budget``). Must not import fastapi or touch the database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from scoring.batch import ScoringBatch
from scoring.budget import BatchCost, CostModel, Plan, Throughput, plan_batch
from scoring.config import ScoringConfig
from scoring.window import WindowCut, fit_window
from service.jobs.vllm import AnyScorer, cost_model, score_with
from service.schemas.results import PlanResult

# The warm-up batch: prompts x rows of the step's mean lengths, ~5k tokens at a 512-token window
# (~2 s of SmolLM2 on 2 cores). Its prompts share no prefix and its forwards are small, so it runs
# below a real step's tokens per second: a conservative prior, replaced by the first real batches.
WARMUP_PROMPTS = 2
WARMUP_ROWS = 4


class ScoringRates:
    """Each scorer's kernel throughput (``scoring.budget.Throughput``) in this process, learned from every
    batch it scored; keyed by ``Scorer.name`` and kept when the pool evicts the scorer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_scorer: dict[str, Throughput] = {}

    def of(self, scorer: str) -> Throughput:
        with self._lock:
            return self._by_scorer.get(scorer, Throughput())

    def observe(self, scorer: str, cost: BatchCost, seconds: float) -> None:
        with self._lock:
            self._by_scorer[scorer] = self._by_scorer.get(scorer, Throughput()).observe(cost, seconds)


@dataclass
class Budget:
    """One scheduled step's budget, shared by its samplers in proportion to their predicted seconds.

    Each sampler gets ``left * predicted_s / sum of the predicted seconds of the samplers still to
    score``, where ``left`` is the step's budget less the seconds already spent (a warm-up included),
    so a sampler that took less or more than predicted passes the difference on to the next.
    """

    seconds: float | None
    rates: ScoringRates
    scorer: AnyScorer
    config: ScoringConfig
    max_positions: int
    max_reasoning_tokens: int | None
    check: Callable[[], None] | None = None
    cost_of: CostModel = field(init=False)
    left: float | None = field(init=False)
    rate_source: Literal["measured", "warm-up", "none"] = field(init=False)
    _full: dict[str, float] = field(init=False, default_factory=dict)  # sampler still to score -> predicted seconds

    def __post_init__(self) -> None:
        self.cost_of = cost_model(self.scorer)  # the kernel's shared prefixes, or vLLM's every pair whole
        self.left = self.seconds
        self.rate_source = "none" if self.rates.of(self.scorer.name).is_empty else "measured"

    def start(self, batches: Mapping[str, ScoringBatch]) -> None:
        """Predicts every sampler's whole batch, after a warm-up when a budget applies and nothing was measured."""
        if not batches:
            return
        if self.seconds is not None and self.rate_source == "none":
            self._warm_up(next(iter(batches.values())))
            self.rate_source = "warm-up"
        throughput = self.rates.of(self.scorer.name)
        for sampler, batch in batches.items():
            fitted, _ = fit_window(batch, self.max_reasoning_tokens, self.max_positions)
            self._full[sampler] = throughput.predict_seconds(self.cost_of(fitted)) or 0.0

    def plan(self, sampler: str, batch: ScoringBatch, *, keeps_columns: bool) -> tuple[Plan, ScoringBatch, WindowCut]:
        """The sampler's plan within its share of what is left of the budget (``scoring.budget.plan_batch``)."""
        share = None
        if self.left is not None:
            total = sum(self._full.values())
            fraction = self._full.get(sampler, 0.0) / total if total > 0 else 1 / max(len(self._full), 1)
            share = max(self.left, 0.0) * fraction
        self._full.pop(sampler, None)
        return plan_batch(
            batch,
            self.rates.of(self.scorer.name),
            share,
            self.max_reasoning_tokens,
            self.max_positions,
            keeps_columns=keeps_columns,
            cost_of=self.cost_of,
        )

    def spent(self, batch: ScoringBatch, tokens: int, seconds: float) -> None:
        """Learns from a scored batch and takes its seconds off what is left."""
        self.rates.observe(self.scorer.name, BatchCost(tokens, self.cost_of(batch).length), seconds)
        if self.left is not None:
            self.left -= seconds

    def result(self, plan: Plan, seconds: float, tokens: int, max_reasoning_tokens: int | None) -> PlanResult:
        return PlanResult(
            budget_seconds=plan.budget_seconds,
            predicted_seconds=plan.predicted_seconds,
            seconds=seconds,
            rows=len(plan.rows),
            rows_available=plan.rows_available,
            max_reasoning_tokens=max_reasoning_tokens,
            predicted_tokens=plan.predicted_tokens,
            tokens=tokens,
            is_within_budget=plan.is_within_budget,
            rate_source=self.rate_source,
            reason=plan.reason,
        )

    def _warm_up(self, batch: ScoringBatch) -> None:
        """Times a small batch of ``batch``'s mean prompt and reasoning lengths: the prior of the first plan."""
        fitted, _ = fit_window(batch, self.max_reasoning_tokens, self.max_positions)
        prompt = max(1, round(sum(map(len, fitted.column_prompts)) / fitted.n_columns))
        reasoning = max(2, round(sum(map(len, fitted.reasonings)) / fitted.n_rows))
        vocab = self.scorer.vocab_size
        prompts = [[(7 * i + 1 + u) % vocab for i in range(prompt)] for u in range(WARMUP_PROMPTS)]
        rows = [u % WARMUP_PROMPTS for u in range(WARMUP_ROWS)]
        warm, _ = fit_window(
            ScoringBatch.from_rows(
                [prompts[u] for u in rows],
                [[(11 * i + 3 + r) % vocab for i in range(reasoning)] for r in range(WARMUP_ROWS)],
                rows,
            ),
            None,
            self.max_positions,
        )
        started = time.perf_counter()
        cross = score_with(self.scorer, warm, self.config, self.check)
        seconds = time.perf_counter() - started
        self.spent(warm, cross.tokens_processed, seconds)
