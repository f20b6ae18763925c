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
    assert (
        exc.value.headers["Retry-After"] == "1"
    )  # 0.5 s to the next token, rounded up to whole seconds
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


def test_wait_s_peeks_without_taking():
    clock = Clock()
    limiter = TokenBucketLimiter(rate_per_s=0.5, burst=2, clock=clock)
    assert limiter.wait_s("10.0.0.1") == 0.0 and len(limiter) == 0, (
        "a peek at an unseen key creates no state"
    )
    assert limiter.try_take("10.0.0.1") == 0.0
    assert limiter.wait_s("10.0.0.1") == 0.0
    assert limiter.try_take("10.0.0.1") == 0.0
    assert limiter.wait_s("10.0.0.1") == pytest.approx(2.0)
    assert limiter.wait_s("10.0.0.1") == pytest.approx(2.0), "peeking twice took nothing"
    clock.t += 2.0
    assert limiter.wait_s("10.0.0.1") == 0.0


def test_memory_is_bounded_and_the_least_recently_used_bucket_is_forgotten():
    clock = Clock()
    limiter = TokenBucketLimiter(rate_per_s=0.001, burst=1, clock=clock, max_keys=3)
    for client in ("a", "b", "c"):
        assert limiter.try_take(client) == 0.0
    assert limiter.try_take("a") > 0  # a is empty, and now the most recently used
    assert limiter.try_take("d") == 0.0  # evicts b, the least recently used
    assert len(limiter) == 3
    assert limiter.wait_s("a") > 0 and limiter.wait_s("c") > 0 and limiter.wait_s("d") > 0, (
        "recent buckets kept"
    )
    assert limiter.wait_s("b") == 0.0, "b was forgotten: a full bucket again"
    for i in range(1000):
        limiter.try_take(f"flood-{i}")
    assert len(limiter) == 3
