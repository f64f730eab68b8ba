"""service/loops.py's Backoff against the schedule written out by hand."""

from __future__ import annotations

import pytest

from service.loops import ROUND_BACKOFF, Backoff


@pytest.mark.parametrize(("failures", "seconds"), [(1, 0.5), (2, 1.0), (3, 2.0), (4, 2.0), (30, 2.0)])
def test_a_failed_round_waits_doubling_up_to_the_cap_without_the_jitter(failures, seconds):
    assert ROUND_BACKOFF.delay(failures, uniform=lambda: 0.0) == seconds


def test_the_jitter_lengthens_a_delay_by_up_to_its_share_and_no_more():
    backoff = Backoff(first_seconds=1.0, max_seconds=8.0, jitter=0.25)
    assert backoff.delay(3, uniform=lambda: 0.0) == 4.0
    assert backoff.delay(3, uniform=lambda: 0.5) == 4.5
    assert backoff.delay(3, uniform=lambda: 0.999) == pytest.approx(4.999)
    draws = {backoff.delay(1) for _ in range(50)}
    assert len(draws) > 1  # drawn, not one fixed delay for every process
    assert all(1.0 <= d < 1.25 for d in draws)


def test_no_jitter_is_the_plain_schedule():
    assert [Backoff(2.0, 50.0).delay(n) for n in (1, 2, 3, 5, 6)] == [2.0, 4.0, 8.0, 32.0, 50.0]
