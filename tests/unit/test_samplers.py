"""RAGEN's samplers: seeded, reproducible, and drawing exactly as RAGEN's NumPy calls do."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.samplers import (
    MAX_TURN_SAMPLERS,
    Trajectory,
    Turn,
    coverage,
    draw_samplers,
    sample_first_turn,
    sample_per_turn,
    sample_rows,
    sample_trajectory_uniform,
)


def trajectories():
    # 4 groups x 2 rollouts; rollout (g, k) has 3 turns, turn 1 of every second rollout is empty,
    # and rollout (1, 0) starts with an empty first turn.
    out = []
    for g in range(4):
        for k in range(2):
            turns = []
            for t in range(3):
                prompt = (g, t) if t == 0 else (g, k, t)
                empty = (t == 1 and k == 1) or (g == 1 and k == 0 and t == 0)
                turns.append(Turn(prompt_ids=prompt, reasoning_ids=() if empty else (10 * g + k, t)))
            out.append(Trajectory(group_id=g, turns=tuple(turns)))
    return out


def test_first_turn_drops_empty_reasoning_and_keeps_group_columns():
    rows = sample_first_turn(trajectories(), num_samples=None, seed=0)
    assert rows is not None
    assert [m for m, _ in rows.sources] == [0, 1, 3, 4, 5, 6, 7]
    assert rows.batch.column_group_ids == (0, 1, 2, 3)
    assert rows.batch.column_prompts == ((0, 0), (1, 0), (2, 0), (3, 0))


def test_first_turn_draws_without_replacement_as_ragen_does():
    rows = sample_first_turn(trajectories(), num_samples=4, seed=123)
    assert rows is not None
    valid = [0, 1, 3, 4, 5, 6, 7]
    expected = np.random.RandomState(123).choice(valid, 4, replace=False)
    assert [m for m, _ in rows.sources] == list(expected)
    assert len(set(rows.sources)) == 4
    assert sample_first_turn(trajectories(), 4, 123) == rows


def test_trajectory_uniform_draws_with_replacement_each_draw_its_own_column():
    rows = sample_trajectory_uniform(trajectories(), num_samples=12, seed=7)
    assert rows is not None
    assert rows.batch.n_columns == 12
    rng = np.random.RandomState(7)
    usable = {m: [t for t in range(3) if trajectories()[m].turns[t].reasoning_ids] for m in range(8)}
    expected = []
    for _ in range(12):
        m = rng.randint(8)
        expected.append((m, usable[m][rng.randint(len(usable[m]))]))
    assert list(rows.sources) == expected
    assert all(trajectories()[m].turns[t].reasoning_ids for m, t in rows.sources)


def test_trajectory_uniform_caps_draws_at_the_usable_turns():
    rows = sample_trajectory_uniform(trajectories(), num_samples=None, seed=0)
    assert rows is not None
    assert rows.batch.n_rows == 8 * 3 - 4 - 1  # 24 turns, 4 empty second turns, 1 empty first turn


def test_nothing_to_sample_gives_none():
    empty = [Trajectory(group_id=0, turns=(Turn((1,), ()),))]
    assert sample_first_turn(empty, None, 0) is None
    assert sample_trajectory_uniform(empty, None, 0) is None


def test_coverage_counts_turns_with_reasoning():
    stats = coverage(trajectories())
    assert stats == {
        "first_turn_num_total": 8.0,
        "first_turn_num_valid": 7.0,
        "first_turn_valid_rate": 7 / 8,
        "valid_thinking_rate": 19 / 24,
    }


def test_unknown_sampler_is_refused():
    with pytest.raises(ValueError, match="sampler must be one of first_turn, trajectory, got 'turn'"):
        sample_rows("turn", trajectories(), None, 0)


def test_per_turn_scores_each_turn_index_apart_with_a_column_per_distinct_prompt():
    drawn = sample_per_turn(trajectories(), num_samples=None, seed=[0, 1, 2])
    assert list(drawn) == ["turn_1", "turn_2", "turn_3"]
    first, second, third = drawn.values()
    # Turn 1: every trajectory with reasoning there, the group's shared prompt one column (as first_turn's).
    assert first.sources == tuple((m, 0) for m in (0, 1, 3, 4, 5, 6, 7))
    assert first.batch.column_prompts == ((0, 0), (1, 0), (2, 0), (3, 0))
    assert first.batch.column_of_row == (0, 0, 1, 2, 2, 3, 3)
    # Turn 2: every second rollout's reasoning is empty; each history is its own prompt and column.
    assert second.sources == tuple((m, 1) for m in (0, 2, 4, 6))
    assert second.batch.n_columns == 4
    assert second.batch.reasonings == ((0, 1), (10, 1), (20, 1), (30, 1))
    assert third.batch.n_rows == 8


def test_per_turn_draws_each_turn_from_its_own_seed_without_replacement():
    drawn = sample_per_turn(trajectories(), num_samples=3, seed=[5, 9, 2])
    for k, label in enumerate(["turn_1", "turn_2", "turn_3"]):
        valid = [m for m, t in enumerate(trajectories()) if t.turns[k].reasoning_ids]
        expected = np.random.RandomState([5, 9, 2, k]).choice(valid, 3, replace=False)
        assert [m for m, _ in drawn[label].sources] == list(expected)


def test_per_turn_stops_at_eight_turns_and_skips_turns_without_reasoning():
    long = [
        Trajectory(group_id=g, turns=tuple(Turn((g, t), (t,) if t != 2 else ()) for t in range(11))) for g in range(2)
    ]
    drawn = draw_samplers(["first_turn", "per_turn"], long, None, seed=[0, 1])
    assert list(drawn) == ["first_turn", "turn_1", "turn_2", "turn_4", "turn_5", "turn_6", "turn_7", "turn_8"]
    assert MAX_TURN_SAMPLERS == 8
    assert draw_samplers(["per_turn"], [Trajectory(0, (Turn((1,), ()),))], None, [0, 1]) == {"per_turn": None}
