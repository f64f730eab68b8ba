"""What clients send: runs, rollouts batches, matrices, checkpoints, filter and score requests, and the
answers that acknowledge them; field constraints are the input rules."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from scoring.estimators import EstimatorConfig, per_token
from scoring.partition import Extraction
from scoring.samplers import is_turn_label
from scoring.snr_filter import FilterConfig, FilterResult, FilterType, Metric, Strategy, TopPMode
from service.schemas.alerts import AlertSettings
from service.storage.labels import BATCH, TRAINER

INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# Validated up to the first bad id: pydantic would otherwise build one error per bad id (a turn of 1M `true`
# ids, 5 MB, took 109 s and +1.25 GB to refuse while other requests waited 55 s).
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
Step = Annotated[int, Field(ge=0, le=INT32_MAX, description="Training step.")]
GroupId = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]
MAX_ABS_REWARD = 1e12  # far beyond any reward a trainer uses; keeps sums and spreads finite
MAX_ABS_LOGPROB = 1e9  # nats; summed log-probabilities of any real sequence lie far inside
# rollout samplers (per_turn's matrices are turn_<k>), batch and trainer figures
RESERVED_SAMPLERS = ("first_turn", "trajectory", "per_turn", BATCH, TRAINER)
MAX_TRAINER_FIGURES = 256  # figures per request: a trainer logs a few dozen (TRL ~20, verl ~100)
MAX_ABS_FIGURE = 1e15  # keeps every stored value a finite float that JSON and both databases hold


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
    column_prompt_tokens: list[TokenIds] | None = Field(
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

    strategy: Strategy = _FILTER.strategy
    value: float = Field(
        _FILTER.value, ge=0, le=1e6, description="top_p mass, top_k fraction, top_k_abs count or min_p ratio."
    )
    filter_type: FilterType = _FILTER.filter_type
    include_zero: bool = Field(
        _FILTER.include_zero, description="When false, groups scoring |s| <= 1e-10 are dropped first."
    )
    top_p_prob_mode: TopPMode = _FILTER.top_p_prob_mode
    selection_eps: float = Field(
        _FILTER.selection_eps, ge=0, le=1e6, description="Slack subtracted from the linear top_p threshold."
    )
    metric: Metric = Field(
        _FILTER.metric,
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
    prompt_token_ids: TokenIds | None = Field(None, min_length=1)
    response: Text | None = Field(None, description="Full assistant text; reasoning extracted the RAGEN way.")
    reasoning: Text | None = None
    reasoning_token_ids: TokenIds | None = None

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


SamplerName = Literal["first_turn", "trajectory", "per_turn"]


def _both_samplers() -> list[SamplerName]:
    return ["first_turn", "trajectory"]


class SamplerSettings(_Strict):
    samplers: list[SamplerName] = Field(
        default_factory=_both_samplers,
        min_length=1,
        description="RAGEN's two samplers (the default), and per_turn: one matrix per turn index, stored as "
        "samplers turn_1 ... turn_8 (multi-turn agents: which turn loses input dependence first; no alert "
        "rule reads them).",
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


class BatchLimits(BaseModel):
    """What one batch may hold on this service: its settings of these names (docs/settings.md says what each
    means). Past any of them a batch is refused 413, naming it; a client fits each step to them instead."""

    max_body_bytes: int = Field(description="Bytes of one request body.")
    max_trajectories: int = Field(description="Trajectories of one batch.")
    max_turns: int = Field(description="Turns of one trajectory.")
    max_text_chars: int = Field(description="Characters of one prompt, response or reasoning text.")
    max_token_ids: int = Field(description="Token ids of one prompt_token_ids or reasoning_token_ids list.")


class RunCreated(RunResponse):
    """The answer to ``POST /v1/runs``: the run, and what one batch of it may hold."""

    limits: BatchLimits = Field(
        description="The service's batch limits, read from its settings: a client fits its batches to them "
        "without being told them by hand."
    )


class TurnWithEntropy(TurnIn):
    token_entropies: list[Annotated[float, Field(ge=0, le=1e3, allow_inf_nan=False)]] | None = Field(
        None, description="Per-token entropies the trainer already computed for this turn's response (nats)."
    )
    reasoning_logprobs: list[Annotated[float, Field(ge=-MAX_ABS_LOGPROB, le=0, allow_inf_nan=False)]] | None = Field(
        None,
        description="The trainer's log-probability (nats, <= 0) of each reasoning token as it was sampled, one per "
        "reasoning_token_ids entry (token-id turns only: text is tokenized by the scorer). Gives the "
        "trainer_scorer_logprob_gap series (docs/scoring.md, Trainer and scorer log-probs).",
    )

    @field_validator("reasoning_logprobs")
    @classmethod
    def _one_per_reasoning_token(cls, logprobs: list[float] | None, info: ValidationInfo) -> list[float] | None:
        if logprobs is None or "reasoning_token_ids" not in info.data:  # ids that failed report their own error
            return logprobs
        ids = info.data["reasoning_token_ids"]
        if ids is None:
            raise ValueError(
                "needs reasoning_token_ids: the trainer's log-probs are of its own tokens, and text is tokenized by "
                "the scorer; send the turn as token ids or leave reasoning_logprobs out"
            )
        if len(logprobs) != len(ids):
            raise ValueError(
                f"must hold one log-probability per reasoning token ({len(ids)} in reasoning_token_ids), "
                f"got {len(logprobs)}"
            )
        return logprobs


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


FigureName = Annotated[
    str,
    Field(
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_./:@-]{0,79}$",
        description="Letters, digits and _ . / : @ - (the first a letter, digit or _), at most 80 characters.",
    ),
]
FigureValue = Annotated[float, Field(ge=-MAX_ABS_FIGURE, le=MAX_ABS_FIGURE, allow_inf_nan=False)]
TrainerFigures = Annotated[
    dict[FigureName, FigureValue],
    Field(
        min_length=1,
        max_length=MAX_TRAINER_FIGURES,
        description=f"Figures the trainer computed for this step (at most {MAX_TRAINER_FIGURES}, finite), stored as "
        f"series of sampler `{TRAINER}` under the names sent, e.g. its SNR filter's rollout/filter_kept_ratio or "
        "the policy's own token entropy actor/entropy (docs/api.md, Trainer figures).",
    ),
]


class BatchIn(_Strict):
    step: Step
    idempotency_key: IdempotencyKey
    trajectories: list[TrajectoryIn] = Field(min_length=1)
    figures: TrainerFigures | None = None


class FiguresIn(_Strict):
    """Figures of a step whose batch was sent already (a trainer logs some only after the step)."""

    step: Step
    figures: TrainerFigures


class FiguresAccepted(_Strict):
    batch_id: str = Field(description="The batch of the step the figures were stored with.")
    step: int
    stored: int = Field(description="Figures stored by this request (0 for a replay).")
    replayed: bool = Field(False, description="True when every figure sent was stored already with the same value.")


BatchState = Literal["queued", "scoring", "done", "failed"]
BatchKind = Literal["rollouts", "matrix"]


class BatchAccepted(_Strict):
    batch_id: str = Field(description="The server's id of the stored batch.")
    status: BatchState
    status_url: str
    replayed: bool = Field(False, description="True when this answers an identical replay of an earlier request.")
    segment: int = Field(
        0, description="The run's segment the batch joined: 0, then one more at every resume (a step going back)."
    )
    resumed: bool = Field(
        False,
        description="True when this batch started `segment`: its step went back below one the run had already "
        "taken (a resume; a warning says which). Reads show the new segment from this step on.",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="What will keep the batch from being scored, found at ingest (e.g. no turn carries reasoning "
        "under the run's reasoning_extraction), and a step that went back and started a segment; the batch is "
        "stored all the same.",
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
        description=f"Series name of these metrics; not one of {', '.join(RESERVED_SAMPLERS)} nor turn_<k>, which the "
        "service's own figures use.",
    )

    @field_validator("sampler")
    @classmethod
    def _own_series_name(cls, sampler: str) -> str:
        if sampler in RESERVED_SAMPLERS or is_turn_label(sampler):
            raise ValueError(f"must not be one of {', '.join(RESERVED_SAMPLERS)} or turn_<k>, got {sampler!r}")
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
