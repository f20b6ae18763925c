"""kafka-python 3.0.12's blocking calls, bounded: `NetworkSelector.run` with a wait that ends.

kafka-python 3 runs its network I/O on one background thread (`NetworkSelector`); a blocking
call of a client (a consumer's `poll`, `commit`, a group join, an admin request) schedules a
coroutine on that thread with `run` and waits for it on a `threading.Event` with no timeout.
If the coroutine never completes or the I/O thread never picks it up, the caller waits forever:
seen in the test suite under load as a trainer's `poll` that hung in `event.wait()` for 10
minutes while the I/O thread sat idle in `select` (upstream: dpkp/kafka-python#3121, fixed after
3.0.12 by bounding that wait, #3123/#3124; no release carries it yet).

`install()` replaces `NetworkSelector.run` with `bounded_run`: the same body, except that the
caller waits in slices of `WAKE_S`; after each slice with no answer it wakes the I/O thread
again (a wake-up it missed then costs `WAKE_S`, not forever), says so in the log every
`WARN_S`, and after `DEADLINE_S` raises `KafkaTimeoutError`, which the roles already handle as a
broker that does not answer (retry, or exit for the supervisor to restart). The deadline is
above every wait kafka-python may legitimately make inside one call (a group join waits up to
`max_poll_interval_ms`, 300 s). `UPSTREAM_RUN_SHA256` is the hash of the method this replaces:
tests/unit/test_kafka_net.py fails when kafka-python changes it, so the copy is re-checked on
every upgrade (drop it once a release bounds the wait itself).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

UPSTREAM_RUN_SHA256 = "491eb51ca4037cb42f8015a08c8bd3da21c8c5b6fa299a110777eb68d13b8dbb"
WAKE_S = 1.0
WARN_S = 60.0
DEADLINE_S = 420.0


def bounded_run(self: Any, coro: Any, *args: Any) -> Any:
    """kafka-python 3.0.12's `NetworkSelector.run`, with the caller's wait bounded (module doc)."""
    from kafka.errors import KafkaTimeoutError

    if self._closed:
        raise RuntimeError("NetworkSelector closed!")
    if self._io_thread is None:
        future = self.call_soon_with_future(coro, *args)
        self.poll(future=future)
        if future.exception is not None:
            raise future.exception
        return future.value
    elif threading.current_thread() is self._io_thread:
        raise RuntimeError(
            "Cannot block on net.run() from the IO thread itself. "
            "This typically happens when a synchronous rebalance listener "
            "(or another IO-thread callback) calls a blocking consumer/admin API. "
            "Use AsyncConsumerRebalanceListener and await the async variant, "
            "or move the blocking work to a worker thread."
        )
    elif self._exception:
        raise self._exception from None

    event = threading.Event()
    state: dict[str, Any] = {"value": None, "exception": None}

    async def waiter() -> None:
        try:
            state["value"] = await self._invoke(coro, *args)
        except BaseException as exc:
            # fail_pending_waiters sets 'exception'; dont overwrite
            if state["exception"] is None:
                state["exception"] = exc
            elif not isinstance(exc, GeneratorExit):
                log.warning(
                    "During exception %s, caught additional error %s (ignoring)",
                    state["exception"],
                    exc,
                )
        finally:
            with self._pending_waiters_lock:
                self._pending_waiters.pop(event, None)
            event.set()

    with self._pending_waiters_lock:
        self._pending_waiters[event] = state
    self.call_soon_threadsafe(waiter)
    # --- the change: a bounded wait, waking the I/O thread again while it lasts ---
    started = time.monotonic()
    warned = started
    while not event.wait(WAKE_S):
        now = time.monotonic()
        if now - started >= DEADLINE_S:
            with self._pending_waiters_lock:
                self._pending_waiters.pop(event, None)
            raise KafkaTimeoutError(
                f"kafka-python's network thread did not complete {getattr(coro, '__name__', coro)!r} "
                f"within {DEADLINE_S:.0f}s (app/infra/kafka_net.py)"
            )
        if now - warned >= WARN_S:
            warned = now
            log.warning(
                "kafka-python call %r still waiting for its network thread after %.0fs",
                getattr(coro, "__name__", coro),
                now - started,
            )
        self.wakeup()
    # --- end of the change ---
    if state["exception"] is not None:
        raise state["exception"]
    return state["value"]


def install() -> None:
    """Replace `NetworkSelector.run` with `bounded_run` (idempotent)."""
    from kafka.net.selector import NetworkSelector

    if NetworkSelector.run is not bounded_run:
        NetworkSelector._flywheel_stock_run = NetworkSelector.run  # type: ignore[attr-defined]
        NetworkSelector.run = bounded_run  # type: ignore[method-assign]
