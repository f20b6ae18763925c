"""The per-key token bucket behind the API's 429s (app/api/ratelimit.py), on a controlled clock."""

from __future__ import annotations

import pytest
from fastapi import HTTPException

from app.api.ratelimit import TokenBucketLimiter


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_burst_is_allowed_then_429_with_retry_after_until_refill():
    clock = Clock()
    limiter = TokenBucketLimiter(rate_per_s=2.0, burst=3, clock=clock)
    for _ in range(3):
        limiter.check("key-a")
    with pytest.raises(HTTPException) as exc:
        limiter.check("key-a")
    assert exc.value.status_code == 429
    assert exc.value.headers["Retry-After"] == "1"  # 0.5 s to the next token, rounded up to whole seconds
    clock.t += 0.5
    limiter.check("key-a")  # one token refilled
    with pytest.raises(HTTPException):
        limiter.check("key-a")


def test_keys_have_separate_buckets():
    limiter = TokenBucketLimiter(rate_per_s=1.0, burst=1, clock=Clock())
    limiter.check("key-a")
    limiter.check("key-b")
    with pytest.raises(HTTPException):
        limiter.check("key-a")


def test_refill_never_exceeds_burst_and_retry_after_reflects_the_wait():
    clock = Clock()
    limiter = TokenBucketLimiter(rate_per_s=0.25, burst=2, clock=clock)
    clock.t += 3600  # idle for an hour: still only `burst` tokens
    limiter.check(1)
    limiter.check(1)
    assert limiter.try_take(1) == pytest.approx(4.0)  # 1 token at 0.25/s
    with pytest.raises(HTTPException) as exc:
        limiter.check(1)
    assert exc.value.headers["Retry-After"] == "4"
