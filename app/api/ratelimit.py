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
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from fastapi import HTTPException, status


class TokenBucketLimiter:
    """Thread-safe token buckets keyed by API key id (dependencies run in a thread pool)."""

    def __init__(self, rate_per_s: float, burst: int, clock=time.monotonic, max_keys: int = 100_000):
        assert rate_per_s > 0 and burst >= 1, f"rate_per_s must be > 0 and burst >= 1, got {rate_per_s=} {burst=}"
        self.rate_per_s, self.burst, self._clock, self._max_keys = float(rate_per_s), float(burst), clock, max_keys
        self._buckets: dict[Any, tuple[float, float]] = {}  # key -> (tokens, last refill time)
        self._lock = threading.Lock()

    def try_take(self, bucket: Any, cost: float = 1.0) -> float:
        """Take `cost` tokens; returns 0.0 on success, else the seconds until they are available."""
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.get(bucket, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate_per_s)
            if tokens >= cost:
                if len(self._buckets) >= self._max_keys and bucket not in self._buckets:
                    self._buckets.clear()  # bounded memory; a reset only ever grants tokens
                self._buckets[bucket] = (tokens - cost, now)
                return 0.0
            self._buckets[bucket] = (tokens, now)
            return (cost - tokens) / self.rate_per_s

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
