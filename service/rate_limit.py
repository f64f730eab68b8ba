"""Token buckets: how many requests a client may send, refilled at a steady rate with room for bursts.

Pure bookkeeping (time is passed in), used by the HTTP rate limiter. Must not import fastapi.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


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
