"""Input-dependence signals beyond RAGEN's keys: the only home of these formulas (ours, not the paper's).

RAGEN's figures (``scoring.estimators``) have two weaknesses on real training runs. Per-token MI
follows length: a reasoning that answers its prompt and then appends generic text has its
per-token MI diluted though nothing of its input dependence changed. Sequence MI saturates: it is
bounded by ln N and sits there while retrieval holds, so it cannot move until retrieval breaks.
These signals answer both. With matched_r = L[r, own column], marginal_r = logsumexp_j L[r, j] - ln N,
w_j the share of rows whose own column is j, and columns of identical prompts counted as one answer:

    mi_head_estimate             MI (``mi_estimate``'s formula) on L_head / min(T_r, k): the log-probs
                                 of each reasoning's first k tokens only, so appended text cannot move it
    conditional_entropy_head_est -mean(matched) on the same head matrix
    mi_seq_normalized            mi_seq_estimate / mean_r ln(N / c_r), c_r the columns of row r's prompt: the
                                 share of MI's ceiling (ln N without duplicate prompts), comparable across N
    retrieval_chance_corrected   (acc - chance) / (1 - chance), chance 1/P over the P distinct prompts: 0 with
                                 no dependence, 1 when every row is retrieved
    retrieval_mrr                mean over rows of 1 / (rank of the row's own prompt among the distinct prompts,
                                 by L_tok), exact ties counted as chance
    mi_excess                    mean(matched) - mean_r sum_j w_j L_tok[r, j]: MI minus its mean under a
                                 random reassignment of rows to columns (the permutation null); exact, since
                                 a uniformly shuffled label is j with probability w_j. It needs no logsumexp,
                                 so it does not saturate
    mi_head_excess               the same on the head matrix
    mi_permutation_p             (1 + #{b : null_b >= observed}) / (B + 1), the null drawn by shuffling the
                                 rows' own columns B times (mean matched per-token log-prob is the statistic):
                                 how likely this much dependence is with none at all
    duplicate_row_ratio          share of rows whose reasoning token ids equal a row's of another prompt
    duplicate_column_ratio       share of columns whose prompt equals another column's
    distinct_prompts             P, the distinct prompts among the columns (what a step can retrieve from)
    nearest_log_ratio            mean_r [L_seq[r, own] - mean over its prompt's K = 3 most similar other prompts
                                 (Jaccard of their token-id sets) of their best L_seq[r, .]]: how much likelier a
                                 reasoning is under its own prompt than under the prompts most like it, in nats a
                                 reasoning. Uncapped (top-1 retrieval saturates while the margin shrinks; prompts
                                 of another kind of task are easy to tell apart, so only the nearest ones show a
                                 reasoning that kept its task's kind but lost its content), and text that reads
                                 no prompt adds about 0 to it whatever its length (needs the prompts' token ids)

Everything is float64. Must not import service/ or torch (the API process uses it on uploaded matrices).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scoring.estimators import Diagnostics, column_signatures, matched_and_marginal

if TYPE_CHECKING:  # the kernel's types only: this module must stay importable without torch
    from scoring.batch import ScoringBatch
    from scoring.cross_scores import CrossScores

DEPENDENCE_METRICS = (
    "mi_seq_normalized",
    "retrieval_chance_corrected",
    "retrieval_mrr",
    "mi_excess",
    "mi_permutation_p",
    "duplicate_row_ratio",
    "duplicate_column_ratio",
    "distinct_prompts",
    "nearest_log_ratio",
)
NEAREST_PROMPTS = 3  # nearest_log_ratio: the K most similar other prompts a row's own prompt is weighed against
HEAD_METRICS = ("mi_head_estimate", "conditional_entropy_head_est", "mi_head_excess")
# The head budget k of the service (``head_tokens``) and of ``collapse-monitor score``: chosen on the
# zoo of real runs (docs/alerts.md, Choosing the signal).
DEFAULT_HEAD_TOKENS = 32


@dataclass(frozen=True)
class DependenceConfig:
    """Constants of the signals.

    Attributes:
        permutations: B, the shuffles of the permutation null (0: no ``mi_permutation_p``).
        seed: seed of the shuffles, so p-values are reproducible.
    """

    permutations: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if self.permutations < 0:
            raise ValueError(f"permutations must be >= 0, got {self.permutations}")


def dependence_signals(
    L_tok: np.ndarray,
    paper: dict[str, float],
    column_of_row: np.ndarray | Sequence[int],
    column_prompts: Sequence[Sequence[int]] | None,
    reasonings: Sequence[Sequence[int]] | None,
    config: DependenceConfig,
    L_head_tok: np.ndarray | None = None,
    L_seq: np.ndarray | None = None,
) -> dict[str, float]:
    """The signals of the module docstring for one step (the head ones when ``L_head_tok`` is given).

    Args:
        L_tok: [R, N] per-token cross log-probs (nats), N >= 2.
        paper: RAGEN's figures of the same matrix (``estimators.compute_diagnostics``): its sequence MI
            and top-1 retrieval are normalised here, not computed again.
        column_of_row: [R] each row's own column.
        column_prompts: [N] prompt token ids per column (identical prompts are one answer); None when
            every column is a distinct prompt.
        reasonings: [R] the rows' reasoning token ids; None (an uploaded matrix): no duplicate_row_ratio.
        config: the permutation null's size and seed.
        L_head_tok: [R, N] per-token log-probs of each reasoning's first k tokens, or None.
        L_seq: [R, N] per-sequence cross log-probs, for ``nearest_log_ratio`` (with ``column_prompts``).
    """
    n_rows, n_cols = L_tok.shape
    column_of_row = np.asarray(column_of_row, dtype=np.int64)
    signature = column_signatures(column_prompts, n_cols)
    weights = np.bincount(column_of_row, minlength=n_cols) / n_rows  # [N] w_j
    ceiling = mi_seq_ceiling(column_of_row, signature)
    metrics = {
        "retrieval_mrr": float(reciprocal_ranks(L_tok, column_of_row, signature).mean()),
        "mi_excess": excess_over_null(L_tok, column_of_row, weights),
        "duplicate_column_ratio": float(1 - len(set(signature.tolist())) / n_cols),
        "distinct_prompts": float(signature.max() + 1),
    }
    if ceiling > 0:  # every row's prompt fills every column: no ceiling to be a share of
        metrics["mi_seq_normalized"] = paper["mi_seq_estimate"] / ceiling
    if paper["retrieval_chance_level"] < 1:  # every column one prompt: nothing to retrieve, no figure (not a 0
        # that TemplateCollapse would read as lost dependence)
        chance = paper["retrieval_chance_level"]
        metrics["retrieval_chance_corrected"] = chance_corrected(paper["retrieval_accuracy"], chance)
    if reasonings is not None:
        metrics["duplicate_row_ratio"] = duplicate_row_ratio(reasonings, signature[column_of_row])
    if column_prompts is not None and L_seq is not None and signature.max() >= 1:
        metrics["nearest_log_ratio"] = nearest_log_ratio(L_seq, column_of_row, signature, column_prompts)
    if config.permutations:
        metrics["mi_permutation_p"] = permutation_p(L_tok, column_of_row, config)
    if L_head_tok is not None:
        matched, marginal = matched_and_marginal(L_head_tok, column_of_row)
        metrics["mi_head_estimate"] = float(matched.mean() - marginal.mean())
        metrics["conditional_entropy_head_est"] = -float(matched.mean())
        metrics["mi_head_excess"] = excess_over_null(L_head_tok, column_of_row, weights)
    return metrics


def scored_signals(
    scores: CrossScores, batch: ScoringBatch, diagnostics: Diagnostics, head_tokens: int | None, seed: int = 0
) -> dict[str, float]:
    """``dependence_signals`` of a batch the kernel scored (its head matrix at ``head_tokens`` when it has one);
    empty when RAGEN's figures were skipped (fewer than two columns)."""
    if not diagnostics.metrics:
        return {}
    head = None
    if head_tokens is not None and head_tokens in scores.L_head:
        head = head_per_token(scores.L_head[head_tokens], scores.reasoning_lengths, head_tokens)
    config = DependenceConfig(seed=seed)
    return dependence_signals(
        scores.L_tok,
        diagnostics.metrics,
        batch.column_of_row,
        batch.column_prompts,
        batch.reasonings,
        config,
        head,
        scores.L_seq,
    )


def head_per_token(L_head: np.ndarray, reasoning_lengths: np.ndarray, k: int) -> np.ndarray:
    """[R, N] L_head / max(min(T_r, k), 1): per-token log-probs of each reasoning's first k tokens."""
    scored = np.maximum(np.minimum(np.asarray(reasoning_lengths, dtype=np.float64), k), 1)
    result: np.ndarray = np.asarray(L_head, dtype=np.float64) / scored[:, None]
    return result


def chance_corrected(accuracy: float, chance: float) -> float:
    """(accuracy - chance) / (1 - chance); 0 when chance is 1 (every column one prompt)."""
    return (accuracy - chance) / (1 - chance) if chance < 1 else 0.0


def reciprocal_ranks(L: np.ndarray, column_of_row: np.ndarray, signature: np.ndarray) -> np.ndarray:
    """[R] the reciprocal rank of each row's own prompt, exact ties counted as chance.

    Identical prompts are one answer (the best of their columns counts). With h other prompts scored
    strictly higher and t tied with the own prompt, the rank is 1 + h + u for u uniform on 0..t, and the
    figure is its expected reciprocal, mean_u 1 / (1 + h + u): a flat row (no dependence) gives the null
    mean H_P / P, not 1. Naive equivalent: average 1 / rank over every order of the tied prompts.
    """
    n_rows = L.shape[0]
    n_prompts = int(signature.max()) + 1
    best = np.full((n_rows, n_prompts), -np.inf)  # [R, P] best L per distinct prompt
    for j, s in enumerate(signature):
        best[:, s] = np.maximum(best[:, s], L[:, j])
    own = best[np.arange(n_rows), signature[column_of_row]][:, None]  # [R, 1]
    higher = (best > own).sum(axis=1)  # [R] h
    tied = (best == own).sum(axis=1) - 1  # [R] t, the own prompt left out
    harmonic = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, n_prompts + 1))])  # H_0 .. H_P
    result: np.ndarray = (harmonic[higher + tied + 1] - harmonic[higher]) / (tied + 1)
    return result


def nearest_prompts(signature: np.ndarray, column_prompts: Sequence[Sequence[int]], k: int) -> np.ndarray:
    """[P, min(k, P - 1)] each distinct prompt's most similar other prompts: the Jaccard index of their token-id
    sets (descending; ties to the lower prompt). It never reads the reasonings, so with no input dependence a
    neighbour is as likely as the own prompt."""
    n_prompts = int(signature.max()) + 1
    firsts = [int(np.flatnonzero(signature == p)[0]) for p in range(n_prompts)]
    tokens = [np.unique(np.asarray(column_prompts[j], dtype=np.int64)) for j in firsts]
    _, index = np.unique(np.concatenate(tokens), return_inverse=True)
    members = np.zeros((n_prompts, int(index.max()) + 1), dtype=np.float32)  # [P, V] the token ids of each prompt
    offsets = np.cumsum([0, *(len(t) for t in tokens)])
    for p in range(n_prompts):
        members[p, index[offsets[p] : offsets[p + 1]]] = 1.0
    shared = members @ members.T  # [P, P] |a & b|
    sizes = members.sum(axis=1)
    jaccard = shared / np.maximum(sizes[:, None] + sizes[None, :] - shared, 1.0)
    np.fill_diagonal(jaccard, -np.inf)  # a prompt is never its own neighbour
    order: np.ndarray = np.argsort(-jaccard, axis=1, kind="stable")[:, : min(k, n_prompts - 1)]
    return order


def nearest_log_ratio(
    L_seq: np.ndarray, column_of_row: np.ndarray, signature: np.ndarray, column_prompts: Sequence[Sequence[int]]
) -> float:
    """mean_r [best L_seq[r, own prompt] - mean_{q in nearest(own)} best L_seq[r, q]] (module docstring), nats.

    Naive equivalent: per row, sort the other distinct prompts by Jaccard with the own prompt (descending,
    stable), keep ``NEAREST_PROMPTS``, and subtract the mean of their best scores from the own one's."""
    n_rows = L_seq.shape[0]
    n_prompts = int(signature.max()) + 1
    best = np.full((n_rows, n_prompts), -np.inf)  # [R, P] best L_seq per distinct prompt
    for j, p in enumerate(signature):
        best[:, p] = np.maximum(best[:, p], L_seq[:, j])
    own_prompt = signature[column_of_row]  # [R]
    neighbours = nearest_prompts(signature, column_prompts, NEAREST_PROMPTS)[own_prompt]  # [R, K]
    own = best[np.arange(n_rows), own_prompt]
    return float((own - np.take_along_axis(best, neighbours, axis=1).mean(axis=1)).mean())


def mi_seq_ceiling(column_of_row: np.ndarray, signature: np.ndarray) -> float:
    """The largest ``mi_seq_estimate`` the batch allows: mean_r ln(N / c_r), c_r the columns carrying row r's
    prompt (a row whose prompt fills c_r columns can at best put its mass on all of them): ln N when every
    column is a distinct prompt."""
    counts = np.bincount(signature)  # [P] columns per distinct prompt
    return float(np.log(len(signature) / counts[signature[column_of_row]]).mean())


def excess_over_null(L: np.ndarray, column_of_row: np.ndarray, weights: np.ndarray) -> float:
    """mean(matched) - mean_r sum_j w_j L[r, j]: MI minus its exact permutation-null mean."""
    matched = L[np.arange(L.shape[0]), column_of_row]
    return float(matched.mean() - (L @ weights).mean())


PERMUTATION_CHUNK_ELEMENTS = 2**18  # shuffled row assignments held at once by permutation_p


def permutation_p(L: np.ndarray, column_of_row: np.ndarray, config: DependenceConfig) -> float:
    """The permutation p-value of mean(matched): rows' own columns shuffled ``config.permutations`` times.

    Naive equivalent: for b in range(B): perm = rng.permutation(cols); null_b = mean(L[r, perm[r]]).
    """
    rng = np.random.default_rng(config.seed)
    rows = np.arange(L.shape[0])
    observed = L[rows, column_of_row].mean()
    # Shuffles drawn a chunk at a time, so the null costs a few MB whatever R (all B at once: three [B, R]
    # arrays, 60 MB at the row limit); the generator draws row by row, so the shuffles are the same.
    chunk = max(1, PERMUTATION_CHUNK_ELEMENTS // max(L.shape[0], 1))
    exceeding = 0
    for start in range(0, config.permutations, chunk):
        n = min(chunk, config.permutations - start)
        shuffled = rng.permuted(np.tile(column_of_row, (n, 1)), axis=1)  # [n, R]
        null = L[rows[None, :], shuffled].mean(axis=1)  # [n]
        # A tolerance of float rounding: a shuffle that reproduces the assignment ties with it.
        exceeding += int((null >= observed - 1e-12).sum())
    return float((1 + exceeding) / (config.permutations + 1))


def duplicate_row_ratio(reasonings: Sequence[Sequence[int]], prompt_of_row: np.ndarray) -> float:
    """Share of rows whose reasoning is token for token the reasoning of a row of another prompt."""
    prompts_of: dict[tuple[int, ...], set[int]] = {}
    for z, p in zip(reasonings, prompt_of_row.tolist(), strict=True):
        prompts_of.setdefault(tuple(z), set()).add(p)
    shared = sum(len(prompts_of[tuple(z)]) > 1 for z in reasonings)
    return shared / len(reasonings)
