"""Wire formats shared by the command line and the HTTP API; field constraints are the input rules.

Must not import fastapi: the CLI uses these models without a server.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from scoring.estimators import ColumnBreakdown, Diagnostics, EstimatorConfig, per_token
from scoring.partition import Extraction
from scoring.snr_filter import FilterConfig, FilterResult
from scoring.window import WindowCut
from service.storage.times import iso_time

# Rows into answers ------------------------------------------------------------------------------


def _iso(value: object) -> object:
    return iso_time(value) if isinstance(value, datetime) else value


# A stored time as the answers show it (``iso_time``): ISO 8601 with its UTC offset; a string schema.
IsoTime = Annotated[str, BeforeValidator(_iso)]

Model = TypeVar("Model", bound=BaseModel)


class _Row:
    """A row's attributes with some replaced or added: what an answer shows that the row does not hold."""

    def __init__(self, row: object, extra: dict[str, object]) -> None:
        self._row, self._extra = row, extra

    def __getattr__(self, name: str) -> object:
        return self._extra[name] if name in self._extra else getattr(self._row, name)


def from_row(model: type[Model], row: object, **extra: object) -> Model:
    """``model`` validated from an ORM row's attributes in one call; ``extra`` names what the row lacks."""
    return model.model_validate(_Row(row, extra) if extra else row, from_attributes=True)


# Alert settings and names (the rules themselves: service.alerts.rules) ------------------------

RuleName = Literal["TemplateCollapse", "EntropyCollapse", "LowRewardSignal", "NoReasoning"]
AlertState = Literal["pending", "firing", "resolved"]
Severity = Literal["critical", "warning"]
MAX_WINDOW = 1000  # scored steps; a replay's saved state holds up to baseline_steps values per series
SIGNAL_THRESHOLDS = {"mi_zscore_ema": 0.0, "retrieval_above_chance": 0.02, "mi_estimate": 0.01}
Signal = Literal["retrieval_above_chance", "mi_cusum", "mi_zscore_ema", "mi_estimate"]


class AlertSettings(BaseModel):
    """Alert thresholds of one run (``alerts`` in ``POST /v1/runs``); docs/alerts.md's table is generated
    from these fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = Field(True, description="Evaluate alert rules for this run.")
    signal: Signal = Field(
        "retrieval_above_chance",
        description="The input-dependence signal TemplateCollapse watches (the default calibrated on the SmolLM2 "
        "corpus, docs/corpus.md). mi_cusum: a one-sided CUSUM of mi_estimate standardized by its standard error "
        "against its baseline (scoring.estimators.cusum), which fires when it exceeds cusum_threshold; the others: "
        "a level (threshold, drop_fraction).",
    )
    threshold: float | None = Field(
        None,
        ge=-1e6,
        le=1e6,
        allow_inf_nan=False,
        description="Absolute level the signal must stay above; default per signal: "
        + ", ".join(f"{name} {value}" for name, value in SIGNAL_THRESHOLDS.items())
        + " (mi_estimate in nats per token).",
    )
    drop_fraction: float = Field(0.2, gt=0, le=1, description="Relative drop from the baseline that counts.")
    cusum_drop: float = Field(
        0.4,
        gt=0,
        le=1,
        description="mi_cusum: the drop of mi_estimate it is designed to catch, as a share of its baseline (a "
        "quarter of the prompts collapsing takes about a quarter of the MI).",
    )
    cusum_threshold: float = Field(
        3.0, gt=0, le=1e6, description="mi_cusum: the CUSUM level (in standard errors) above which a step counts."
    )
    baseline_steps: int = Field(5, ge=1, le=MAX_WINDOW, description="Scored steps whose median is the baseline.")
    window: int = Field(
        2,
        ge=1,
        le=MAX_WINDOW,
        description="Consecutive scored steps a condition must hold to fire (NoReasoning: batches).",
    )
    resolve_window: int = Field(2, ge=1, le=MAX_WINDOW, description="Consecutive scored steps without it to resolve.")
    entropy_signal: Literal["conditional_entropy_est", "token_entropy_mean"] = Field(
        "conditional_entropy_est", description="The entropy EntropyCollapse watches."
    )
    entropy_band: float = Field(
        0.25, gt=0, lt=1, description="TemplateCollapse needs H(Z|X) no lower than this share below its baseline."
    )
    entropy_band_above: float = Field(
        2.0,
        gt=0,
        le=100,
        description="... and no higher than this share above it. Template reasoning often scores a higher per-token "
        "entropy than grounded reasoning (it is generic text), so the band is wide upwards.",
    )
    entropy_floor: float = Field(0.5, gt=0, lt=1, description="EntropyCollapse fires below this share of baseline.")
    reward_std_fraction: float = Field(0.1, gt=0, lt=1, description="LowRewardSignal: share of baseline reward std.")
    reward_window: int = Field(
        10, ge=1, le=MAX_WINDOW, description="LowRewardSignal: consecutive steps of low reward std."
    )
    zero_variance_ratio: float = Field(0.5, gt=0, le=1, description="LowRewardSignal: zero-variance group share.")
    use_intervals: bool = Field(
        False,
        description="Count a step only when the whole bootstrap interval of mi_estimate is below the same relative "
        "level of its baseline (ignored when the series carries no intervals).",
    )

    @property
    def signal_threshold(self) -> float:
        return self.threshold if self.threshold is not None else SIGNAL_THRESHOLDS[self.signal]


# Integers stored in 32-bit columns (steps, seeds, counts) are bounded where they enter, so both
# databases refuse them alike (Postgres would answer an out-of-range value with an error).
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Step = Annotated[int, Field(ge=0, le=INT32_MAX, description="Training step.")]
GroupId = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]
MAX_ABS_REWARD = 1e12  # far beyond any reward a trainer uses; keeps sums and spreads finite
MAX_ABS_LOGPROB = 1e9  # nats; summed log-probabilities of any real sequence lie far inside
RESERVED_SAMPLERS = ("first_turn", "trajectory", "all")  # rollout samplers and batch figures


def _valid_text(value: str) -> str:
    """Text the databases and tokenizers accept: no NUL character, no lone surrogate."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL character (\\u0000)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"must be valid Unicode; a lone surrogate {value[e.start]!r} was sent at index {e.start}"
        ) from e
    return value


Text = Annotated[str, AfterValidator(_valid_text)]
LogProb = Annotated[float, Field(ge=-MAX_ABS_LOGPROB, le=MAX_ABS_LOGPROB, allow_inf_nan=False)]
Reward = Annotated[float, Field(ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD, allow_inf_nan=False)]


class InputError(ValueError):
    """Input that is well-typed but inconsistent; ``field`` names where, e.g. ``L_seq[2]``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Strict(BaseModel):
    # strict: a JSON true is not a number and 0 is not a boolean; what the schema says is what is accepted.
    model_config = ConfigDict(extra="forbid", strict=True)


_ESTIMATOR = EstimatorConfig()  # RAGEN's defaults live in scoring.estimators; the wire format reuses them


class EstimatorSettings(_Strict):
    std_eps: float = Field(
        _ESTIMATOR.std_eps, ge=0, le=1e3, description="Added to the marginal std before dividing (z-scores)."
    )
    ema_decay: float = Field(_ESTIMATOR.ema_decay, ge=0, le=1, description="d in ema = d * ema + (1 - d) * std.")


class MatrixInput(_Strict):
    """A cross-scoring matrix computed elsewhere: the ``collapse-monitor metrics`` input."""

    row_group_ids: list[GroupId] = Field(min_length=1, description="Group id of each of the R rows.")
    column_prompt_tokens: list[list[TokenId]] | None = Field(
        None,
        description="Prompt token ids of each column, in ascending group-id order, so identical prompts count "
        "as one answer in retrieval. When absent every column is a distinct prompt.",
    )
    reasoning_lengths: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(
        description="T_r, reasoning tokens per row."
    )
    L_seq: list[list[LogProb]] = Field(description="[R][N] summed log p(z_r | x_j) in nats.")
    L_tok: list[list[LogProb]] | None = Field(None, description="[R][N]; default L_seq / max(T_r, 1).")
    config: EstimatorSettings = Field(default_factory=EstimatorSettings)

    def check(self) -> None:
        """Raises InputError naming the first field whose shape disagrees with the others."""
        n_rows = len(self.row_group_ids)
        n_cols = len(set(self.row_group_ids))
        if len(self.reasoning_lengths) != n_rows:
            raise InputError(
                "reasoning_lengths", f"must hold one length per row ({n_rows}), got {len(self.reasoning_lengths)}"
            )
        for name in ("L_seq", "L_tok"):
            matrix = getattr(self, name)
            if matrix is None:
                continue
            if len(matrix) != n_rows:
                raise InputError(name, f"must hold one row per row group id ({n_rows}), got {len(matrix)}")
            for r, row in enumerate(matrix):
                if len(row) != n_cols:
                    raise InputError(
                        f"{name}[{r}]", f"must hold one value per column ({n_cols} distinct group ids), got {len(row)}"
                    )
        if self.column_prompt_tokens is not None and len(self.column_prompt_tokens) != n_cols:
            raise InputError(
                "column_prompt_tokens",
                f"must hold one prompt per column ({n_cols} distinct group ids), got {len(self.column_prompt_tokens)}",
            )

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(L_tok [R, N], L_seq [R, N], column_of_row [R]) as float64 / int64 arrays."""
        self.check()
        columns = sorted(set(self.row_group_ids))
        index = {g: j for j, g in enumerate(columns)}
        L_seq = np.array(self.L_seq, dtype=np.float64).reshape(len(self.row_group_ids), len(columns))
        if self.L_tok is None:
            L_tok = per_token(L_seq, np.array(self.reasoning_lengths))
        else:
            L_tok = np.array(self.L_tok, dtype=np.float64).reshape(L_seq.shape)
        return L_tok, L_seq, np.array([index[g] for g in self.row_group_ids], dtype=np.int64)


class MatrixSteps(_Strict):
    steps: list[MatrixInput] = Field(min_length=1, description="Steps processed in order by one estimator.")


_FILTER = FilterConfig()  # RAGEN's defaults live in scoring.snr_filter; the wire format reuses them


class FilterSettings(_Strict):
    """RAGEN's rollout-filter settings: the run's SNR-aware filter, whose advice every batch reports."""

    strategy: Literal["top_p", "top_k", "top_k_abs", "min_p"] = _FILTER.strategy  # type: ignore[assignment]  # FilterConfig types it as str
    value: float = Field(
        _FILTER.value, ge=0, le=1e6, description="top_p mass, top_k fraction, top_k_abs count or min_p ratio."
    )
    filter_type: Literal["largest", "smallest"] = _FILTER.filter_type  # type: ignore[assignment]  # FilterConfig types it as str
    include_zero: bool = Field(
        _FILTER.include_zero, description="When false, groups scoring |s| <= 1e-10 are dropped first."
    )
    top_p_prob_mode: Literal["linear", "softmax"] = _FILTER.top_p_prob_mode  # type: ignore[assignment]  # FilterConfig types it as str
    selection_eps: float = Field(
        _FILTER.selection_eps, ge=0, le=1e6, description="Slack subtracted from the linear top_p threshold."
    )
    metric: Literal["reward_variance", "reward_std", "reward", "reward_sum"] = Field(
        _FILTER.metric,  # type: ignore[arg-type]  # FilterConfig types it as str
        description="Ranking score: group reward std (reward_variance, as RAGEN names it), mean or sum.",
    )

    def filter_config(self) -> FilterConfig:
        return FilterConfig(**self.model_dump(exclude={"rewards"}))


class FilterRequest(FilterSettings):
    """SNR-aware filter advice: the ``collapse-monitor filter`` input (RAGEN's rollout filter)."""

    rewards: list[Annotated[list[Reward], Field(min_length=1)]] = Field(
        min_length=1, description="One list of rewards per group (the rollouts of one prompt)."
    )


# The filter's answer is scoring's FilterResult itself: its fields are declared there once, and this
# subclass only gives the wire its name (the OpenAPI schema FilterResponse) and _Strict's config.
@pydantic_dataclass(frozen=True, config=_Strict.model_config)
class FilterResponse(FilterResult):
    pass


class TurnIn(_Strict):
    """One agent turn: the prompt as text or ids, and the response or the reasoning.

    Text is tokenized by the scorer's tokenizer without special tokens, prompt and reasoning
    separately (as RAGEN does). A ``response`` is split the RAGEN way: the reasoning is its first
    ``<think>...</think>`` block, cleaned; a ``reasoning`` or ``reasoning_token_ids`` is used as sent.
    """

    prompt: Text | None = Field(
        None, min_length=1, description="Everything the model saw before reasoning (chat template applied)."
    )
    prompt_token_ids: list[TokenId] | None = Field(None, min_length=1)
    response: Text | None = Field(None, description="Full assistant text; reasoning extracted the RAGEN way.")
    reasoning: Text | None = None
    reasoning_token_ids: list[TokenId] | None = None

    @model_validator(mode="after")
    def _one_of_each(self) -> TurnIn:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt, prompt_token_ids")
        given = [f for f in ("response", "reasoning", "reasoning_token_ids") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of response, reasoning, reasoning_token_ids; got {given or 'none'}")
        return self


class ScoreRowIn(TurnIn):
    """One line of the ``collapse-monitor score`` JSONL input."""

    group_id: GroupId


RunName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="Unique run name.")]


class RunMetadata(_Strict):
    model: Text | None = Field(None, max_length=200, description="Policy model being trained.")
    algorithm: Text | None = Field(None, max_length=100, description="e.g. PPO, GRPO.")
    environment: Text | None = Field(None, max_length=200, description="e.g. Sokoban, FrozenLake.")
    tags: list[Annotated[Text, Field(max_length=100)]] = Field(default_factory=list, max_length=50)


class ScheduleSettings(_Strict):
    every: int = Field(
        1,
        ge=1,
        le=INT32_MAX,
        description="Score every N-th step (RAGEN's compute_freq): step 1 and multiples of N; 1 = every batch.",
    )
    budget_seconds: float | None = Field(
        None,
        ge=0,
        le=86_400,
        allow_inf_nan=False,
        description="Kernel seconds one scored step may take (the worker scores fewer rows, then a shorter "
        "reasoning window, to fit; docs/scoring.md, Budget). null: the service's scoring_budget_seconds; 0: no "
        "budget for this run.",
    )


SamplerName = Literal["first_turn", "trajectory"]


def _both_samplers() -> list[SamplerName]:
    return ["first_turn", "trajectory"]


class SamplerSettings(_Strict):
    samplers: list[SamplerName] = Field(
        default_factory=_both_samplers, min_length=1, description="RAGEN's two samplers."
    )
    num_samples: int | None = Field(
        64, ge=2, le=65536, description="Rows drawn per sampler; null = all usable rows (within max_scoring_cost)."
    )
    seed: int = Field(0, ge=0, le=INT32_MAX, description="Draws at step s use RandomState([seed, s, sampler index]).")

    @field_validator("samplers")
    @classmethod
    def _distinct(cls, samplers: list[SamplerName]) -> list[SamplerName]:
        if len(set(samplers)) != len(samplers):
            raise ValueError(f"must be distinct, got {samplers}")
        return samplers


class RunCreate(_Strict):
    name: RunName
    project: Text | None = Field(None, max_length=200)
    metadata: RunMetadata = Field(default_factory=RunMetadata)
    scorer: str | None = Field(None, description="A scorer named in the server's settings; default: the server's.")
    scorer_mode: Literal["reference", "policy"] = Field(
        "reference",
        description="reference: one fixed scorer for the whole run (a stable yardstick); policy: the latest "
        "checkpoint the trainer announced.",
    )
    schedule: ScheduleSettings = Field(default_factory=ScheduleSettings)
    sampler: SamplerSettings = Field(default_factory=SamplerSettings)
    temperature: float = Field(
        1.0,
        ge=0.01,
        le=100,
        description="Scoring temperature; RAGEN scores at the rollout temperature. Logits are divided by it, so "
        "values far outside [0.01, 100] would overflow the log-softmax.",
    )
    filter: FilterSettings = Field(default_factory=FilterSettings)
    alerts: AlertSettings = Field(default_factory=AlertSettings, description="Alert thresholds (docs/alerts.md).")
    reasoning_extraction: Extraction = Field(
        "auto",
        description="Where a turn's `response` holds its reasoning: think_tags (RAGEN: the first "
        "<think>...</think> block; none without one), whole_response (models trained on plain completions), or "
        "auto: the tags when the turn has them (an unclosed block as far as it got), the whole response otherwise.",
    )


class RunResponse(RunCreate):
    scorer: str
    id: int
    created_at: str
    last_step: int | None = None
    batches: dict[str, int] = Field(default_factory=dict, description="Batches per status.")
    scoring_lag: str | None = Field(
        None,
        description="Set when scoring falls behind the run's trainer: its backlog, what a step costs, how often "
        "steps arrive, and what to change.",
    )


class TurnWithEntropy(TurnIn):
    token_entropies: list[Annotated[float, Field(ge=0, le=1e3, allow_inf_nan=False)]] | None = Field(
        None, description="Per-token entropies the trainer already computed for this turn's response (nats)."
    )


class TrajectoryIn(_Strict):
    group_id: GroupId = Field(description="The prompt group: rollouts of the same prompt share it.")
    reward: Reward | None = Field(
        description=f"The trajectory's total reward, within +-{MAX_ABS_REWARD:g}; null when it is missing (the "
        "trainer could not compute it): left out of the reward figures and counted (missing_reward_ratio)."
    )
    turns: list[TurnWithEntropy] = Field(min_length=1, description="Turns in order; one for single-turn trainers.")


IdempotencyKey = Annotated[
    Text | None,
    Field(
        None,
        min_length=1,
        max_length=200,
        # `batch_id` is the key's first name, still accepted until 1.0 (then removed); answers use batch_id
        # for the server's id. The 409's error code `batch_id_conflict` and its `field` are wire format: kept.
        validation_alias=AliasChoices("idempotency_key", "batch_id"),
        description="Idempotency key (also accepted as `batch_id`, its former name, until 1.0): a replay with the same "
        "content is answered as the first time; different content under the same key is refused (409).",
    ),
]


class BatchIn(_Strict):
    step: Step
    idempotency_key: IdempotencyKey
    trajectories: list[TrajectoryIn] = Field(min_length=1)


BatchState = Literal["queued", "scoring", "done", "failed"]
BatchKind = Literal["rollouts", "matrix"]


class BatchAccepted(_Strict):
    batch_id: str = Field(description="The server's id of the stored batch.")
    status: BatchState
    status_url: str
    replayed: bool = Field(False, description="True when this answers an identical replay of an earlier request.")
    warnings: list[str] = Field(
        default_factory=list,
        description="What will keep the batch from being scored, found at ingest (e.g. no turn carries reasoning "
        "under the run's reasoning_extraction); the batch is stored all the same.",
    )


class MatrixBatchIn(MatrixInput):
    step: Step
    idempotency_key: IdempotencyKey
    token_entropy: list[list[Annotated[float, Field(ge=0, le=1e3, allow_inf_nan=False)]]] | None = Field(
        None,
        description="Per row, the entropy in nats of the next-token distribution at each of its T_r reasoning tokens "
        "under its own prompt (as the trainer logs it); gives the token_entropy_* series.",
    )
    rewards: list[Reward] | None = Field(
        None,
        description="Per row, its trajectory's reward; rows sharing a group id form a reward group. Gives the "
        "reward figures of sampler all (rollout/in_group_reward_std, ...) and LowRewardSignal.",
    )
    sampler: str = Field(
        "matrix",
        pattern=r"^[a-z][a-z0-9_]{0,31}$",
        description=f"Series name of these metrics; not one of {', '.join(RESERVED_SAMPLERS)}, which the "
        "service's own figures use.",
    )

    @field_validator("sampler")
    @classmethod
    def _own_series_name(cls, sampler: str) -> str:
        if sampler in RESERVED_SAMPLERS:
            raise ValueError(f"must not be one of {', '.join(RESERVED_SAMPLERS)}, got {sampler!r}")
        return sampler

    def check(self) -> None:
        super().check()
        n_rows = len(self.row_group_ids)
        if self.rewards is not None and len(self.rewards) != n_rows:
            raise InputError("rewards", f"must hold one reward per row ({n_rows}), got {len(self.rewards)}")
        if self.token_entropy is not None:
            if len(self.token_entropy) != n_rows:
                raise InputError(
                    "token_entropy", f"must hold one list per row ({n_rows}), got {len(self.token_entropy)}"
                )
            for r, (row, length) in enumerate(zip(self.token_entropy, self.reasoning_lengths, strict=True)):
                if len(row) != length:
                    raise InputError(
                        f"token_entropy[{r}]", f"must hold one entropy per reasoning token ({length}), got {len(row)}"
                    )


class CheckpointIn(_Strict):
    path: Text = Field(min_length=1, max_length=4096, description="Folder under the server's checkpoint root.")
    kind: Literal["full", "lora"] = Field("full", description="full weights, or a LoRA adapter on the run's scorer.")
    step: int | None = Field(None, ge=0, le=INT32_MAX, description="Training step the checkpoint was saved at.")


class CheckpointResponse(CheckpointIn):
    id: int
    created_at: str


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
    metrics: dict[str, float] = Field(default_factory=dict, description="RAGEN metric names and token entropies.")
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
        entropy: dict[str, float],
        cut: WindowCut | None = None,
    ) -> SamplerResult:
        return cls(
            rows=rows,
            columns=columns,
            window=None if cut is None else WindowResult.model_validate(cut, from_attributes=True),
            metrics={**diagnostics.metrics, **entropy},
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


class AlertDocument(BaseModel):
    """An alert episode as receivers (webhooks) and the API see it."""

    rule: RuleName
    severity: Severity
    run: str
    sampler: str
    state: AlertState
    onset_step: int
    fired_step: int | None
    resolved_step: int | None
    step: int = Field(description="The last scored step the episode was evaluated at.")
    value: float | None
    baseline: float | None
    threshold: float | None
    summary: str
    description: str


class DeliveryStatus(BaseModel):
    """A notification owed to a receiver. A receiver's URL is a credential: only its kind and host are shown."""

    receiver: Literal["webhook", "slack", "alertmanager"]
    url: str = Field(
        description="The receiver's scheme and host, e.g. `https://hooks.slack.com/…`: its path (a webhook's "
        "secret), query and credentials are never shown."
    )
    event: Literal["firing", "resolved"]
    status: Literal["pending", "delivering", "delivered", "failed"]
    attempts: int
    last_error: str | None = Field(
        description="The last try's status and a short reason (at most 200 characters), with URLs and token-like "
        "strings cut out."
    )
    delivered_at: IsoTime | None


class AlertResponse(AlertDocument):
    id: int
    created_at: IsoTime | None
    updated_at: IsoTime | None
    deliveries: list[DeliveryStatus]


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
