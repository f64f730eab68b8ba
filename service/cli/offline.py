"""Offline tools: metrics, filter and score read a file (or stdin), print one JSON document; no server, no database."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from scoring.config import ScoringConfig
from service.cli.flags import UsageError, format_validation_error
from service.schemas.inputs import FilterRequest, FilterResponse, InputError, MatrixInput, MatrixSteps, ScoreRowIn
from service.schemas.results import SamplerResult

SCORING = ScoringConfig()  # the scoring defaults the `score` flags show


M = TypeVar("M", bound=BaseModel)


T = TypeVar("T")


def _read(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise UsageError(f"--input: cannot read {path!r}: {e.strerror}") from e


def _parse_json(text: str, where: str = "input") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e


def _validate(model: type[M], data: Any, where: str = "") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise UsageError(f"{where}{format_validation_error(e)}") from e


def _guard(action: Callable[[], T], prefix: str = "") -> T:
    """Turns the scoring package's input errors into one-line usage errors."""
    try:
        return action()
    except InputError as e:
        raise UsageError(f"{prefix}{e}") from e
    except ValueError as e:  # BatchError, MatrixError, ScoringError, ModelLoadError are ValueErrors
        raise UsageError(f"{prefix}{e}") from e


def run_metrics(args: argparse.Namespace) -> Any:
    from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics

    data = _parse_json(_read(args.input))
    steps = _validate(MatrixSteps, data).steps if isinstance(data, dict) and "steps" in data else None
    inputs = steps if steps is not None else [_validate(MatrixInput, data)]
    ema = EmaState()
    results = []
    for i, step in enumerate(inputs):
        prefix = f"steps[{i}]." if steps is not None else ""
        L_tok, L_seq, cols = _guard(step.arrays, prefix)
        config = EstimatorConfig(std_eps=step.config.std_eps, ema_decay=step.config.ema_decay, bootstrap_samples=0)
        diagnostics, ema = compute_diagnostics(L_tok, L_seq, cols, step.column_prompt_tokens, ema, config)
        if diagnostics.skipped_reason:
            print(f"note: {prefix}{diagnostics.skipped_reason}", file=sys.stderr)
        results.append(diagnostics.metrics)
    return results if steps is not None else results[0]


def run_filter(args: argparse.Namespace) -> Any:
    from scoring.snr_filter import filter_groups

    request = _validate(FilterRequest, _parse_json(_read(args.input)))
    response = FilterResponse(**vars(filter_groups(request.rewards, request.filter_config())))
    return TypeAdapter(FilterResponse).dump_python(response, mode="json")


def run_score(args: argparse.Namespace) -> Any:
    from scoring import ScoringBatch, load_scorer, score_batch
    from scoring.dependence import DEFAULT_HEAD_TOKENS, scored_signals
    from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, token_entropy_stats
    from scoring.window import fit_window, sequence_limit

    rows = []
    for number, line in enumerate(_read(args.input).splitlines(), start=1):
        if line.strip():
            rows.append((number, _validate(ScoreRowIn, _parse_json(line, f"line {number}"), f"line {number}: ")))
    if not rows:
        raise UsageError("--input: no rows (expected one JSON object per line)")
    config: ScoringConfig = _guard(
        lambda: ScoringConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            temperature=args.temperature,
            max_batch_tokens=args.max_batch_tokens,
            head_tokens=(DEFAULT_HEAD_TOKENS,),
        ),
        "--",
    )
    scorer = _guard(lambda: load_scorer(config, args.cache_dir), "--model: ")
    kept, prompts, reasonings, groups, dropped = [], [], [], [], []
    for number, row in rows:
        x, z = _guard(partial(_turn_ids, scorer.encode, row), f"line {number}: ")
        if not z:
            dropped.append(number)  # RAGEN never scores empty reasoning
            continue
        kept.append(number)
        prompts.append(x)
        reasonings.append(z)
        groups.append(row.group_id)
    if not kept:
        raise UsageError("--input: every row has empty reasoning; nothing to score")
    window = args.max_reasoning_tokens or None
    positions = sequence_limit(scorer.max_positions, config.max_batch_tokens)
    whole = _guard(lambda: ScoringBatch.from_rows(prompts, reasonings, groups))
    batch, cut = _guard(lambda: fit_window(whole, window, positions), "--max-reasoning-tokens: ")
    scores = _guard(lambda: score_batch(scorer, batch, config))
    diagnostics, _ = compute_diagnostics(
        scores.L_tok,
        scores.L_seq,
        batch.column_of_row,
        batch.column_prompts,
        EmaState(),
        EstimatorConfig(),
        batch.column_group_ids,
    )
    figures = {
        **token_entropy_stats(scores.token_entropy),
        **scored_signals(scores, batch, diagnostics, DEFAULT_HEAD_TOKENS),
    }
    result = SamplerResult.of(diagnostics, batch.n_rows, batch.n_columns, figures, cut)
    return {
        "model": args.model,
        **result.model_dump(mode="json"),
        "line_of_row": kept,
        "dropped_empty_reasoning_lines": dropped,
        "column_group_ids": list(batch.column_group_ids),
        "reasoning_lengths": scores.reasoning_lengths.tolist(),
        "L_seq": scores.L_seq.tolist(),
        "L_tok": scores.L_tok.tolist(),
    }


def _turn_ids(encode: Callable[[str], tuple[int, ...]], row: ScoreRowIn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from scoring.partition import turn_token_ids

    return turn_token_ids(
        encode,
        prompt=row.prompt,
        prompt_ids=row.prompt_token_ids,
        response=row.response,
        reasoning=row.reasoning,
        reasoning_ids=row.reasoning_token_ids,
    )
