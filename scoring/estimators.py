"""RAGEN-2 diagnostics from a cross-scoring matrix: the only home of these formulas.

With matched_r = L[r, own column] and marginal_r = logsumexp_j L[r, j] - ln N (N columns,
duplicates counted), means over rows (RAGEN ``collapse_metrics._compute_metrics_for_pairs``):

    mi_estimate             = mean(matched) - mean(marginal)           I(X;Z) = H(Z) - H(Z|X)
    conditional_entropy_est = -mean(matched)                           H(Z|X)
    reasoning_entropy_est   = -mean(marginal)                          H(Z)
    mi_zscore               = mean((matched - marginal) / (std(marginal) + eps))
    mi_zscore_ema           = the same with an EMA of std(marginal) across steps
    mi_estimate_se          = std(matched - marginal) / sqrt(R)        (ours: its standard error)

Sequential change detection (ours, ``mi_cusum``): a one-sided CUSUM on the per-step MI estimate
standardized by its standard error, against a baseline b and a designed drop d (a share of b):

    S_t = max(0, S_{t-1} + (b - d/2 - mi_t) / max(sqrt(se_t^2 + tau^2), se_floor))

It grows by about (d/2) / se per step once MI has fallen by d, and drifts to 0 while MI stays at b.
se_t (resampling the batch's rows) misses how much MI moves between steps while the policy
trains; tau^2 adds it: the variance of the baseline steps' estimates beyond their own se^2
(``between_step_variance``), so a run whose MI wanders step to step needs a larger fall.

computed on L_tok (unsuffixed names) and on L_seq (``_seq`` names); retrieval on L_tok only.
Everything here is float64; RAGEN accumulates L in float32, so its figures agree with ours to
float32 rounding. Must not import service/.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

TOP_KS = (2, 4, 8)
PAPER_METRICS = (
    "matched_log_prob_mean",
    "marginal_log_prob_mean",
    "mi_estimate",
    "mi_seq_estimate",
    "mi_upper_bound",
    "conditional_entropy_est",
    "conditional_entropy_seq_est",
    "reasoning_entropy_est",
    "reasoning_entropy_seq_est",
    "marginal_std",
    "marginal_std_seq",
    "mi_zscore",
    "mi_zscore_seq",
    "marginal_std_ema",
    "marginal_std_ema_seq",
    "mi_zscore_ema",
    "mi_zscore_ema_seq",
    "retrieval_accuracy",
    "retrieval_chance_level",
    "retrieval_above_chance",
    *(
        f"{name}@{k}"
        for k in TOP_KS
        for name in ("retrieval_accuracy", "retrieval_chance_level", "retrieval_above_chance")
    ),
)
TOKEN_ENTROPY_METRICS = ("token_entropy_mean", "token_entropy_p10", "token_entropy_p50", "token_entropy_p90")


def per_token(L_seq: np.ndarray, reasoning_lengths: np.ndarray) -> np.ndarray:
    """L_tok [R, N] = L_seq / max(T_r, 1): per-token log-probabilities (nats), 0 for empty reasoning."""
    return np.asarray(L_seq, dtype=np.float64) / np.maximum(np.asarray(reasoning_lengths, dtype=np.float64), 1)[:, None]


class MatrixError(ValueError):
    """A cross-scoring matrix or its companions are malformed; the message names the field."""


@dataclass(frozen=True)
class EstimatorConfig:
    """Constants of the estimators (RAGEN defaults) and of our bootstrap.

    Attributes:
        std_eps: added to the marginal std before dividing (z-scores).
        ema_decay: d in ema = d * ema + (1 - d) * current.
        bootstrap_samples: resamples of rows for the intervals; 0 disables them.
        bootstrap_seed: seed of the resampling, so intervals are reproducible.
        confidence: coverage of the percentile intervals.
    """

    std_eps: float = 1e-3
    ema_decay: float = 0.9
    bootstrap_samples: int = 1000
    bootstrap_seed: int = 0
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if not self.std_eps >= 0:
            raise ValueError(f"std_eps must be >= 0, got {self.std_eps}")
        if not 0 <= self.ema_decay <= 1:
            raise ValueError(f"ema_decay must be within [0, 1], got {self.ema_decay}")
        if self.bootstrap_samples < 0:
            raise ValueError(f"bootstrap_samples must be >= 0, got {self.bootstrap_samples}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be within (0, 1), got {self.confidence}")


@dataclass(frozen=True)
class EmaState:
    """EMA of the marginal std, kept per (run, sampler) between steps; None before the first step."""

    marginal_std: float | None = None
    marginal_std_seq: float | None = None


@dataclass(frozen=True)
class ColumnBreakdown:
    """Per-prompt view: which prompts lost input dependence (means over the column's own rows)."""

    column: int
    group_id: int
    n_rows: int
    matched_mean: float
    mi_term: float
    retrieval_rate: float
    lost_input_dependence: bool = False


@dataclass(frozen=True)
class Diagnostics:
    """What one scoring batch says about input dependence.

    ``metrics`` holds exactly the RAGEN names (``PAPER_METRICS``); it is empty, with
    ``skipped_reason`` set, when there are fewer than two columns.
    """

    metrics: dict[str, float]
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    columns: tuple[ColumnBreakdown, ...] = ()
    skipped_reason: str | None = None
    standard_errors: dict[str, float] = field(default_factory=dict)


def compute_diagnostics(
    L_tok: np.ndarray,
    L_seq: np.ndarray,
    column_of_row: np.ndarray | Sequence[int],
    column_prompts: Sequence[Sequence[int]] | None,
    ema: EmaState,
    config: EstimatorConfig,
    column_group_ids: Sequence[int] | None = None,
) -> tuple[Diagnostics, EmaState]:
    """All RAGEN-2 diagnostics of one step, and the EMA state to carry to the next.

    Args:
        L_tok: [R, N] per-token cross log-probs (nats).
        L_seq: [R, N] per-sequence cross log-probs (nats).
        column_of_row: [R] each row's own column.
        column_prompts: [N] prompt token ids per column, so that identical prompts count as one
            answer in retrieval; None when every column is a distinct prompt.
        ema: state after the previous step of the same (run, sampler).
        config: estimator constants.
        column_group_ids: [N] names of the columns in the breakdown (default 0..N-1).

    Returns:
        (diagnostics, new EMA state). With fewer than two columns nothing is computed and the
        EMA state is returned unchanged.
    """
    L_tok, L_seq, cols = _check_matrix(L_tok, L_seq, column_of_row, column_prompts)
    n_cols = L_tok.shape[1]
    if n_cols < 2:
        reason = f"fewer than two columns (N={n_cols}): mutual information needs at least two prompts"
        return Diagnostics(metrics={}, skipped_reason=reason), ema

    matched, marginal = matched_and_marginal(L_tok, cols)
    matched_seq, marginal_seq = matched_and_marginal(L_seq, cols)
    std, std_seq = float(np.std(marginal)), float(np.std(marginal_seq))
    # RAGEN updates the EMA before using it, so the first step's EMA is that step's std.
    ema_std = _ema(ema.marginal_std, std, config.ema_decay)
    ema_std_seq = _ema(ema.marginal_std_seq, std_seq, config.ema_decay)
    terms, terms_seq = matched - marginal, matched_seq - marginal_seq
    metrics = {
        "matched_log_prob_mean": float(matched.mean()),
        "marginal_log_prob_mean": float(marginal.mean()),
        "mi_estimate": float(matched.mean()) - float(marginal.mean()),
        "mi_seq_estimate": float(terms_seq.mean()),
        "mi_upper_bound": math.log(n_cols),
        "conditional_entropy_est": -float(matched.mean()),
        "conditional_entropy_seq_est": -float(matched_seq.mean()),
        "reasoning_entropy_est": -float(marginal.mean()),
        "reasoning_entropy_seq_est": -float(marginal_seq.mean()),
        "marginal_std": std,
        "marginal_std_seq": std_seq,
        "mi_zscore": float((terms / (std + config.std_eps)).mean()),
        "mi_zscore_seq": float((terms_seq / (std_seq + config.std_eps)).mean()),
        "marginal_std_ema": ema_std,
        "marginal_std_ema_seq": ema_std_seq,
        "mi_zscore_ema": float((terms / (ema_std + config.std_eps)).mean()),
        "mi_zscore_ema_seq": float((terms_seq / (ema_std_seq + config.std_eps)).mean()),
    }
    signature = column_signatures(column_prompts, n_cols)
    correct_at, chance = retrieval_hits(L_tok, cols, signature)
    metrics.update(retrieval_metrics(correct_at, chance))
    group_ids = list(column_group_ids) if column_group_ids is not None else list(range(n_cols))
    diagnostics = Diagnostics(
        metrics={name: metrics[name] for name in PAPER_METRICS},
        intervals=bootstrap_intervals(terms, correct_at[1], config),
        columns=column_breakdown(matched, terms, correct_at[1], cols, group_ids),
        standard_errors={"mi_estimate": standard_error(terms)},
    )
    return diagnostics, EmaState(marginal_std=ema_std, marginal_std_seq=ema_std_seq)


def matched_and_marginal(L: np.ndarray, column_of_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([R] L[r, own column], [R] logsumexp_j L[r, j] - ln N), stable for any magnitude."""
    n_cols = L.shape[1]
    matched = L[np.arange(L.shape[0]), column_of_row]
    peak = L.max(axis=1, keepdims=True)
    marginal = (peak + np.log(np.exp(L - peak).sum(axis=1, keepdims=True)))[:, 0] - math.log(n_cols)
    return matched, marginal


def prompt_posterior(L: np.ndarray) -> np.ndarray:
    """[R, N] p(x_j | z_i) under a uniform prior over the N prompts: each row of L softmaxed.

    The row-normalized cross-scoring matrix: a row peaks on its own prompt while reasoning depends
    on the input, and is flat (1/N everywhere) once it does not. Stable for any magnitude.
    Naive equivalent: ``np.exp(L) / np.exp(L).sum(axis=1, keepdims=True)`` (overflows for long z).
    """
    weights: np.ndarray = np.exp(L - L.max(axis=1, keepdims=True))  # [R, N]
    posterior: np.ndarray = weights / weights.sum(axis=1, keepdims=True)
    return posterior


def retrieval_hits(
    L_tok: np.ndarray, column_of_row: np.ndarray, signature: np.ndarray
) -> tuple[dict[int, np.ndarray], float]:
    """Per-row retrieval hits at k in {1, 2, 4, 8} and the top-1 chance level, over the distinct prompts.

    Columns are ranked by L (higher first, the lower column index first on exact ties, so top-1 is
    ``argmax``); identical prompts are one answer, placed where their best column ranks, so the
    ranking is over the P distinct prompts and a hit at k is the row's own prompt among the first k
    of them (k capped at min(8, P) as RAGEN caps it at min(8, N)). With no input dependence every
    distinct prompt is equally likely first, so chance is 1/P; with every column a distinct prompt
    (RAGEN's case) this is RAGEN's ranking and 1/N.

    Naive equivalent per row: walk the columns sorted by -L (stable), keep each prompt's first
    column, and find the position of the row's own prompt in that list.
    """
    n_rows, n_cols = L_tok.shape
    n_prompts = int(signature.max()) + 1
    ranked = np.argsort(-L_tok, axis=1, kind="stable")  # [R, N]
    position = np.empty_like(ranked)  # [R, N] each column's place in its row's ranking
    np.put_along_axis(position, ranked, np.arange(n_cols)[None, :], axis=1)
    first = np.empty((n_rows, n_prompts), dtype=np.int64)  # [R, P] where each prompt's best column ranks
    for s in range(n_prompts):
        first[:, s] = position[:, signature == s].min(axis=1)
    own = first[np.arange(n_rows), signature[column_of_row]]  # [R]
    rank = 1 + (first < own[:, None]).sum(axis=1)  # [R] the own prompt's place among the distinct prompts
    k_max = min(max(TOP_KS), n_prompts)
    correct_at = {k: rank <= min(k, k_max) for k in (1, *TOP_KS)}
    return correct_at, 1.0 / n_prompts


def retrieval_metrics(correct_at: dict[int, np.ndarray], chance: float) -> dict[str, float]:
    """RAGEN's retrieval keys from ``retrieval_hits``: chance@k is k_eff / P, k_eff = min(k, 8, P)."""
    n_prompts = round(1 / chance)
    accuracy = float(correct_at[1].mean())
    metrics = {
        "retrieval_accuracy": accuracy,
        "retrieval_chance_level": chance,
        "retrieval_above_chance": accuracy - chance,
    }
    for k in TOP_KS:
        accuracy_k = float(correct_at[k].mean())
        chance_k = min(k, max(TOP_KS), n_prompts) / n_prompts
        metrics[f"retrieval_accuracy@{k}"] = accuracy_k
        metrics[f"retrieval_chance_level@{k}"] = chance_k
        metrics[f"retrieval_above_chance@{k}"] = accuracy_k - chance_k
    return metrics


# Resampled cells held at once (int64 indices and their float64 gather: 4 MB): the bootstrap's
# memory whatever R is. Drawing all B x R at once took 3.1 GB at R = 200,000 (B = 1000).
BOOTSTRAP_CHUNK_CELLS = 1 << 18


def bootstrap_intervals(
    mi_terms: np.ndarray, correct: np.ndarray, config: EstimatorConfig
) -> dict[str, tuple[float, float]]:
    """Percentile intervals of ``mi_estimate`` and ``retrieval_accuracy`` with rows resampled.

    Batch-level MI is noisy (it can dip below zero); an interval that straddles a threshold says
    the step alone does not show a change. Columns stay fixed: only rows are resampled.

    Memory is O(``BOOTSTRAP_CHUNK_CELLS``) whatever R is: the B resamples are drawn a chunk of
    whole resamples at a time. Naive equivalent (same numbers bit for bit: ``Generator.integers``
    fills its output from one stream in order, so consecutive chunks draw what one [B, R] call
    would, and each resample's mean is taken over its own row as before)::

        idx = rng.integers(0, R, size=(B, R))
        np.percentile(values[idx].mean(axis=1), [tail, 100 - tail])
    """
    if config.bootstrap_samples == 0:
        return {}
    n_rows = len(mi_terms)
    rng = np.random.default_rng(config.bootstrap_seed)
    accuracy = correct.astype(np.float64)
    means = np.empty((2, config.bootstrap_samples))  # [2, B] per resample: mean MI term, mean hit
    per_chunk = max(1, BOOTSTRAP_CHUNK_CELLS // n_rows)
    for start in range(0, config.bootstrap_samples, per_chunk):
        stop = min(start + per_chunk, config.bootstrap_samples)
        idx = rng.integers(0, n_rows, size=(stop - start, n_rows))  # [chunk, R]
        means[0, start:stop] = mi_terms[idx].mean(axis=1)
        means[1, start:stop] = accuracy[idx].mean(axis=1)
    tail = 100 * (1 - config.confidence) / 2
    intervals = {}
    for name, resampled in (("mi_estimate", means[0]), ("retrieval_accuracy", means[1])):
        low, high = np.percentile(resampled, [tail, 100 - tail])
        intervals[name] = (float(low), float(high))
    return intervals


def standard_error(values: np.ndarray) -> float:
    """Standard error of the mean of ``values`` (sample std with n - 1); 0 for fewer than two."""
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


LOST_RETRIEVAL_RATE = 0.5  # a column whose own rows pick it less often than this ...
LOST_MI_SHARE = 0.5  # ... and whose MI term is below this share of the healthy columns' median


def lost_input_dependence(mi_terms: Sequence[float], retrieval_rates: Sequence[float]) -> list[bool]:
    """Which prompts (columns) lost input dependence, judged within one batch.

    A column is lost when fewer than half of its rows retrieve it and its MI term is below half the
    median MI term of the columns that are still retrieved (at least half of their rows); when no
    column is retrieved, every column is lost. Needs no baseline, so a batch names its own.
    """
    healthy = [m for m, r in zip(mi_terms, retrieval_rates, strict=True) if r >= LOST_RETRIEVAL_RATE]
    if not healthy:
        return [True] * len(mi_terms)
    level = LOST_MI_SHARE * float(np.median(healthy))
    return [r < LOST_RETRIEVAL_RATE and m < level for m, r in zip(mi_terms, retrieval_rates, strict=True)]


def between_step_variance(values: Sequence[float], errors: Sequence[float]) -> float:
    """tau^2: the variance of per-step estimates beyond their sampling variance (method of moments, >= 0)."""
    if len(values) < 2:
        return 0.0
    return max(0.0, float(np.var(values, ddof=1)) - float(np.mean(np.square(errors))))


def cusum(
    values: Sequence[float],
    errors: Sequence[float],
    baseline: float,
    drop: float,
    se_floor: float,
    tau2: float = 0.0,
    start: float = 0.0,
) -> list[float]:
    """One-sided CUSUM statistics S_t of a downward shift of ``drop`` from ``baseline`` (module docstring).

    Args:
        values: per-step estimates (mi_estimate).
        errors: their standard errors; sqrt(se^2 + tau2) is floored at ``se_floor`` so one lucky
            low-noise batch cannot weigh a small dip as a large one.
        baseline: the in-control level b.
        drop: the designed shift d (> 0); steps below b - d/2 push S up.
        tau2: between-step variance added to each se^2 (``between_step_variance``).
        start: S before the first value (0: a fresh statistic; the last S to go on from there).
    """
    out, s = [], start
    for value, error in zip(values, errors, strict=True):
        s = max(0.0, s + (baseline - drop / 2 - value) / max(math.sqrt(error**2 + tau2), se_floor))
        out.append(s)
    return out


def column_breakdown(
    matched: np.ndarray,
    mi_terms: np.ndarray,
    correct: np.ndarray,
    column_of_row: np.ndarray,
    group_ids: Sequence[int],
) -> tuple[ColumnBreakdown, ...]:
    """Per column: its rows' matched mean, MI term (mean of matched - marginal), retrieval rate, and
    whether it lost input dependence (``lost_input_dependence``)."""
    out = []
    for j, gid in enumerate(group_ids):
        own = column_of_row == j
        if not own.any():
            continue
        out.append(
            ColumnBreakdown(
                column=j,
                group_id=int(gid),
                n_rows=int(own.sum()),
                matched_mean=float(matched[own].mean()),
                mi_term=float(mi_terms[own].mean()),
                retrieval_rate=float(correct[own].mean()),
            )
        )
    lost = lost_input_dependence([c.mi_term for c in out], [c.retrieval_rate for c in out])
    return tuple(replace(c, lost_input_dependence=flag) for c, flag in zip(out, lost, strict=True))


def token_entropy_stats(per_row: Sequence[np.ndarray]) -> dict[str, float]:
    """Matched-pair token entropy: mean over all tokens, and p10/p50/p90 of the per-row means.

    Rows without reasoning tokens are left out; an empty dict when no row has any.
    """
    rows = [np.asarray(e, dtype=np.float64) for e in per_row if len(e)]
    if not rows:
        return {}
    p10, p50, p90 = np.percentile([r.mean() for r in rows], [10, 50, 90])
    return {
        "token_entropy_mean": float(np.concatenate(rows).mean()),
        "token_entropy_p10": float(p10),
        "token_entropy_p50": float(p50),
        "token_entropy_p90": float(p90),
    }


def _ema(previous: float | None, current: float, decay: float) -> float:
    return current if previous is None else decay * previous + (1 - decay) * current


def column_signatures(column_prompts: Sequence[Sequence[int]] | None, n_cols: int) -> np.ndarray:
    """[N] int: columns with identical prompts share a signature id (first-seen order)."""
    if column_prompts is None:
        return np.arange(n_cols)
    ids: dict[tuple[int, ...], int] = {}
    return np.array([ids.setdefault(tuple(p), len(ids)) for p in column_prompts], dtype=np.int64)


def _check_matrix(
    L_tok: np.ndarray,
    L_seq: np.ndarray,
    column_of_row: np.ndarray | Sequence[int],
    column_prompts: Sequence[Sequence[int]] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    L_tok = np.asarray(L_tok, dtype=np.float64)
    L_seq = np.asarray(L_seq, dtype=np.float64)
    cols = np.asarray(column_of_row, dtype=np.int64)
    if L_tok.ndim != 2 or L_tok.shape[0] == 0:
        raise MatrixError(f"L_tok must be a non-empty [R, N] matrix, got shape {L_tok.shape}")
    if L_seq.shape != L_tok.shape:
        raise MatrixError(f"L_seq must have the shape of L_tok {L_tok.shape}, got {L_seq.shape}")
    if cols.shape != (L_tok.shape[0],):
        raise MatrixError(f"column_of_row must hold one column per row ({L_tok.shape[0]}), got shape {cols.shape}")
    if cols.size and (cols.min() < 0 or cols.max() >= L_tok.shape[1]):
        raise MatrixError(f"column_of_row values must lie in [0, {L_tok.shape[1] - 1}]")
    for name, L in (("L_tok", L_tok), ("L_seq", L_seq)):
        if not np.isfinite(L).all():
            r, j = np.argwhere(~np.isfinite(L))[0]
            raise MatrixError(f"{name}[{r}][{j}] must be a finite number, got {L[r, j]}")
    if column_prompts is not None and len(column_prompts) != L_tok.shape[1]:
        raise MatrixError(
            f"column_prompt_tokens must list one prompt per column ({L_tok.shape[1]}), got {len(column_prompts)}"
        )
    return L_tok, L_seq, cols
