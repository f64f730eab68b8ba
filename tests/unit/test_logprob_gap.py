"""The trainer/scorer log-prob gap: its formula against a naive loop, the kernel's matched-pair log-probs
against the naive scorer's, and the turn field's input rules with their exact messages."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from scoring import ScoringConfig, score_batch, score_batch_naive
from scoring.logprob_gap import logprob_gap
from service.schemas.inputs import TurnWithEntropy
from tests.conftest import random_batch, tiny_scorer


def naive_gap(trainer, scorer):
    total, count = 0.0, 0
    for a, b in zip(trainer, scorer, strict=True):
        for t in range(len(b)):
            total += abs(a[t] - b[t])
            count += 1
    return total / count if count else None


def test_the_gap_equals_a_naive_loop_over_the_compared_tokens():
    rng = np.random.default_rng(0)
    lengths = [7, 1, 12, 3, 0]
    trainer = [-rng.exponential(2.0, n) for n in lengths]
    # The scorer scored each row's opening only (a reasoning window), the whole of some.
    scorer = [-rng.exponential(2.0, n) for n in (4, 1, 12, 3, 0)]
    assert logprob_gap(trainer, scorer) == pytest.approx(naive_gap(trainer, scorer), rel=1e-12)


def test_tokens_past_the_scored_window_do_not_move_the_gap_and_every_token_weighs_the_same():
    scorer = [np.array([-1.0, -2.0]), np.array([-3.0])]
    trainer = [np.array([-1.5, -2.0, -99.0]), np.array([-1.0])]  # -99: past the window, never compared
    assert logprob_gap(trainer, scorer) == pytest.approx((0.5 + 0.0 + 2.0) / 3)


def test_no_compared_token_gives_no_gap_and_inconsistent_rows_are_refused():
    assert logprob_gap([], []) is None
    assert logprob_gap([np.array([-1.0])], [np.empty(0)]) is None
    with pytest.raises(ValueError, match=r"row 0: the scorer has 2 log-probs for the trainer's 1 tokens"):
        logprob_gap([np.array([-1.0])], [np.array([-1.0, -2.0])])
    with pytest.raises(ValueError, match=r"must hold the same rows, got 1 and 0"):
        logprob_gap([np.array([-1.0])], [])


@pytest.mark.parametrize("budget", [40, 100_000])
def test_the_kernels_matched_pair_log_probs_equal_the_naive_scorers_and_sum_to_the_diagonal(budget):
    scorer = tiny_scorer("llama", torch.float64)
    batch = random_batch(seed=1)
    fast = score_batch(scorer, batch, ScoringConfig(max_batch_tokens=budget, logits_chunk_tokens=7, temperature=0.7))
    naive = score_batch_naive(scorer, batch, temperature=0.7, micro_batch_size=4)
    assert [len(m) for m in fast.matched_logprobs] == [len(z) for z in batch.reasonings]
    for r, (a, b) in enumerate(zip(fast.matched_logprobs, naive.matched_logprobs, strict=True)):
        np.testing.assert_allclose(a, b, atol=1e-10, rtol=0)
        assert a.sum() == pytest.approx(fast.L_seq[r, batch.column_of_row[r]], abs=1e-10)


def turn(**fields) -> dict:
    return {"prompt_token_ids": [1, 2], "reasoning_token_ids": [3, 4, 5]} | fields


def only_error(fields: dict) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as raised:
        TurnWithEntropy.model_validate(fields)
    [error] = raised.value.errors()
    return error["loc"], error["msg"]


def test_reasoning_logprobs_are_accepted_one_per_reasoning_token():
    assert TurnWithEntropy.model_validate(turn(reasoning_logprobs=[-0.5, 0, -3])).reasoning_logprobs == [-0.5, 0, -3]


@pytest.mark.parametrize(
    ("logprobs", "loc", "message"),
    [
        (
            [-0.5, -1.0],
            ("reasoning_logprobs",),
            "Value error, must hold one log-probability per reasoning token (3 in reasoning_token_ids), got 2",
        ),
        ([-0.5, 0.25, -1.0], ("reasoning_logprobs", 1), "Input should be less than or equal to 0"),
        ([-0.5, -1.0, -math.inf], ("reasoning_logprobs", 2), "Input should be a finite number"),
        ([math.nan, -1.0, -1.0], ("reasoning_logprobs", 0), "Input should be a finite number"),
    ],
)
def test_reasoning_logprobs_of_the_wrong_length_or_value_are_refused_naming_the_index(logprobs, loc, message):
    assert only_error(turn(reasoning_logprobs=logprobs)) == (loc, message)


def test_reasoning_logprobs_on_a_text_turn_are_refused():
    text_turn = {"prompt": "What is 2 + 2?", "reasoning": "2 + 2 = 4", "reasoning_logprobs": [-0.1]}
    assert only_error(text_turn) == (
        ("reasoning_logprobs",),
        "Value error, needs reasoning_token_ids: the trainer's log-probs are of its own tokens, and text is "
        "tokenized by the scorer; send the turn as token ids or leave reasoning_logprobs out",
    )
