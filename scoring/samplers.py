"""Which (prompt, reasoning) rows of a training step are scored: RAGEN's two samplers and coverage.

first-turn          the first turn of every trajectory with non-empty reasoning; ``num_samples``
                    of them drawn without replacement; columns are the trajectories' group ids.
trajectory-uniform  ``num_samples`` draws: a trajectory uniformly, then one of its non-empty
                    turns uniformly, with replacement; every draw is its own column.
per-turn            ours, for multi-turn agents: one matrix per turn index k (labels ``turn_1`` ...
                    ``turn_8``), the k-th turn of every trajectory that has one with non-empty
                    reasoning (``num_samples`` of them, drawn as first-turn draws); a column per
                    distinct prompt (at turn 1 the groups; later every history differs).

Draws use ``numpy.random.RandomState`` with RAGEN's call sequence (``choice(valid, n,
replace=False)``; ``randint(M)`` then ``randint(T_m)``), so a RandomState seeded like RAGEN's global
NumPy state draws the same rows. Must not import service/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scoring.batch import ScoringBatch, Tokens

SAMPLERS = ("first_turn", "trajectory", "per_turn")
MAX_TURN_SAMPLERS = 8  # per_turn scores turns 1..8: a label a turn keeps /metrics and the page bounded


def turn_label(turn: int) -> str:
    """The label of the per-turn sampler's matrix of the 0-based ``turn``: ``turn_1`` for the first."""
    return f"turn_{turn + 1}"


def is_turn_label(label: str) -> bool:
    return label.startswith("turn_") and label[5:].isdigit()


@dataclass(frozen=True)
class Turn:
    prompt_ids: Tokens
    reasoning_ids: Tokens


@dataclass(frozen=True)
class Trajectory:
    """One rollout: its group (the prompt it was sampled for) and its turns in order."""

    group_id: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class SampledRows:
    """Rows drawn by a sampler: a scoring batch and, per row, its (trajectory, turn) source."""

    batch: ScoringBatch
    sources: tuple[tuple[int, int], ...]


def draw_samplers(
    samplers: Sequence[str], trajectories: Sequence[Trajectory], num_samples: int | None, seed: Sequence[int]
) -> dict[str, SampledRows | None]:
    """Every sampler's rows by label (RAGEN's two under their names, ``per_turn`` as ``turn_1`` ...), None
    where a sampler found no usable reasoning. Sampler s draws from ``RandomState([*seed, index of s])``."""
    drawn: dict[str, SampledRows | None] = {}
    for sampler in samplers:
        own_seed = [*seed, SAMPLERS.index(sampler)]
        if sampler == "per_turn":
            turns = sample_per_turn(trajectories, num_samples, own_seed)
            drawn.update(turns if turns else {sampler: None})
        else:
            drawn[sampler] = sample_rows(sampler, trajectories, num_samples, own_seed)
    return drawn


def sample_rows(
    sampler: str, trajectories: Sequence[Trajectory], num_samples: int | None, seed: int | Sequence[int]
) -> SampledRows | None:
    """Draws the rows of one of RAGEN's samplers; None when no trajectory has usable reasoning
    (``per_turn``: see ``sample_per_turn``)."""
    if sampler == "first_turn":
        return sample_first_turn(trajectories, num_samples, seed)
    if sampler == "trajectory":
        return sample_trajectory_uniform(trajectories, num_samples, seed)
    raise ValueError(f"sampler must be one of first_turn, trajectory, got {sampler!r}")


def sample_first_turn(
    trajectories: Sequence[Trajectory], num_samples: int | None, seed: int | Sequence[int]
) -> SampledRows | None:
    valid = [m for m, t in enumerate(trajectories) if t.turns and t.turns[0].reasoning_ids]
    if not valid:
        return None
    if num_samples is not None and num_samples < len(valid):
        chosen = [int(m) for m in np.random.RandomState(seed).choice(valid, num_samples, replace=False)]
    else:
        chosen = valid
    turns = [trajectories[m].turns[0] for m in chosen]
    batch = ScoringBatch.from_rows(
        [t.prompt_ids for t in turns],
        [t.reasoning_ids for t in turns],
        [trajectories[m].group_id for m in chosen],
    )
    return SampledRows(batch=batch, sources=tuple((m, 0) for m in chosen))


def sample_per_turn(
    trajectories: Sequence[Trajectory], num_samples: int | None, seed: Sequence[int]
) -> dict[str, SampledRows]:
    """The per-turn sampler: per turn index (up to ``MAX_TURN_SAMPLERS``) with usable reasoning, its rows.

    Turn k's draw uses ``RandomState([*seed, k])``, so adding a turn never changes another's rows."""
    n_turns = min(max((len(t.turns) for t in trajectories), default=0), MAX_TURN_SAMPLERS)
    drawn = {}
    for k in range(n_turns):
        valid = [m for m, t in enumerate(trajectories) if len(t.turns) > k and t.turns[k].reasoning_ids]
        if not valid:
            continue
        if num_samples is not None and num_samples < len(valid):
            chosen = [int(m) for m in np.random.RandomState([*seed, k]).choice(valid, num_samples, replace=False)]
        else:
            chosen = valid
        turns = [trajectories[m].turns[k] for m in chosen]
        # Rows that read the same prompt share a column (a group's first turn; later, episodes that went alike).
        columns: dict[Tokens, int] = {}
        batch = ScoringBatch.from_rows(
            [t.prompt_ids for t in turns],
            [t.reasoning_ids for t in turns],
            [columns.setdefault(t.prompt_ids, len(columns)) for t in turns],
        )
        drawn[turn_label(k)] = SampledRows(batch=batch, sources=tuple((m, k) for m in chosen))
    return drawn


def sample_trajectory_uniform(
    trajectories: Sequence[Trajectory], num_samples: int | None, seed: int | Sequence[int]
) -> SampledRows | None:
    usable = [[t for t, turn in enumerate(traj.turns) if turn.reasoning_ids] for traj in trajectories]
    total = sum(len(u) for u in usable)
    if total == 0:
        return None
    draws = total if num_samples is None else min(num_samples, total)
    rng = np.random.RandomState(seed)
    sources = []
    for _ in range(draws):
        m = rng.randint(len(trajectories))
        # As in RAGEN, a draw landing on a trajectory without usable turns is skipped, not redrawn.
        if usable[m]:
            sources.append((int(m), usable[m][rng.randint(len(usable[m]))]))
    if not sources:
        return None
    turns = [trajectories[m].turns[t] for m, t in sources]
    batch = ScoringBatch.from_rows(
        [t.prompt_ids for t in turns], [t.reasoning_ids for t in turns], list(range(len(sources)))
    )
    return SampledRows(batch=batch, sources=tuple(sources))


def coverage(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """RAGEN's coverage figures: how many turns carried reasoning that could be scored."""
    n_turns = sum(len(t.turns) for t in trajectories)
    n_valid = sum(1 for t in trajectories for turn in t.turns if turn.reasoning_ids)
    first_total = sum(1 for t in trajectories if t.turns)
    first_valid = sum(1 for t in trajectories if t.turns and t.turns[0].reasoning_ids)
    metrics = {
        "first_turn_num_total": float(first_total),
        "first_turn_num_valid": float(first_valid),
        "first_turn_valid_rate": first_valid / first_total if first_total else 0.0,
    }
    if n_turns:
        metrics["valid_thinking_rate"] = n_valid / n_turns
    return metrics
