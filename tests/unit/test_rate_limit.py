"""TokenBuckets: bursts, steady refill, separate clients, bounded memory."""

from __future__ import annotations

import pytest

from service.rate_limit import TokenBuckets


def test_a_burst_passes_then_requests_wait_for_the_refill():
    buckets = TokenBuckets(rate=2.0, burst=3)
    assert [buckets.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a", 0.0) == pytest.approx(0.5)  # one token every half second
    assert buckets.take("a", 0.25) == pytest.approx(0.25)  # refused requests take nothing
    assert buckets.take("a", 0.5) == 0.0
    assert buckets.take("a", 10.0) == 0.0  # refilled, but never beyond the burst
    assert [buckets.take("a", 10.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.5)]


def test_clients_have_buckets_of_their_own_and_idle_ones_are_forgotten():
    buckets = TokenBuckets(rate=1.0, burst=1, max_keys=2)
    assert buckets.take("a", 0.0) == 0.0
    assert buckets.take("b", 0.0) == 0.0
    assert buckets.take("a", 0.0) == pytest.approx(1.0)
    assert buckets.take("c", 0.0) == 0.0  # evicts b, the least recently used
    assert len(buckets._buckets) == 2
    assert buckets.take("b", 0.0) == 0.0  # a forgotten client starts full, as if it had been idle


def test_nonsense_limits_are_refused():
    with pytest.raises(ValueError, match="rate must be > 0 and burst >= 1"):
        TokenBuckets(rate=0, burst=1)
