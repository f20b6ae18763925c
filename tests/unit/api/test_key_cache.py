"""The API's key cache (app/api/main.py KeyCache) on a controlled clock: the revocation bound is
counted from the start of the lookup, refused tokens are remembered, one lookup per token at a
time, and every cache is bounded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime

from app.api.main import KeyCache


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Row:  # the two attributes KeyCache reads of an ApiKey
    id: int
    revoked_at: datetime | None = None


class Db:
    """An in-memory key table with a lookup the test can hold open (to model a slow database)."""

    def __init__(self, clock: Clock, rows: dict[str, Row]):
        self.clock, self.rows, self.calls, self.gate = clock, rows, 0, None

    async def lookup(self, token: str) -> Row | None:
        self.calls += 1
        row = self.rows.get(token)
        row = None if row is None else Row(row.id, row.revoked_at)  # the snapshot the query saw
        if self.gate is not None:
            await self.gate.wait()
        return row


def run(coro):
    return asyncio.run(coro)


async def settle(n: int = 10) -> None:
    """Let the scheduled tasks run up to their next real wait."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_valid_key_is_served_from_cache_for_ttl_then_looked_up_again():
    clock = Clock()
    db = Db(clock, {"k": Row(1)})
    cache = KeyCache(ttl_s=1.0, clock=clock)

    async def go():
        assert cache.get("k") is None
        row, reason = await cache.resolve("k", db.lookup)
        assert row.id == 1 and reason is None and db.calls == 1
        clock.t += 0.99
        assert cache.get("k").id == 1
        clock.t += 0.01
        assert cache.get("k") is None, "stale after ttl_s"
        assert cache.known("k"), "still known (for a throttled client address) after it went stale"
        db.rows["k"].revoked_at = datetime.now(UTC)
        row, reason = await cache.resolve("k", db.lookup)
        assert row is None and reason == "revoked" and db.calls == 2
        assert not cache.known("k") and cache.refusal("k") == "revoked"

    run(go())


def test_the_bound_counts_from_the_start_of_a_slow_lookup():
    """A lookup that read the key before it was revoked cannot keep it alive past start + ttl_s."""
    clock = Clock()
    db = Db(clock, {"k": Row(1)})
    cache = KeyCache(ttl_s=1.0, clock=clock)

    async def go():
        db.gate = asyncio.Event()
        pending = asyncio.ensure_future(cache.resolve("k", db.lookup))
        await settle()  # the lookup starts at t=100 and reads the active row
        assert db.calls == 1
        db.rows["k"].revoked_at = datetime.now(UTC)
        clock.t += 0.8  # the database is slow
        db.gate.set()
        row, _ = await pending
        assert row is not None  # what the lookup read
        clock.t += 0.2  # 1.0 s after the lookup started, 0.2 s after it returned
        assert cache.get("k") is None, "entry must expire ttl_s after the lookup *started*"

    run(go())


def test_concurrent_requests_share_one_lookup_but_not_an_older_one_than_ttl():
    clock = Clock()
    db = Db(clock, {"k": Row(1)})
    cache = KeyCache(ttl_s=1.0, clock=clock)

    async def go():
        db.gate = asyncio.Event()
        first = [asyncio.ensure_future(cache.resolve("k", db.lookup)) for _ in range(50)]
        await settle()
        assert db.calls == 1, "50 concurrent misses of one token must make one lookup"
        clock.t += (
            1.0  # that lookup is now as old as ttl_s: a request arriving now must not join it
        )
        late = asyncio.ensure_future(cache.resolve("k", db.lookup))
        await settle()
        assert db.calls == 2
        db.gate.set()
        results = await asyncio.gather(*first, late)
        assert all(row.id == 1 for row, _ in results)

    run(go())


def test_a_failed_lookup_reaches_every_waiter_and_is_not_cached():
    clock = Clock()
    cache = KeyCache(ttl_s=1.0, clock=clock)
    calls = 0

    async def broken(token):
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        raise ConnectionError("database down")

    async def go():
        results = await asyncio.gather(
            *(cache.resolve("k", broken) for _ in range(3)), return_exceptions=True
        )
        assert calls == 1 and all(isinstance(r, ConnectionError) for r in results)
        assert cache.get("k") is None and cache.refusal("k") is None
        await asyncio.gather(cache.resolve("k", broken), return_exceptions=True)
        assert calls == 2, "the next request tries again"

    run(go())


def test_unknown_tokens_are_remembered_for_the_negative_ttl():
    clock = Clock()
    db = Db(clock, {})
    cache = KeyCache(ttl_s=1.0, negative_ttl_s=30.0, clock=clock)

    async def go():
        assert await cache.resolve("guess", db.lookup) == (None, "unknown")
        clock.t += 29.9
        assert cache.refusal("guess") == "unknown"
        clock.t += 0.1
        assert cache.refusal("guess") is None

    run(go())


def test_ttl_zero_looks_up_every_time():
    clock = Clock()
    db = Db(clock, {"k": Row(1)})
    cache = KeyCache(ttl_s=0.0, clock=clock)

    async def go():
        for _ in range(3):
            assert (await cache.resolve("k", db.lookup))[0].id == 1
            assert cache.get("k") is None
        assert db.calls == 3

    run(go())


def test_each_cache_holds_at_most_max_entries():
    clock = Clock()
    db = Db(clock, {f"k{i}": Row(i) for i in range(5)})
    cache = KeyCache(ttl_s=10.0, negative_ttl_s=10.0, max_entries=3, clock=clock)

    async def go():
        for i in range(5):
            await cache.resolve(f"k{i}", db.lookup)
        for i in range(1000):
            await cache.resolve(f"guess{i}", db.lookup)
        assert len(cache) == 6, "3 valid + 3 refused"
        assert cache.get("k0") is None and cache.get("k4").id == 4, (
            "the oldest valid entries were evicted"
        )
        assert cache.refusal("guess0") is None and cache.refusal("guess999") == "unknown"

    run(go())
