"""The generation queue (app/replica/admission.py) on a real one-worker thread pool: bounds refuse at
once, queued requests still run, short requests go before long ones that have not aged, a request
whose client left costs no model call, and cancellation never frees a thread that is still busy."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import REGISTRY

from app.replica.admission import ClientGone, GenerationQueue, QueueFull


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Gate:
    """A model call that blocks until opened, so the test controls when the thread is busy."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, tag: str = "gate") -> str:
        self.started.set()
        assert self.release.wait(30), "gate never opened"
        return tag


async def _until(pred, what: str) -> None:
    for _ in range(3000):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _metric(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_bounds_refuse_at_once_and_the_queued_requests_still_complete():
    async def main() -> None:
        pool = ThreadPoolExecutor(1)
        q = GenerationQueue("rq-bounds", pool, max_queued=2, max_queued_cost=100)
        gate, done = Gate(), []
        busy = asyncio.create_task(q.run(10, gate, "first"))
        await _until(gate.started.is_set, "the first call to start")
        waiting = [asyncio.create_task(q.run(40, done.append, f"w{i}")) for i in range(2)]
        await _until(lambda: q.depth == 2, "two queued")
        assert _metric("flywheel_replica_queue_depth", replica_id="rq-bounds") == 2
        assert _metric("flywheel_replica_queue_cost", replica_id="rq-bounds") == 80

        with pytest.raises(QueueFull) as by_count:
            await q.run(1, done.append, "refused")
        assert by_count.value.reason == "requests" and by_count.value.retry_after_s >= 1
        assert "2 requests are already queued" in by_count.value.detail

        q.max_queued = 5
        with pytest.raises(QueueFull) as by_cost:
            await q.run(30, done.append, "too costly")  # 80 + 30 > 100
        assert by_cost.value.reason == "cost"
        assert (
            _metric(
                "flywheel_replica_queue_rejections_total", replica_id="rq-bounds", reason="requests"
            )
            == 1
        )
        assert (
            _metric(
                "flywheel_replica_queue_rejections_total", replica_id="rq-bounds", reason="cost"
            )
            == 1
        )

        gate.release.set()
        assert await busy == "first"
        await asyncio.gather(*waiting)
        assert sorted(done) == ["w0", "w1"], "the refused requests never ran"
        assert q.depth == 0 and _metric("flywheel_replica_queue_depth", replica_id="rq-bounds") == 0
        assert _metric("flywheel_replica_queue_wait_seconds_count", replica_id="rq-bounds") == 3
        pool.shutdown()

    run(main())


def test_a_short_request_goes_before_long_ones_that_arrived_earlier():
    async def main() -> None:
        pool = ThreadPoolExecutor(1)
        clock = FakeClock()
        q = GenerationQueue(
            "rq-order",
            pool,
            max_queued=16,
            max_queued_cost=10_000,
            initial_s_per_cost=0.01,
            clock=clock,
        )
        gate, order = Gate(), []
        busy = asyncio.create_task(q.run(500, gate))
        await _until(gate.started.is_set, "the first call")
        longs = []
        for i in range(4):
            clock.t += 0.1
            longs.append(asyncio.create_task(q.run(500, order.append, f"long{i}")))
            await asyncio.sleep(0)
        clock.t += 0.1
        short = asyncio.create_task(q.run(1, order.append, "short"))
        await _until(lambda: q.depth == 5, "five queued")
        gate.release.set()
        await asyncio.gather(busy, short, *longs)
        assert order == ["short", "long0", "long1", "long2", "long3"], order
        pool.shutdown()

    run(main())


def test_a_long_request_that_waited_a_full_queue_drain_is_overdue_and_goes_before_new_short_ones():
    async def main() -> None:
        pool = ThreadPoolExecutor(1)
        clock = FakeClock()
        q = GenerationQueue(
            "rq-aging",
            pool,
            max_queued=16,
            max_queued_cost=1000,
            initial_s_per_cost=0.01,
            clock=clock,
        )
        assert q.overdue_after_s() == pytest.approx(10.0)  # 1000 cost units at 0.01 s each
        gate, order = Gate(), []
        busy = asyncio.create_task(q.run(1100, gate))  # runs the 11 s below: s_per_cost stays 0.01
        await _until(gate.started.is_set, "the first call")
        long = asyncio.create_task(q.run(500, order.append, "long"))
        await _until(lambda: q.depth == 1, "long queued")
        clock.t += 11.0  # it has now waited longer than a full queue takes to drain
        short = asyncio.create_task(q.run(1, order.append, "short"))
        await _until(lambda: q.depth == 2, "short queued")
        gate.release.set()
        await asyncio.gather(busy, long, short)
        assert order == ["long", "short"], order
        pool.shutdown()

    run(main())


def test_a_request_whose_client_left_costs_no_model_call():
    async def main() -> None:
        pool = ThreadPoolExecutor(1)
        q = GenerationQueue("rq-gone", pool, max_queued=4, max_queued_cost=100)
        gate, calls = Gate(), []
        busy = asyncio.create_task(q.run(1, gate))
        await _until(gate.started.is_set, "the first call")

        async def gone() -> bool:
            return False

        left = asyncio.create_task(q.run(5, calls.append, "left", still_wanted=gone))
        stays = asyncio.create_task(q.run(5, calls.append, "stays"))
        await _until(lambda: q.depth == 2, "two queued")
        gate.release.set()
        await busy
        with pytest.raises(ClientGone):
            await left
        await stays
        assert calls == ["stays"]
        pool.shutdown()

    run(main())


def test_cancelling_a_waiting_request_leaves_the_queue_and_a_running_one_holds_the_thread_until_it_returns():
    async def main() -> None:
        pool = ThreadPoolExecutor(1)
        q = GenerationQueue("rq-cancel", pool, max_queued=4, max_queued_cost=100)
        gate, calls = Gate(), []
        busy = asyncio.create_task(q.run(1, gate))
        await _until(gate.started.is_set, "the first call")
        waiting = asyncio.create_task(q.run(5, calls.append, "cancelled"))
        await _until(lambda: q.depth == 1, "one queued")
        waiting.cancel()
        await _until(lambda: q.depth == 0, "the cancelled request to leave the queue")

        busy.cancel()  # the model call keeps running in its thread
        nxt = asyncio.create_task(q.run(5, calls.append, "next"))
        await asyncio.sleep(0.2)
        assert calls == [] and q.depth == 1, "the thread is still busy: the next request must wait"
        gate.release.set()
        await nxt
        assert calls == ["next"]
        pool.shutdown()

    run(main())


def test_with_several_slots_that_many_calls_run_at_once_and_the_bounds_count_the_rest():
    """An engine that batches concurrent requests itself (vLLM) gets `slots` model calls at once;
    the queue's bounds then apply to the requests waiting beyond them, and a freed slot goes to the
    next waiting one."""

    async def main() -> None:
        pool = ThreadPoolExecutor(2)
        q = GenerationQueue("rq-slots", pool, max_queued=1, max_queued_cost=100, slots=2)
        a, b, c = Gate(), Gate(), Gate()
        ta = asyncio.create_task(q.run(10, a, "a"))
        tb = asyncio.create_task(q.run(10, b, "b"))
        await _until(lambda: a.started.is_set() and b.started.is_set(), "two calls running")
        assert q.depth == 0
        tc = asyncio.create_task(q.run(10, c, "c"))
        await _until(lambda: q.depth == 1, "the third waiting")
        assert not c.started.is_set()
        with pytest.raises(QueueFull) as full:
            await q.run(1, c, "refused")
        assert full.value.reason == "requests"
        b.release.set()
        assert await tb == "b"
        await _until(c.started.is_set, "the third call to take the freed slot")
        a.release.set()
        c.release.set()
        assert await ta == "a" and await tc == "c"
        assert q.depth == 0 and q._running == []
        pool.shutdown()

    run(main())
