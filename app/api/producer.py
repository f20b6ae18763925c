"""An asyncio-friendly wrapper around `app.kafka_io.make_producer` with bounded waits.

The ingest API must answer 202 only after Kafka acknowledged every event of a batch, and
must answer 503 within `settings.kafka_produce_timeout` when the broker is unreachable or
slow, never hang. kafka-python's producer is thread-based: `send()` may block on metadata
or a full buffer (up to `max_block_ms`) and acknowledgements arrive on its sender thread.
So, per batch:

1. the `send()` calls run on a small dedicated thread pool: creating the producer and
   fetching metadata may block, and even a plain `send()` wakes the sender thread through a
   socket, after which the caller waits to get the GIL back; measured on the event loop,
   those waits stalled every other request (cProfile: socket.send ~3 ms per wakeup);
2. each record's future gets a callback that counts acknowledgements and, at the last one
   (or the first failure), resolves an asyncio future through `call_soon_threadsafe`;
3. the coroutine awaits that future with whatever is left of the deadline.

Anything that goes wrong on the Kafka side (cannot bootstrap, metadata timeout, delivery
timeout, broker error) raises `KafkaUnavailable`, which the route turns into 503 +
Retry-After. Records of a failed batch that still reach the broker later are harmless:
clients retry with the same `event_id`s and every consumer dedupes by `event_id`.

The producer is created lazily (in the pool, bounded by the same deadline), so the API
starts and answers 503 while Kafka is down, and recovers by itself when it comes back.

    producer = EventProducer(settings)
    await producer.produce(settings.topic("interactions"), [(request_id, value_bytes), ...])
    await producer.aclose()
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.kafka_io import make_producer
from app.settings import Settings

log = logging.getLogger(__name__)


class KafkaUnavailable(Exception):
    """Kafka could not acknowledge a batch within the deadline; answer 503 with `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _BatchWaiter:
    """Counts per-record acknowledgements (on Kafka's sender thread) into one asyncio future."""

    __slots__ = ("loop", "future", "left", "lock")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int):
        self.loop, self.future, self.left, self.lock = loop, loop.create_future(), n, threading.Lock()

    def ok(self, _metadata: Any) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self._resolve(None)

    def failed(self, exc: BaseException) -> None:
        self._resolve(exc)

    def _resolve(self, exc: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._set, exc)
        except RuntimeError:  # the loop is closed (shutdown); nobody is waiting any more
            pass

    def _set(self, exc: BaseException | None) -> None:
        if self.future.done():
            return
        if exc is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(exc)


class EventProducer:
    """One idempotent, acks=all kafka-python producer shared by all requests of a process."""

    def __init__(self, settings: Settings, send_threads: int = 2, **overrides: Any):
        self.timeout_s = float(settings.kafka_produce_timeout)
        assert self.timeout_s > 0, f"kafka_produce_timeout must be > 0, got {self.timeout_s}"
        self.retry_after_s = max(1, math.ceil(self.timeout_s))
        timeout_ms = max(1, int(self.timeout_s * 1000))
        request_timeout_ms = max(1000, timeout_ms)
        self._settings = settings
        self._overrides = dict(
            bootstrap_timeout_ms=timeout_ms,  # the constructor bootstraps; never longer than a request may wait
            # expire undeliverable records soon after the request gave up on them, so an outage does not
            # leave minutes of stale batches in the buffer (must be >= request_timeout_ms + linger_ms)
            delivery_timeout_ms=request_timeout_ms + 1000,
        )
        self._overrides.update(overrides)
        self._producer = None
        self._generation = 0  # bumped each time a failed producer is discarded
        self._create_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=send_threads, thread_name_prefix="kafka-send")
        self._closed = False

    # --- runs on the send pool --------------------------------------------------------------------
    def _get_producer(self) -> tuple[Any, int]:
        with self._create_lock:
            if self._producer is None:
                if self._closed:
                    raise KafkaUnavailable("the producer is shut down", self.retry_after_s)
                self._producer = make_producer(self._settings, **self._overrides)
                log.info("kafka producer connected to %s", self._settings.kafka_bootstrap)
            return self._producer, self._generation

    def _send_all(self, topic: str, records: list[tuple[str, bytes]], waiter: _BatchWaiter, deadline: float) -> int:
        if time.monotonic() > deadline:  # queued behind a blocked send past its request's deadline: drop it
            raise KafkaUnavailable("send queue is backed up", self.retry_after_s)
        producer, generation = self._get_producer()
        ok, failed = waiter.ok, waiter.failed
        for key, value in records:
            producer.send(topic, value=value, key=key).add_callback(ok).add_errback(failed)
        return generation

    def _discard(self, generation: int) -> None:
        """Replace the producer after a failed batch (if no one replaced it yet).

        kafka-python's idempotent producer can stay stuck after batches expired in flight
        (seen with a broker that hung and resumed); a fresh producer (new producer id)
        recovers at the cost of aborting the other in-flight batches, whose requests answer
        503 and are retried by their clients with the same event_ids.
        """
        with self._create_lock:
            if self._generation != generation or self._producer is None:
                return
            old, self._producer = self._producer, None
            self._generation += 1
        threading.Thread(target=_close_producer, args=(old, 0.0), name="kafka-producer-close", daemon=True).start()

    # --- coroutine API -------------------------------------------------------------------------------
    async def produce(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """Send `(key, value)` records; return once the broker acknowledged all of them.

        Raises KafkaUnavailable when that does not happen within `kafka_produce_timeout`.
        """
        if not records:
            return
        from kafka.errors import KafkaError

        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout_s
        waiter = _BatchWaiter(loop, len(records))
        generation = self._generation
        try:
            sent = loop.run_in_executor(self._pool, self._send_all, topic, records, waiter, deadline)
            generation = await asyncio.wait_for(sent, self.timeout_s)
            await asyncio.wait_for(waiter.future, max(0.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            self._discard(generation)
            raise KafkaUnavailable(
                f"Kafka did not acknowledge the batch within {self.timeout_s:g}s", self.retry_after_s
            ) from None
        except (KafkaError, OSError) as exc:
            self._discard(generation)
            raise KafkaUnavailable(f"Kafka is unavailable: {type(exc).__name__}: {exc}", self.retry_after_s) from None

    async def connect(self) -> None:
        """Create the producer now (at start-up) instead of on the first request; errors are logged."""
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._pool, self._get_producer),
                                   self.timeout_s)
        except Exception as exc:  # Kafka may be down at start-up; requests retry the connection
            log.warning("kafka not reachable at start-up (%s: %s); POST /v1/events answers 503 until it is",
                        type(exc).__name__, exc)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float | None = None) -> None:
        """Flush what is buffered (bounded) and close. Safe to call twice."""
        with self._create_lock:
            self._closed = True
            producer, self._producer = self._producer, None
        if producer is not None:
            _close_producer(producer, self.timeout_s if timeout_s is None else timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)


def _close_producer(producer: Any, timeout_s: float) -> None:
    """Close a kafka-python producer within `timeout_s`, aborting what it could not deliver.

    `KafkaProducer.close()` raises (and leaves its sender thread running) when buffered records
    are still unacknowledged at the timeout; then the sender is force-closed, which fails the
    pending futures, and the close is completed.
    """
    from kafka.errors import KafkaError

    try:
        producer.close(timeout=timeout_s)
        return
    except KafkaError as exc:
        log.warning("kafka producer could not deliver its buffered records within %.1fs (%s); aborting them",
                    timeout_s, exc)
    sender = getattr(producer, "_sender", None)  # kafka-python has no public abort; this is what close() uses
    if sender is not None:
        sender.force_close()
        sender.join(max(timeout_s, 1.0))
    try:
        producer.close(timeout=0)
    except KafkaError as exc:
        log.warning("kafka producer force-close incomplete: %s", exc)
