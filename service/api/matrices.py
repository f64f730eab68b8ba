"""One scored step as the web page's heatmap shows it: the cross-scoring matrix and per-prompt breakdown."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import ReadsRun, State
from service.reads import matrix
from service.schemas.inputs import INT32_MAX
from service.schemas.reads import MatrixResponse

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
        return matrix.step_matrix(session, run, sampler, step)
