"""Windows: a batch past the scorer's context is cut to fit, never refused, and says what it cut."""

from __future__ import annotations

import numpy as np
import pytest

from scoring import ScoringBatch, ScoringConfig, ScoringError, score_batch, score_batch_naive
from scoring.window import fit_window
from tests.conftest import VOCAB


def long_batch(seed: int = 0) -> ScoringBatch:
    """3 prompts sharing a 150-token head, 6 rows of 20 to 200 reasoning tokens: 349 positions at most."""
    rng = np.random.default_rng(seed)
    head = [int(t) for t in rng.integers(0, VOCAB, 150)]
    prompts = {g: head + [int(t) for t in rng.integers(0, VOCAB, 5 + g)] for g in range(3)}
    lengths = [20, 200, 60, 120, 1, 180]
    rows = [(prompts[r % 3], [int(t) for t in rng.integers(0, VOCAB, n)], r % 3) for r, n in enumerate(lengths)]
    return ScoringBatch.from_rows([p for p, _, _ in rows], [z for _, z, _ in rows], [g for _, _, g in rows])


def test_a_batch_that_fits_is_returned_as_it_is():
    batch = long_batch()
    windowed, cut = fit_window(batch, max_reasoning_tokens=None, max_positions=1000)
    assert windowed is batch
    assert (cut.rows_cut, cut.prompts_cut, cut.truncated_reasoning_ratio) == (0, 0, 0.0)
    assert cut.rows_with_reasoning == 5  # the 1-token reasoning has nothing to score


def test_reasonings_keep_their_first_tokens_and_the_cut_is_counted():
    batch = long_batch()
    windowed, cut = fit_window(batch, max_reasoning_tokens=64, max_positions=None)
    for full, kept in zip(batch.reasonings, windowed.reasonings, strict=True):
        assert kept == full[:64]
    assert windowed.prompts == batch.prompts
    assert (cut.rows_cut, cut.reasoning_tokens_cut) == (3, (200 - 64) + (120 - 64) + (180 - 64))
    assert cut.truncated_reasoning_ratio == pytest.approx(3 / 5)
    assert cut.max_reasoning_tokens == 64


def test_prompts_past_the_context_lose_their_head_and_the_pair_fits(gpt2_64):
    batch = long_batch()
    with pytest.raises(ScoringError, match="the scorer's context is 256"):
        score_batch(gpt2_64, batch, ScoringConfig())
    # One position short of the context: the naive scorer below also feeds each reasoning's last token.
    windowed, cut = fit_window(batch, max_reasoning_tokens=128, max_positions=255)
    assert max(len(p) for p in windowed.column_prompts) + 128 - 1 == 255
    for full, kept in zip(batch.column_prompts, windowed.column_prompts, strict=True):
        assert kept == full[len(full) - len(kept) :]  # the tail: what the reasoning reads last
    assert cut.prompts_cut == 3
    assert cut.merged_columns == 0  # their tails still differ
    assert windowed.column_group_ids == batch.column_group_ids
    assert windowed.column_of_row == batch.column_of_row
    # The windowed batch scores, and exactly as the naive scorer scores the windowed pairs.
    fast = score_batch(gpt2_64, windowed, ScoringConfig())
    naive = score_batch_naive(gpt2_64, windowed)
    np.testing.assert_allclose(fast.L_seq, naive.L_seq, atol=1e-10, rtol=0)


def test_without_a_reasoning_window_the_context_still_leaves_each_prompt_half_of_it():
    batch = long_batch()
    windowed, cut = fit_window(batch, max_reasoning_tokens=None, max_positions=256)
    longest_prompt = max(len(p) for p in windowed.column_prompts)
    assert longest_prompt >= 128
    assert longest_prompt + max(len(z) for z in windowed.reasonings) - 1 <= 256
    assert cut.max_reasoning_tokens == 256 - 128 + 1


def test_prompts_that_differed_only_in_their_head_are_counted_as_merged():
    head_a, head_b, tail = [1] * 50, [2] * 50, [3] * 10
    batch = ScoringBatch.from_rows([head_a + tail, head_b + tail], [[4] * 30, [5] * 30], [0, 1])
    windowed, cut = fit_window(batch, max_reasoning_tokens=None, max_positions=20)
    assert windowed.column_prompts[0] == windowed.column_prompts[1]
    assert cut.merged_columns == 1


@pytest.mark.parametrize(
    ("window", "positions", "message"), [(1, None, "max_reasoning_tokens"), (None, 1, "max_positions")]
)
def test_windows_too_small_to_score_anything_are_refused(window, positions, message):
    with pytest.raises(ValueError, match=message):
        fit_window(long_batch(), max_reasoning_tokens=window, max_positions=positions)


def test_the_services_window_is_512_by_default_0_for_whole_reasonings_and_never_1(monkeypatch):
    from pydantic import ValidationError

    from service.settings import Settings

    assert Settings(_env_file=None).reasoning_window == 512
    monkeypatch.setenv("COLLAPSE_MONITOR_MAX_REASONING_TOKENS", "0")
    assert Settings(_env_file=None).reasoning_window is None
    with pytest.raises(ValidationError, match="a window of 1 token scores nothing"):
        Settings(_env_file=None, max_reasoning_tokens=1)
