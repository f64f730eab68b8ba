"""One scored step as the run page's heatmap shows it: the cross-scoring matrix and its per-prompt breakdown.

The stored result (a ``BatchResult`` dumped to JSON) is read into its typed parts here, once. Must not
import fastapi.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from scoring.estimators import prompt_posterior
from service.errors import NotFound
from service.reads.runs import require_run
from service.schemas.reads import MatrixResponse, PromptDetail
from service.schemas.results import SamplerResult, ScoredBy
from service.storage import matrices
from service.storage.tables import Batch, Run, ScoreMatrix


def step_matrix(session: Session, run: str, sampler: str | None, step: int | None) -> MatrixResponse:
    """The matrix of ``sampler`` (the run's first with one when None) at ``step`` (the newest when None), or 404."""
    found = _find(session, require_run(session, run), sampler, step)
    if found is None:
        at = f" at step {step}" if step is not None else ""
        raise NotFound(
            f"run {run!r} has no stored matrix{at} for sampler {sampler or 'any'}: steps off the "
            "schedule, failed batches, batches scored before matrices were stored and batches whose payload "
            "was purged (payload_retention_days) have none",
            field="step",
        )
    matrix, batch = found
    return _response(run, matrix, batch)


def sampler_result(result: dict[str, Any] | None, sampler: str) -> SamplerResult:
    """The stored result's figures of ``sampler``; empty ones when the batch has none for it."""
    return SamplerResult.model_validate(((result or {}).get("samplers") or {}).get(sampler) or {})


def scored_by(result: dict[str, Any] | None) -> ScoredBy | None:
    """What scored the batch; None for uploaded matrices and batches scored before it was kept."""
    found = (result or {}).get("scored_by")
    return ScoredBy.model_validate(found) if found is not None else None


def _find(session: Session, run: Run, sampler: str | None, step: int | None) -> tuple[ScoreMatrix, Batch] | None:
    if sampler is not None:
        return matrices.matrix_at(session, run.id, sampler, step)
    for candidate in run.samplers:
        found = matrices.matrix_at(session, run.id, candidate, step)
        if found is not None:
            return found
    return matrices.matrix_at(session, run.id, None, step)


def _response(run: str, matrix: ScoreMatrix, batch: Batch) -> MatrixResponse:
    L_tok = matrices.l_tok_of(matrix)  # [R, N]
    own = np.asarray(matrix.column_of_row, dtype=np.int64)
    order = np.argsort(own, kind="stable")  # rows grouped by their prompt, scoring order within
    figures = sampler_result(batch.result, matrix.sampler)
    # Cut when the batch was scored (service.jobs.reasoning.reasoning_excerpts); none for uploaded matrices and
    # for matrices stored before they were kept (reading them from the payload parsed up to 32 MB a poll).
    excerpts = matrix.excerpts or [[] for _ in range(matrix.n_columns)]
    per_prompt = [
        PromptDetail(
            **prompt.model_dump(),
            # H(Z|X) is minus the mean matched log-probability (as conditional_entropy_est), per prompt.
            conditional_entropy=-prompt.matched_mean,
            excerpts=excerpts[prompt.column],
        )
        for prompt in sorted(figures.per_prompt, key=lambda p: p.mi_term)
    ]
    grouped = L_tok[order]
    return MatrixResponse(
        run=run,
        step=matrix.step,
        sampler=matrix.sampler,
        batch_id=matrix.batch_id,
        rows=matrix.n_rows,
        columns=matrix.n_columns,
        column_group_ids=list(matrix.column_labels),
        row_columns=own[order].tolist(),
        row_sources=[matrix.row_sources[i] for i in order] if matrix.row_sources else None,
        L_tok=grouped.tolist(),
        row_normalized=prompt_posterior(grouped).tolist(),
        metrics=figures.metrics,
        per_prompt=per_prompt,
        scored_by=scored_by(batch.result),
    )
