"""Bounded, cost-aware admission to a replica's generation threads.

    queue = GenerationQueue("replica-1", pool, max_queued=16, max_queued_cost=4096)
    result = await queue.run(cost, fn, *args, still_wanted=client_connected)   # QueueFull, ClientGone
    ticket = queue.admit(cost)                                   # QueueFull now (a stream, before it starts)
    result = await queue.run_admitted(ticket, fn, *args)        # ... the model call later

`slots` model calls run at a time (the thread pool has that many workers): 1 for the built-in engine,
whose policy generates one batch at a time; more for an engine that batches concurrent requests
itself (vLLM's continuous batching, FLYWHEEL_REPLICA_VLLM_CONCURRENCY). Requests that find every
slot busy wait here, in the event loop, never in the executor's own (unbounded) queue:

- **Bounds.** At most `max_queued` requests wait, and the sum of their costs (`n * max_tokens`,
  the tokens they may generate) is at most `max_queued_cost`. A request that would exceed either
  is refused at once with `QueueFull` (the route answers 503 + Retry-After) and costs nothing.
- **Order.** When a slot frees up, the next request is the cheapest waiting one (smallest
  cost, then the earliest), so a 1-token request does not wait behind queued maximal ones;
  except that a request which has waited longer than the time to drain a full queue
  (`max_queued_cost * s_per_cost`) is overdue, and overdue requests go first, oldest first, so
  nothing starves. `s_per_cost` is the measured generation time per cost unit (moving averages
  of model seconds and of cost, seeded by `initial_s_per_cost`).
- **Worst case** (one slot). A request waits for the call running when it arrived (at most one
  maximal request), then for cheaper requests until it is overdue (one full-queue drain, plus the call
  started just before), then for the older overdue ones (at most the queue it arrived behind):
  about `2 * (max_request_cost + max_queued_cost) * s_per_cost` in all. A cheap request
  usually waits just for the running call (docs/REPLICA.md has measured figures).
- **Disconnects.** When its turn comes, a request first awaits `still_wanted()`; if the client
  has gone, `ClientGone` is raised and the thread goes to the next one without generating.
- **Cancellation.** A waiting request that is cancelled leaves the queue; one cancelled while its
  model call runs frees the thread only when that call has returned.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.replica import metrics as m

T = TypeVar("T")


class QueueFull(Exception):
    """The request was refused without generating; retry after `retry_after_s` seconds."""

    def __init__(self, reason: str, detail: str, retry_after_s: int):
        super().__init__(detail)
        self.reason, self.detail, self.retry_after_s = reason, detail, retry_after_s


class ClientGone(Exception):
    """The client disconnected while its request was queued; nothing was generated."""


@dataclass(eq=False)
class Ticket:
    cost: int
    arrived: float
    turn: asyncio.Future = field(repr=False)


class GenerationQueue:
    """Admission, ordering and metrics of the requests waiting for a generation slot."""

    def __init__(
        self,
        replica_id: str,
        pool: Executor,
        *,
        max_queued: int,
        max_queued_cost: int,
        initial_s_per_cost: float = 2e-3,
        max_retry_after_s: int = 60,
        clock: Callable[[], float] = time.monotonic,
        slots: int = 1,
    ):
        assert max_queued >= 0 and max_queued_cost >= 1, f"bounds {max_queued}, {max_queued_cost}"
        assert initial_s_per_cost > 0, f"initial_s_per_cost must be > 0, got {initial_s_per_cost}"
        assert slots >= 1, f"slots must be >= 1, got {slots}"
        self.slots = slots
        self.replica_id, self.pool = replica_id, pool
        self.max_queued, self.max_queued_cost = max_queued, max_queued_cost
        self.s_per_cost = initial_s_per_cost
        self._avg_cost, self._avg_seconds = 256.0, 256.0 * initial_s_per_cost
        self.max_retry_after_s = max_retry_after_s
        self.clock = clock
        self._queued: list[Ticket] = []
        self._running: list[int] = []  # costs of the calls running now (at most `slots`)
        self._publish()

    # --- state ------------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Requests waiting (not counting the one running)."""
        return len(self._queued)

    @property
    def queued_cost(self) -> int:
        return sum(t.cost for t in self._queued)

    def retry_after_s(self) -> int:
        """Seconds until the work ahead now is expected to be done (1..max_retry_after_s)."""
        ahead = self.queued_cost + sum(self._running)
        return max(1, min(self.max_retry_after_s, math.ceil(ahead * self.s_per_cost / self.slots)))

    def _publish(self) -> None:
        m.QUEUE_DEPTH.labels(self.replica_id).set(self.depth)
        m.QUEUE_COST.labels(self.replica_id).set(self.queued_cost)

    # --- admission and order ----------------------------------------------------------------------
    def _admit(self, cost: int) -> Ticket:
        assert cost >= 1, f"cost must be >= 1, got {cost}"
        if len(self._running) >= self.slots:  # busy: the request has to wait, if there is room
            if self.depth >= self.max_queued:
                self._refuse(
                    "requests",
                    f"{self.depth} requests are already queued (at most {self.max_queued})",
                )
            if self.queued_cost + cost > self.max_queued_cost:
                self._refuse(
                    "cost",
                    f"queued requests may generate {self.queued_cost} tokens; this one "
                    f"({cost}) would exceed the bound of {self.max_queued_cost}",
                )
        ticket = Ticket(cost, self.clock(), asyncio.get_running_loop().create_future())
        self._queued.append(ticket)
        self._dispatch()
        self._publish()
        return ticket

    def _refuse(self, reason: str, detail: str) -> None:
        m.QUEUE_REJECTIONS.labels(self.replica_id, reason).inc()
        raise QueueFull(reason, f"generation queue full: {detail}", self.retry_after_s())

    def overdue_after_s(self) -> float:
        """How long a request may wait before it goes ahead of cheaper ones: one full-queue drain."""
        return self.max_queued_cost * self.s_per_cost / self.slots

    def _dispatch(self) -> None:
        """Give each free slot to the oldest overdue request, else to the cheapest waiting one."""
        self._queued = [t for t in self._queued if not t.turn.done()]  # cancelled while waiting
        now, overdue_after = self.clock(), self.overdue_after_s()

        def order(t: Ticket) -> tuple[int, float, float]:
            return (
                (0, t.arrived, 0.0) if now - t.arrived >= overdue_after else (1, t.cost, t.arrived)
            )

        while len(self._running) < self.slots and self._queued:
            nxt = min(self._queued, key=order)
            self._queued.remove(nxt)
            self._running.append(nxt.cost)
            nxt.turn.set_result(None)

    def _release(self, cost: int) -> None:
        self._running.remove(cost)
        self._dispatch()
        self._publish()

    # --- the entry points -------------------------------------------------------------------------
    def admit(self, cost: int) -> Ticket:
        """Take a place in the queue now (QueueFull if there is none), to `run_admitted` later in
        the same event loop: a streamed response learns whether it was admitted before it starts."""
        return self._admit(cost)

    async def run(
        self,
        cost: int,
        fn: Callable[..., T],
        *args: Any,
        still_wanted: Callable[[], Awaitable[bool]] | None = None,
    ) -> T:
        """Wait for the thread (or raise QueueFull at once), then run `fn(*args)` on it."""
        return await self.run_admitted(self._admit(cost), fn, *args, still_wanted=still_wanted)

    async def run_admitted(
        self,
        ticket: Ticket,
        fn: Callable[..., T],
        *args: Any,
        still_wanted: Callable[[], Awaitable[bool]] | None = None,
    ) -> T:
        """`run` for a request already admitted with `admit`."""
        cost = ticket.cost
        try:
            await ticket.turn
        except asyncio.CancelledError:
            if ticket in self._queued:
                self._queued.remove(ticket)
                self._publish()
            elif ticket.turn.done() and not ticket.turn.cancelled():
                self._release(cost)  # the turn was granted just before the cancellation
            raise
        m.QUEUE_WAIT_SECONDS.labels(self.replica_id).observe(self.clock() - ticket.arrived)
        try:
            if still_wanted is not None and not await still_wanted():
                raise ClientGone()
        except BaseException:
            self._release(cost)
            raise
        t0 = self.clock()
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

        def _done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self._learn(cost, self.clock() - t0)
            self._release(cost)

        fut.add_done_callback(
            _done
        )  # frees the thread when the call returns, even if we are cancelled
        return await asyncio.shield(fut)

    def _learn(self, cost: int, seconds: float) -> None:
        """Moving averages of model seconds and of cost, so a long call weighs more than a short one's
        fixed overhead."""
        self._avg_cost = 0.8 * self._avg_cost + 0.2 * cost
        self._avg_seconds = 0.8 * self._avg_seconds + 0.2 * max(seconds, 0.0)
        self.s_per_cost = max(self._avg_seconds / self._avg_cost, 1e-7)
