"""Scoring an accepted rollouts batch: reward and coverage figures, then each sampler's diagnostics.

Pure computation on a snapshot of the run and the payload (the kernel runs here, so this module
loads torch): everything the batch writes comes back as one ``ScoredBatch``, which
``service.jobs.recording`` writes. Must not import fastapi or touch the database.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from scoring.budget import Plan, subset
from scoring.cross_scores import CrossScores
from scoring.dependence import scored_signals
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, token_entropy_stats
from scoring.logprob_gap import LOGPROB_GAP, logprob_gap
from scoring.partition import Extraction, turn_token_ids
from scoring.samplers import SampledRows, Trajectory, Turn, draw_samplers
from scoring.window import sequence_limit
from service.errors import InvalidRequest
from service.jobs.budget import Budget, ScoringRates
from service.jobs.reasoning import group_extractions, reasoning_excerpts, reasoning_summary
from service.jobs.recording import ScoredBatch
from service.jobs.reward_figures import batch_figures
from service.jobs.vllm import AnyScorer, score_with, scored_by
from service.schemas.inputs import BatchIn
from service.settings import Settings
from service.snapshot import RunSnapshot, is_scheduled, step_budget
from service.storage.matrices import MatrixRecord
from service.storage.points import Point


def score_rollouts(
    payload: BatchIn,
    run: RunSnapshot,
    emas: dict[str, EmaState],
    get_scorer: Callable[[], AnyScorer],
    settings: Settings,
    check: Callable[[], None] | None = None,
    rates: ScoringRates | None = None,
) -> ScoredBatch:
    """Reward/SNR and coverage figures for every batch; cross-scoring diagnostics on scheduled steps.

    ``check`` goes to the kernel, which calls it between layers (the worker's time limit and shutdown).
    ``rates`` is the worker's measured throughput of its scorers: each sampler is planned within the step's
    scoring budget from it (``service.jobs.budget``), and every scored batch adds to it.

    A scheduled step counts as scored only when some sampler produced metrics: a batch whose
    turns carry no reasoning says so in ``skipped_reason`` instead.
    """
    scored = batch_figures(payload, run, reasoning_summary(payload, run.reasoning_extraction))
    scheduled = is_scheduled(payload.step, run.score_every)
    if not scheduled:
        return scored
    scorer = get_scorer()
    config = settings.scoring_config(scorer.name, run.temperature)
    trajectories = tokenized(payload, scorer, run.reasoning_extraction)
    scored.scorer = run.scorer
    scored.result.scored_by = scored_by(scorer)
    rates = rates or ScoringRates()
    limit = sequence_limit(scorer.max_positions, config.max_batch_tokens)
    drawn = draw_samplers(run.samplers, trajectories, run.num_samples, seed=[run.seed, payload.step])
    budget = Budget(
        step_budget(run, settings.scoring_budget_seconds),
        rates,
        scorer,
        config,
        limit,
        settings.reasoning_window,
        check,
    )
    budget.start({sampler: rows.batch for sampler, rows in drawn.items() if rows is not None})
    for index, (sampler, drawn_rows) in enumerate(drawn.items()):
        if drawn_rows is None:
            scored.skip_sampler(sampler, "no turn carries reasoning to score")
            continue
        plan, batch, cut = budget.plan(sampler, drawn_rows.batch, keeps_columns=sampler == "first_turn")
        rows = _planned_rows(drawn_rows, plan)
        started = time.perf_counter()
        cross = score_with(scorer, batch, config, check)
        seconds = time.perf_counter() - started
        budget.spent(batch, cross.tokens_processed, seconds)
        scored.tokens += cross.tokens_processed
        labels = _column_labels(sampler, rows.batch.column_group_ids, rows.batch.column_of_row, rows.sources, payload)
        diagnostics, ema = compute_diagnostics(
            cross.L_tok,
            cross.L_seq,
            batch.column_of_row,
            batch.column_prompts,  # prompts that windowing made identical count as one answer
            emas.get(sampler, EmaState()),
            EstimatorConfig(bootstrap_seed=run.seed + index),
            labels,
        )
        figures = {
            **token_entropy_stats(cross.token_entropy),
            **scored_signals(cross, batch, diagnostics, settings.head_tokens, seed=run.seed + index),
            **trainer_gap(payload, rows.sources, cross),
        }
        excerpts = reasoning_excerpts(
            payload, rows.sources, rows.batch.column_of_row, cross.L_tok.shape[1], run.reasoning_extraction
        )
        matrix = MatrixRecord(sampler, cross.L_tok, rows.batch.column_of_row, labels, rows.sources, excerpts)
        scored.add_sampler(sampler, diagnostics, ema, matrix, figures, cut)
        result = (scored.result.samplers or {})[sampler]
        result.plan = budget.result(plan, seconds, cross.tokens_processed, cut.max_reasoning_tokens)
        scored.points.append(Point(sampler, "planned_rows_ratio", plan.planned_rows_ratio))
    samplers = scored.result.samplers or {}
    scored.result.scored = any(result.metrics for result in samplers.values())
    if not scored.result.scored:
        reasons = sorted({result.skipped_reason for result in samplers.values() if result.skipped_reason})
        scored.result.skipped_reason = "; ".join(reasons) or "no sampler produced metrics"
    return scored


def tokenized(payload: BatchIn, scorer: AnyScorer, extraction: Extraction = "think_tags") -> list[Trajectory]:
    """The batch's trajectories as token ids under ``scorer``'s tokenizer; 400 for what it cannot encode."""
    per_group = group_extractions(payload, extraction)
    trajectories = []
    for t, trajectory in enumerate(payload.trajectories):
        turns = []
        for k, turn in enumerate(trajectory.turns):
            if scorer.tokenizer is None and (turn.prompt is not None or turn.reasoning_token_ids is None):
                raise InvalidRequest(
                    f"scorer {scorer.name!r} has no tokenizer: send prompt_token_ids and reasoning_token_ids",
                    field=f"trajectories[{t}].turns[{k}]",
                    index=t,
                )
            x, z = turn_token_ids(
                scorer.encode,
                prompt=turn.prompt,
                prompt_ids=turn.prompt_token_ids,
                response=turn.response,
                reasoning=turn.reasoning,
                reasoning_ids=turn.reasoning_token_ids,
                extraction=per_group[trajectory.group_id],
            )
            if not x:
                raise InvalidRequest(
                    "the prompt must produce at least 1 token, got 0",
                    field=f"trajectories[{t}].turns[{k}].prompt",
                    index=t,
                )
            turns.append(Turn(prompt_ids=x, reasoning_ids=z))
        trajectories.append(Trajectory(group_id=trajectory.group_id, turns=tuple(turns)))
    return trajectories


def trainer_gap(payload: BatchIn, sources: Sequence[tuple[int, int]], cross: CrossScores) -> dict[str, float]:
    """``trainer_scorer_logprob_gap`` over the sampler's rows whose turns sent ``reasoning_logprobs``: each
    (trajectory, turn) once (the trajectory sampler draws with replacement), over the tokens the scorer
    scored (a reasoning window keeps a reasoning's first tokens); empty when no turn sent any."""
    trainer, scorer = [], []
    seen = set()
    for r, (m, k) in enumerate(sources):
        logprobs = payload.trajectories[m].turns[k].reasoning_logprobs
        if logprobs is None or (m, k) in seen:
            continue
        seen.add((m, k))
        trainer.append(np.asarray(logprobs, dtype=np.float64))
        scorer.append(cross.matched_logprobs[r])
    gap = logprob_gap(trainer, scorer)
    return {} if gap is None else {LOGPROB_GAP: gap}


def _planned_rows(rows: SampledRows, plan: Plan) -> SampledRows:
    """The sampled rows the plan keeps, with their sources."""
    if len(plan.rows) == rows.batch.n_rows:
        return rows
    return SampledRows(batch=subset(rows.batch, plan.rows), sources=tuple(rows.sources[r] for r in plan.rows))


def _column_labels(
    sampler: str,
    column_group_ids: tuple[int, ...],
    column_of_row: tuple[int, ...],
    sources: tuple[tuple[int, int], ...],
    payload: BatchIn,
) -> list[int]:
    """Breakdown labels: the prompt's group id (trajectory draws are columns of their own; a per-turn column is
    labelled with the group of its first row)."""
    if sampler == "first_turn":
        return list(column_group_ids)
    if sampler == "trajectory":
        return [payload.trajectories[m].group_id for m, _ in sources]
    first_row: dict[int, int] = {}
    for (m, _), column in zip(sources, column_of_row, strict=True):
        first_row.setdefault(column, payload.trajectories[m].group_id)
    return [first_row[c] for c in range(len(column_group_ids))]
