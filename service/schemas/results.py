"""A batch's results as stored and answered: per sampler, its rewards, its reasoning, and its status."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from scoring.estimators import ColumnBreakdown, Diagnostics
from scoring.partition import Extraction
from scoring.window import WindowCut
from service.schemas.inputs import BatchAccepted, BatchKind, BatchState
from service.schemas.rows import IsoTime

# Results ------------------------------------------------------------------------------------------


class PromptBreakdown(BaseModel):
    """One prompt (column) of a scored batch: did its own reasoning still depend on it?"""

    column: int
    group_id: int
    n_rows: int
    matched_mean: float = Field(description="Mean per-token log p(z | own prompt) of the column's rows (nats).")
    mi_term: float = Field(description="Mean of matched - marginal over the column's rows (nats per token).")
    retrieval_rate: float = Field(description="Share of the column's rows whose own prompt scores highest.")
    lost_input_dependence: bool = Field(
        False,
        description="Fewer than half of the column's rows retrieve it and its MI term is below half the median of "
        "the retrieved columns (every column when none is retrieved): this prompt's reasoning no longer depends on it.",
    )

    @classmethod
    def of(cls, column: ColumnBreakdown) -> PromptBreakdown:
        return cls.model_validate(vars(column))


class WindowResult(BaseModel):
    """What of the sampled (prompt, reasoning) pairs was scored: reasonings keep their opening, prompts their tail."""

    max_reasoning_tokens: int | None = Field(
        description="Reasoning tokens scored per row at most (the setting, narrowed to the scorer's context)."
    )
    truncated_reasoning_ratio: float = Field(description="Share of the scored rows whose reasoning was cut.")
    reasoning_tokens_cut: int = Field(description="Reasoning tokens not scored, over all rows.")
    prompt_tokens_cut: int = Field(description="Prompt tokens cut from the head of the distinct prompts.")
    merged_columns: int = Field(description="Prompts that became identical to another once their head was cut.")


class PlanResult(BaseModel):
    """What the worker planned to score of one sampler's rows within the step's budget, and what it took."""

    budget_seconds: float | None = Field(description="Kernel seconds allotted to this sampler; null: no budget.")
    predicted_seconds: float | None = Field(
        description="The scorer's measured throughput's prediction for the planned rows; null before any measurement."
    )
    seconds: float = Field(description="Kernel seconds the planned rows took.")
    rows: int = Field(description="Rows scored.")
    rows_available: int = Field(description="Rows the sampler drew (sampler.num_samples, or every usable row).")
    max_reasoning_tokens: int | None = Field(description="Reasoning window planned (null: whole reasonings).")
    predicted_tokens: int = Field(description="Tokens the kernel was predicted to run.")
    tokens: int = Field(description="Tokens the kernel ran.")
    is_within_budget: bool = Field(description="False when even the floors were predicted past the budget.")
    rate_source: Literal["measured", "warm-up", "none"] = Field(
        description="Where the prediction came from: batches this worker scored before, a warm-up batch timed "
        "before this step (the first of its scorer in this process), or none (no budget, nothing measured yet)."
    )
    reason: str = Field(description="What was cut and why.")


class SamplerResult(BaseModel):
    """What one sampler's cross-scoring of a batch says (``skipped_reason`` set when it scored nothing)."""

    rows: int = 0
    columns: int = 0
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="RAGEN metric names, token entropies and the length-robust dependence signals (docs/scoring.md).",
    )
    intervals: dict[str, tuple[float, float]] = Field(default_factory=dict, description="95% bootstrap intervals.")
    per_prompt: list[PromptBreakdown] = Field(default_factory=list)
    lost_group_ids: list[int] = Field(
        default_factory=list, description="Group ids of the prompts that lost input dependence (per_prompt)."
    )
    skipped_reason: str | None = None
    window: WindowResult | None = Field(None, description="What the reasoning window and the context cut.")
    plan: PlanResult | None = Field(None, description="What the scoring budget planned (rows, window) and why.")

    @classmethod
    def of(
        cls,
        diagnostics: Diagnostics,
        rows: int,
        columns: int,
        figures: dict[str, float],
        cut: WindowCut | None = None,
    ) -> SamplerResult:
        return cls(
            rows=rows,
            columns=columns,
            window=None if cut is None else WindowResult.model_validate(cut, from_attributes=True),
            metrics={**diagnostics.metrics, **figures},
            intervals=dict(diagnostics.intervals),
            per_prompt=[PromptBreakdown.of(c) for c in diagnostics.columns],
            lost_group_ids=[c.group_id for c in diagnostics.columns if c.lost_input_dependence],
            skipped_reason=diagnostics.skipped_reason,
        )


class RewardResult(BaseModel):
    """The batch's reward groups and what the run's SNR-aware filter would keep of them."""

    group_ids: list[int]
    group_reward_std: list[float]
    selected_group_ids: list[int]
    single_sample_group_ids: list[int]
    missing_rewards: int = Field(0, description="Trajectories sent with a null reward, left out of the figures.")
    warnings: list[str]
    filter: dict[str, Any] = Field(default_factory=dict)


class ReasoningSummary(BaseModel):
    """How the reasoning of a batch's turns was found under the run's ``reasoning_extraction``."""

    extraction: Extraction = Field(description="The run's setting.")
    turns: int = Field(description="Turns in the batch.")
    think_tags: int = Field(description="Turns whose reasoning came from a think block (complete or unclosed).")
    whole_response: int = Field(description="Turns whose whole response was the reasoning.")
    as_sent: int = Field(description="Turns that sent their reasoning (reasoning or reasoning_token_ids).")
    truncated_think: int = Field(description="Turns whose think block was opened and never closed.")
    with_reasoning: int = Field(description="Turns with reasoning to score.")


class ScoredBy(BaseModel):
    """What computed a scored step's log-probs: engine, model and precision (provenance)."""

    engine: Literal["kernel", "vllm"] = Field(
        description="kernel: our cross-scoring kernel in the worker; vllm: a vLLM server (docs/deploy.md)."
    )
    model: str = Field(description="The scorer's model: what Settings.scorers names, or the vLLM served model name.")
    dtype: str = Field(description="Precision of the weights and activations (vLLM: as its scorer's dtype= says).")
    server: str | None = Field(None, description="The vLLM server's base URL; null for the kernel.")


class BatchResult(BaseModel):
    """Everything a finished batch reports: reward figures for rollouts, cross-scoring on scheduled steps.

    Parts a batch does not have (samplers of an unscored step, rewards of a matrix) are left out.
    """

    scored: bool = Field(
        description="Whether any sampler cross-scored the step: false off schedule (schedule.every) and when "
        "nothing could be scored (skipped_reason)."
    )
    skipped_reason: str | None = Field(None, description="Why a scheduled step scored nothing.")
    samplers: dict[str, SamplerResult] | None = Field(None, description="Per sampler; absent off schedule.")
    reasoning: ReasoningSummary | None = Field(None, description="How the turns' reasoning was found (rollouts only).")
    rewards: RewardResult | None = Field(None, description="Reward groups and filter advice (rollouts only).")
    figures: dict[str, float] | None = Field(None, description="Batch-level figures, sampler `all` (rollouts only).")
    scored_by: ScoredBy | None = Field(None, description="What scored the step; absent when nothing was cross-scored.")

    @model_serializer(mode="wrap")
    def _leave_out_absent_parts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}


class BatchStatus(BaseModel):
    """Where a batch stands: queued, scoring, done (with its results) or failed (with the reason)."""

    batch_id: str = Field(description="The server's id of the batch.")
    run: str
    step: int
    idempotency_key: str | None = Field(description="The client's idempotency key, if it sent one.")
    batch_key: str | None = Field(description="Deprecated: the same as idempotency_key.")
    kind: BatchKind
    status: BatchState
    error: str | None
    attempts: int
    created_at: IsoTime | None
    started_at: IsoTime | None
    finished_at: IsoTime | None
    scoring_seconds: float | None
    tokens_scored: int | None
    scorer: str | None
    checkpoint: str | None
    results: BatchResult | None
    payload_purged_at: IsoTime | None = Field(
        None,
        description="When payload retention removed the batch's stored body and matrices (its results, points and "
        "alerts stay; a byte-identical replay is still recognised); null while they are kept.",
    )


class MatrixAccepted(BatchAccepted):
    results: BatchResult
