"""TokenBuckets: bursts, steady refill, separate clients, bounded memory; the body parsing budget."""

from __future__ import annotations

import asyncio

import pytest

from service.api.rate_limit import BodyBudget, TokenBuckets
from service.errors import ParsingBusy


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


def test_a_body_past_the_parsing_budget_waits_for_room_then_is_refused_with_retry_after():
    async def scenario() -> list[str]:
        budget = BodyBudget(max_bytes=100, wait_seconds=0.2)
        seen = []
        async with budget.hold(60):
            with pytest.raises(ParsingBusy, match=r"parsing 60 bytes of other request bodies.*max_parsing_bytes=100"):
                async with budget.hold(50):
                    pass  # pragma: no cover - refused before
            async with budget.hold(40):  # fits beside it
                seen.append(f"beside {budget.in_use}")

        async def second() -> None:
            async with budget.hold(80):
                seen.append("second")

        async with budget.hold(80):
            waiting = asyncio.create_task(second())
            await asyncio.sleep(0.05)
            seen.append("first")
        await waiting  # woken once the first let go, well within its wait
        async with budget.hold(10_000):  # larger than the budget: held alone
            seen.append(f"alone {budget.in_use}")
        seen.append(f"after {budget.in_use}")
        return seen

    assert asyncio.run(scenario()) == ["beside 100", "first", "second", "alone 100", "after 0"]
    assert ParsingBusy("x").headers() == {"Retry-After": "1"}
    assert ParsingBusy("x").status == 503
