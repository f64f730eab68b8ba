"""What the pages and the read API return: series, latest values, the overview, the catalogue, a matrix."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    Field,
)

from service.schemas.inputs import RunMetadata
from service.schemas.results import PromptBreakdown, ScoredBy


class MetricPointOut(BaseModel):
    step: int
    segment: int = Field(description="The run's segment: 0, then one more at every resume (a step going back).")
    sampler: str
    name: str
    value: float
    scorer: str | None
    checkpoint: str | None
    time: str


class MetricSeries(BaseModel):
    run: str
    points: list[MetricPointOut]


# Web page reads ----------------------------------------------------------------------------------


class LatestValue(BaseModel):
    value: float
    step: int


class Sparkline(BaseModel):
    """The newest scored steps of the run's main sampler; values line up with ``steps`` (null: none)."""

    steps: list[int]
    mi_estimate: list[float | None]
    retrieval_accuracy: list[float | None]
    retrieval_chance_level: list[float | None]


class RunOverview(BaseModel):
    name: str
    project: str | None
    metadata: RunMetadata
    scorer: str
    scorer_mode: str
    score_every: int
    created_at: str
    status: Literal["healthy", "pending", "firing", "waiting"] = Field(
        description="firing: an alert fires; pending: an alert condition holds, not yet long enough to fire; "
        "healthy: neither; waiting: no scored step yet."
    )
    alerts: dict[str, int] = Field(description="Active alert episodes: pending and firing counts.")
    last_step: int | None
    last_batch_at: str | None = Field(description="When the newest batch was accepted (ISO 8601, UTC).")
    batches: dict[str, int] = Field(description="Batches per status.")
    samplers: list[str] = Field(description="Samplers with stored figures, the run's own order first.")
    sampler: str | None = Field(description="The main sampler: the first of ``samplers``.")
    latest: dict[str, LatestValue] = Field(description="Newest MI and retrieval figures of the main sampler.")
    sparkline: Sparkline | None


class OverviewResponse(BaseModel):
    runs: list[RunOverview]


class CatalogueEntry(BaseModel):
    stored: str = Field(description="Name in /v1/runs/{run}/metrics.")
    prometheus: str = Field(description="Gauge name in /metrics, labelled run and sampler.")
    help: str


class CatalogueResponse(BaseModel):
    metrics: list[CatalogueEntry]


class PromptDetail(PromptBreakdown):
    """A prompt of one scored step as the run page lists it: its breakdown, H(Z|X) and reasoning excerpts."""

    conditional_entropy: float = Field(description="H(Z|X) of the prompt: -matched_mean, nats per token.")
    excerpts: list[str] = Field(description="The first reasoning texts of the prompt's rows (none for matrices).")


class MatrixResponse(BaseModel):
    """One scored step of one sampler: its cross-scoring matrix and per-prompt breakdown."""

    run: str
    step: int
    sampler: str
    batch_id: str
    rows: int
    columns: int
    column_group_ids: list[int] = Field(description="[N] the prompt group id of each column.")
    row_columns: list[int] = Field(description="[R] each row's own column; rows are grouped by it, in column order.")
    row_sources: list[list[int]] | None = Field(description="[R] (trajectory, turn) each row came from.")
    L_tok: list[list[float]] = Field(
        description="[R, N] log p(z_i | x_j) per reasoning token (nats), stored as float32."
    )
    row_normalized: list[list[float]] = Field(
        description="[R, N] p(x_j | z_i): each row of L_tok softmaxed (uniform prior over the prompts)."
    )
    metrics: dict[str, float] = Field(description="The step's diagnostics for this sampler.")
    per_prompt: list[PromptDetail] = Field(description="Worst first: ascending MI term.")
    scored_by: ScoredBy | None = Field(
        None, description="What scored the step (engine, model, dtype); null for uploaded matrices and older batches."
    )
