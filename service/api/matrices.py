"""One scored step as the web page's heatmap shows it: the cross-scoring matrix and per-prompt breakdown."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Query

from scoring.estimators import prompt_posterior
from service.api.deps import ReadsRun, State
from service.errors import NotFound
from service.ingest.runs import require_run
from service.schemas.inputs import INT32_MAX
from service.schemas.reads import MatrixResponse, PromptDetail
from service.storage import matrices
from service.storage.tables import Batch, Run, ScoreMatrix

router = APIRouter(tags=["runs"])

SamplerQuery = Annotated[
    str | None, Query(max_length=32, description="The sampler; the run's first with a stored matrix.")
]
StepQuery = Annotated[int | None, Query(ge=0, le=INT32_MAX, description="A scored step; the newest when absent.")]


@router.get(
    "/v1/runs/{run}/matrix",
    responses={404: {"description": "Unknown run, or no matrix at that step"}},
    dependencies=[ReadsRun],
)
def step_matrix(state: State, run: str, sampler: SamplerQuery = None, step: StepQuery = None) -> MatrixResponse:
    """The cross-scoring matrix of one scored step, rows grouped by prompt, with the per-prompt breakdown."""
    with state.sessions() as session:
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


def _find(session: Any, run: Run, sampler: str | None, step: int | None) -> tuple[ScoreMatrix, Batch] | None:
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
    result = (batch.result or {}).get("samplers", {}).get(matrix.sampler, {})
    # Cut when the batch was scored (service.jobs.reasoning.reasoning_excerpts); none for uploaded matrices and
    # for matrices stored before they were kept (reading them from the payload parsed up to 32 MB a poll).
    excerpts = matrix.excerpts or [[] for _ in range(matrix.n_columns)]
    per_prompt = [
        PromptDetail(
            **c,
            # H(Z|X) is minus the mean matched log-probability (as conditional_entropy_est), per prompt.
            conditional_entropy=-c["matched_mean"],
            excerpts=excerpts[c["column"]],
        )
        for c in sorted(result.get("per_prompt", []), key=lambda c: c["mi_term"])
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
        metrics=result.get("metrics", {}),
        per_prompt=per_prompt,
        scored_by=(batch.result or {}).get("scored_by"),
    )
