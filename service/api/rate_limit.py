"""Limits of the request path: how many requests a client may send, and how many body bytes are parsed at once.

``TokenBuckets`` is pure bookkeeping (time is passed in), used by the HTTP rate limiter;
``BodyBudget`` is shared by the requests of one event loop. Must not import fastapi.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from service.errors import ParsingBusy

# How long a body waits for its share of the parsing budget before 503: long enough for a few
# large bodies ahead of it to be handled (~5 s each for 30 MB of token ids on a busy machine), inside a
# client's 30 s timeout.
PARSE_WAIT_SECONDS = 20.0


class TokenBuckets:
    """One bucket per key, ``burst`` deep, refilled at ``rate`` per second; at most ``max_keys`` kept.

    A key not seen for a while has a full bucket again, so dropping the least recently used key when
    there are too many loses nothing but memory.
    """

    def __init__(self, rate: float, burst: int, max_keys: int = 10_000) -> None:
        if not rate > 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate} and {burst}")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, when)
        self._lock = threading.Lock()

    def take(self, key: str, now: float) -> float:
        """Takes one token for ``key``; returns 0.0, or the seconds until one is available (refused)."""
        with self._lock:
            tokens, when = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - when) * self.rate)
            wait = 0.0
            if tokens >= 1:
                tokens -= 1
            else:
                wait = (1 - tokens) / self.rate
            self._buckets[key] = (tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return wait


class BodyBudget:
    """Bytes of request bodies being parsed at once, across requests; a request past it waits, then 503.

    Parsing holds several times a body's size (service.api.bodies), so the budget bounds what
    concurrent large bodies can hold together. A body larger than the whole budget is parsed
    alone. Created in the app's lifespan, so that its condition belongs to the serving loop.
    """

    def __init__(self, max_bytes: int, wait_seconds: float = PARSE_WAIT_SECONDS) -> None:
        self.max_bytes = max_bytes
        self.wait_seconds = wait_seconds
        self.in_use = 0
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        share = min(size, self.max_bytes)
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.in_use + share <= self.max_bytes), self.wait_seconds
                )
            except TimeoutError:
                raise ParsingBusy(
                    f"the server is parsing {self.in_use} bytes of other request bodies, its limit "
                    f"(max_parsing_bytes={self.max_bytes}); retry after the Retry-After header"
                ) from None
            self.in_use += share
        try:
            yield
        finally:
            async with self._changed:
                self.in_use -= share
                self._changed.notify_all()
