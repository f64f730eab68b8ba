"""``zoo score`` (bench/real_run/zoo.py) on a recorded multi-turn step, with the real SmolLM2 scorer."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from scoring import load_scorer
from scoring.config import CACHE_DIR

pytestmark = pytest.mark.slow

# Imported by name: bench/ is outside the typed tree (its bench/real_run/zoo/ data folder shadows zoo.py for mypy).
zoo = importlib.import_module("bench.real_run.zoo")


def test_a_turn_only_one_episode_reached_is_scored_without_a_matrix_and_the_others_keep_theirs(monkeypatch):
    # rooms-lr-s0's last step: every episode but one ended within 3 turns, so turn_4 has one row, no metrics
    # and no matrix. score_arm paired matrices with the scored samplers by position and stopped on it.
    (step,) = [s for s in zoo.read_record("rooms-lr-s0") if s["step"] == 14]
    long_group = next(e["group"] for e in step["episodes"] if len(e["turns"]) == 4)
    groups = [long_group, *sorted({e["group"] for e in step["episodes"]} - {long_group})[:1]]
    step = {**step, "episodes": [e for e in step["episodes"] if e["group"] in groups]}
    kept: list[Any] = []
    monkeypatch.setattr(zoo, "read_record", lambda *_: [step])
    monkeypatch.setattr(zoo, "read_partial", lambda *_: ([], {}))
    monkeypatch.setattr(zoo, "write_partial", lambda _, steps, __: kept.append(len(steps)))
    settings = zoo.zoo_settings(CACHE_DIR, threads=2)
    scorer = load_scorer(settings.scoring_config("smollm2-135m"), CACHE_DIR)

    (scored,) = zoo.score_arm("rooms-lr-s0", scorer, settings)

    assert kept == [1]
    assert "turn_4" not in scored["samplers"]
    assert "retrieval_chance_corrected" not in scored["points"].get("turn_4", {})
    for sampler in ("trajectory", "turn_1", "turn_2", "turn_3"):
        matrix = scored["samplers"][sampler]
        assert len(matrix["L_seq"]) == len(matrix["column_of_row"]) == len(matrix["reasonings"]) > 0
        assert "retrieval_chance_corrected" in scored["points"][sampler]
    assert len(scored["L_seq"]) == len(scored["column_of_row"]) == 6  # first_turn: one row per episode
