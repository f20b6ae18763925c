"""Faust's aiokafka consumer with a per-record delivery path that does not spawn tasks.

    app = faust.App(...)
    install(app)          # before the app's first use of `app.transport` (app.topic does that)

Why. Faust's fetch loop (`Consumer._drain_messages`) hands every record to the conductor with

    await self.wait_first(callback(message), self.suspend_flow.wait())

so that a delivery blocked by back-pressure is abandoned when a rebalance suspends the flow.
`wait_first` wraps both coroutines and the service's stopped/crashed events in four asyncio
tasks and an `asyncio.wait` — for every record, although the delivery almost never blocks (it
blocks only while flow control is suspended, the producer buffer is above its high-water mark,
a stream buffer is full or the conductor is resubscribing). On this project's 2-core machines
that task churn was the largest single cost of a streams worker (python -m bench.streams --profile):
a bare Faust agent that only counts records topped out at 5–6k records/s.

How. `EagerDrainConsumer._drain_messages` is Faust 0.15.3's loop with one change: it steps the
delivery coroutine synchronously first (what Python 3.12's eager tasks do). If the delivery
completes without suspending — the common case — no task is created. If it suspends, the rest
of it runs as a task under exactly Faust's `wait_first(…, suspend_flow.wait())`, so a blocked
delivery is still abandoned (cancelled) when the flow is suspended, the consumer stops or it
crashes, as before. A delivery that was already suspended behaves the same in both versions:
Faust's task would also have started the delivery before looking at the suspend event.

`finish_stepped` is the part that continues a coroutine after its first synchronous step; it
replicates asyncio's Task stepping (tests/unit/streams/test_consumer.py checks results,
exceptions and cancellation against plain tasks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, cast

import faust
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka
from mode import Service, ServiceT
from prometheus_client import Counter

# What `EagerDrainConsumer._drain_messages` copies: the function, the faust-streaming release
# the copy was made from, and the SHA-256 of that function's source (`inspect.getsource`).
# tests/unit/streams/test_faust_copy.py fails when the installed Faust's source differs.
FAUST_COPIED_FUNCTION = "faust.transport.consumer.Consumer._drain_messages"
FAUST_COPIED_VERSION = "0.15.3"
FAUST_COPIED_SOURCE_SHA256 = "44a2500309e83c630493f6828af50166ec8d96a0b3e4fb2bab735f704ae93417"

_PENDING = object()
SUSPENDED = Counter(
    "flywheel_streams_deliveries_suspended_total",
    "Fetched records whose delivery to the agent had to wait (back-pressure, flow control, "
    "resubscription) and went through Faust's wait_first",
)


def step(coro: Coroutine[Any, Any, Any]) -> tuple[Any, Any]:
    """Run `coro` until it first suspends: `(result, _PENDING)` when it finished, else
    `(_PENDING, yielded)` where `yielded` is the future it waits on (None for a bare yield)."""
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return stop.value, _PENDING
    return _PENDING, yielded


def _is_outcome_of(fut: asyncio.Future, exc: BaseException) -> bool:
    """Whether `exc` is `fut`'s own outcome (rather than a cancellation aimed at our task)."""
    if not fut.done():
        return False
    if fut.cancelled():
        return isinstance(exc, asyncio.CancelledError)
    return fut.exception() is exc


async def finish_stepped(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    """Continue `coro`, which was stepped by `step` and is suspended on `yielded`, to its end.

    Mirrors asyncio.Task.__step: once the awaited future is done, the coroutine is resumed
    with `send(None)` and reads the future's result or exception itself; a cancellation of the
    task running this (while the future is still pending or already done) is thrown into it.
    """
    while True:
        try:
            if yielded is None:
                await asyncio.sleep(0)  # a bare `yield`: the coroutine gives the loop one turn
            else:
                if getattr(yielded, "_asyncio_future_blocking", None) is None:
                    raise RuntimeError(
                        f"coroutine yielded {yielded!r}, which is not an asyncio future"
                    )
                yielded._asyncio_future_blocking = False  # taken over, as Task.__step does
                await yielded
        except BaseException as exc:
            if yielded is not None and _is_outcome_of(yielded, exc):
                resume = coro.send, None
            else:
                resume = coro.throw, exc
        else:
            resume = coro.send, None
        try:
            yielded = resume[0](resume[1])
        except StopIteration as stop:
            return stop.value


class EagerDrainConsumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer whose fetch loop delivers records without per-record tasks."""

    async def _drain_messages(
        self, fetcher: ServiceT
    ) -> None:  # pragma: no cover - exercised on the broker
        # Faust 0.15.3 faust/transport/consumer.py Consumer._drain_messages, except the marked lines.
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = cast(Service, self)._stopped.is_set
        fetcher_should_stop = cast(Service, fetcher)._stopped.is_set

        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        flag_consumer_fetching = CONSUMER_FETCHING
        set_flag = self.diag.set_flag
        unset_flag = self.diag.unset_flag
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for

        yield_every = 100
        num_since_yield = 0
        sleep = asyncio.sleep

        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(flag_consumer_fetching)
                ait = cast(AsyncIterator, getmany(timeout=1.0))
                await self.sleep(0)
                if not self.should_stop:
                    async for tp, message in ait:
                        num_since_yield += 1
                        if num_since_yield > yield_every:
                            await sleep(0)
                            num_since_yield = 0

                        offset = message.offset
                        r_offset = get_read_offset(tp)
                        if r_offset is None or offset >= r_offset:
                            gap = offset - (r_offset or 0)
                            if gap > 1 and r_offset:
                                if acks_enabled_for(message.topic):
                                    await self._add_gap(tp, r_offset + 1, offset)
                            if commit_every is not None:
                                if self._n_acked >= commit_every:
                                    self._n_acked = 0
                                    await self.commit()
                            # changed: step the delivery synchronously; only a delivery that
                            # suspends goes through Faust's wait_first (and its tasks)
                            delivery = callback(message)
                            _, yielded = step(delivery)
                            if yielded is not _PENDING:
                                SUSPENDED.inc()
                                await self.wait_first(
                                    finish_stepped(delivery, yielded), self.suspend_flow.wait()
                                )
                            set_read_offset(tp, offset)
                        else:
                            self.log.dev(
                                "DROPPED MESSAGE ROFF %r: k=%r v=%r",
                                offset,
                                message.key,
                                message.value,
                            )
                    unset_flag(flag_consumer_fetching)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            unset_flag(flag_consumer_fetching)


class EagerDrainTransport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with `EagerDrainConsumer`."""

    Consumer = EagerDrainConsumer


def install(app: faust.App) -> None:
    """Make `app` consume through `EagerDrainTransport` (call before anything uses app.transport)."""
    assert app._transport is None, "install() must run before the app creates its transport"
    app.transport = EagerDrainTransport(app.conf.broker_consumer, app)
