"""Per-key token-bucket rate limit for the HTTP API.

Each API key owns a bucket of `burst` tokens that refills at `rate_per_s` tokens per second;
every authenticated request takes one token. An empty bucket answers 429 with a
`Retry-After` header (whole seconds, at least 1) saying when the next token will be there.

`require_scope()` (app/api/deps.py) calls `app.state.rate_limiter.check(key)` after the
scope check, so every scoped endpoint is limited the same way. Buckets live in process
memory: with N API processes behind a balancer the effective limit is N times the setting,
which is the usual trade for not putting a shared store on the hot path.

    limiter = TokenBucketLimiter(rate_per_s=200, burst=400)
    limiter.check(api_key_row)     # raises HTTPException(429) when over the limit

The same bucket, keyed by client address, budgets failed authentications
(`app.state.auth_throttle`, used by app/api/deps.py): each failure takes a token, and an
address with an empty bucket gets 429 instead of 401 (`wait_s` peeks without taking).

Memory is bounded: at most `max_keys` buckets; past it the least recently used bucket is
forgotten, which only ever grants tokens, and a bucket idle for `burst / rate_per_s`
seconds is full again anyway, so forgetting it changes nothing.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Any

from fastapi import HTTPException, status


class TokenBucketLimiter:
    """Thread-safe token buckets keyed by anything hashable (an API key id, a client address)."""

    def __init__(
        self, rate_per_s: float, burst: int, clock=time.monotonic, max_keys: int = 100_000
    ):
        assert rate_per_s > 0 and burst >= 1, (
            f"rate_per_s must be > 0 and burst >= 1, got {rate_per_s=} {burst=}"
        )
        assert max_keys >= 1, f"max_keys must be >= 1, got {max_keys}"
        self.rate_per_s, self.burst, self._clock, self._max_keys = (
            float(rate_per_s),
            float(burst),
            clock,
            max_keys,
        )
        self._buckets: OrderedDict[Any, tuple[float, float]] = (
            OrderedDict()
        )  # key -> (tokens, last refill), LRU order
        self._lock = threading.Lock()

    def _tokens(self, bucket: Any, now: float) -> float:
        tokens, last = self._buckets.get(bucket, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate_per_s)

    def wait_s(self, bucket: Any, cost: float = 1.0) -> float:
        """Seconds until `cost` tokens are available (0.0: now), without taking any."""
        if bucket not in self._buckets:  # lock-free fast path: a key that never spent is full
            return 0.0
        with self._lock:
            return max(0.0, (cost - self._tokens(bucket, self._clock())) / self.rate_per_s)

    def try_take(self, bucket: Any, cost: float = 1.0) -> float:
        """Take `cost` tokens; returns 0.0 on success, else the seconds until they are available."""
        now = self._clock()
        with self._lock:
            tokens = self._tokens(bucket, now)
            wait = 0.0 if tokens >= cost else (cost - tokens) / self.rate_per_s
            self._buckets[bucket] = (tokens - cost if wait == 0.0 else tokens, now)
            self._buckets.move_to_end(bucket)
            while len(self._buckets) > self._max_keys:
                self._buckets.popitem(
                    last=False
                )  # the least recently used: forgetting it only grants tokens
            return wait

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self, key: Any) -> None:
        """Charge one request to `key` (an ApiKey row, or anything with an `id`); 429 when empty."""
        wait_s = self.try_take(getattr(key, "id", key))
        if wait_s > 0:
            from app.api.metrics import RATE_LIMITED

            RATE_LIMITED.inc()
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                f"rate limit exceeded for this key ({self.rate_per_s:g} requests/s, burst {self.burst:g}); "
                f"retry after {wait_s:.2f}s",
                headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
            )
