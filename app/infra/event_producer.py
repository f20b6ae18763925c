"""The asyncio Kafka producer of `<ns>.interactions` (the ingest API's events, the replicas'
generations): asyncio-native (aiokafka), acks=all + idempotent, bounded waits.

The ingest API must answer 202 only after Kafka acknowledged every event of a batch, and
503 within `settings.kafka_produce_timeout` when the broker is unreachable, hung or slow,
never hang. Per batch, `produce()` hands every record to the producer and awaits all their
acknowledgements under one deadline (`asyncio.wait_for`). Two kinds of failure:

- `RecordRejected`: a record of THIS batch cannot be written whatever the broker's state
  (over the record limit, corrupt): the route answers 413/422 naming the event, the client
  must not retry it as-is, and the shared producer is left alone. Record sizes are checked
  against `max_request_size` (= the interactions topic's `max.message.bytes`,
  app/contracts/topics.py) before anything of the batch is sent, so a batch the broker would refuse
  for its size is never sent: such a refusal would also spend an idempotent sequence number
  the broker never saw and break the partition for every later batch. At start-up
  (`connect()`) the topic's actual limit is read from the broker, and a smaller one (a
  cluster configured by hand) lowers the check to it.
- `KafkaUnavailable`: anything else on the Kafka side (timeout, connection, broker error):
  the route answers 503 + Retry-After and the client retries with the same event_ids.

After a `KafkaUnavailable` the producer is replaced by a fresh one (new producer id) for the
next requests, so a producer stuck on batches that expired in flight (seen with a broker that
hung and resumed) cannot keep failing. The replaced one is not aborted: it keeps serving the
requests that already hold it and is flushed and stopped in the background once the last of
them is done, so one request's failure never fails another request's batch. The producer is
created lazily under the same deadline, so the API starts and answers 503 while Kafka is
down, and recovers by itself when it is back.

Why aiokafka here and kafka-python (`app.infra.kafka.make_producer`) elsewhere: the API is one
asyncio process. kafka-python's producer is thread-based; on the event loop each `send()`
that starts a new batch wakes the sender thread through a socket and then waits to get the
GIL back (cProfile: ~3 ms per wakeup), and moving sends to a thread pool cost more GIL
traffic. aiokafka runs on the event loop itself, builds record batches in C, and measured
27 CPU-us per 1 KB event against kafka-python's 57 (same broker, acks=all, idempotent,
100-record batches). Its options come from app/infra/kafka.py (`aio_producer_options`: the
same acks=all, idempotence, linger and batch size as `make_producer`); keys are partitioned with the same murmur2 partitioner as
kafka-python and Java clients, so a request_id lands on the same partition whoever
produced it.

    producer = EventProducer(settings)
    await producer.produce(settings.topic("interactions"), [(request_id, value_bytes), ...])
    await producer.aclose()
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from app.infra.kafka import aio_producer_options
from app.settings import Settings

log = logging.getLogger(__name__)


class KafkaUnavailable(Exception):
    """Kafka could not acknowledge a batch within the deadline; answer 503 with `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RecordRejected(Exception):
    """Kafka refuses records of this batch for what they are; answer 413 (`too_large`) or 422.

    `errors` is `[(index in the batch, message)]`. Retrying the same records cannot succeed.
    """

    def __init__(self, errors: list[tuple[int, str]], too_large: bool):
        super().__init__("; ".join(f"[{i}] {m}" for i, m in errors[:5]))
        self.errors, self.too_large = errors, too_large


def _record_errors() -> tuple[type[BaseException], ...]:
    """Errors about the records themselves (not the broker's state): never a reason to replace the producer."""
    from aiokafka import errors as E

    return (
        E.MessageSizeTooLargeError,
        E.RecordListTooLargeError,
        E.CorruptRecordException,
        E.InvalidTimestampError,
        E.UnsupportedForMessageFormatError,
    )


@dataclass(eq=False)
class _Lease:
    """One started aiokafka producer and how many produce() calls are using it."""

    producer: Any
    users: int = 0
    retired: bool = False


class EventProducer:
    """One idempotent, acks=all aiokafka producer shared by all requests of an event loop."""

    def __init__(self, settings: Settings, **overrides: Any):
        self.timeout_s = float(settings.kafka_produce_timeout)
        assert self.timeout_s > 0, f"kafka_produce_timeout must be > 0, got {self.timeout_s}"
        self.retry_after_s = max(1, math.ceil(self.timeout_s))
        # the interactions topic's record limit: a record the broker would refuse is refused here first
        self._config: dict[str, Any] = aio_producer_options(settings, client_id="flywheel-api")
        self._config.update(overrides)
        self.max_record_bytes: int = self._config["max_request_size"]
        self._topic = settings.topic("interactions")
        self._lease: _Lease | None = None  # the producer new requests get
        self._retired: set[_Lease] = set()  # replaced, still used by requests that hold them
        self._start_lock: asyncio.Lock | None = None
        self._closing: set[asyncio.Task] = set()
        self._closed = False
        self.replacements = 0  # producers replaced after KafkaUnavailable (for tests and logs)

    @property
    def closed(self) -> bool:
        return self._closed

    async def _get_lease(self) -> _Lease:
        if self._lease is not None:
            return self._lease
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._closed:
                raise KafkaUnavailable("the producer is shut down", self.retry_after_s)
            if self._lease is None:
                from aiokafka import AIOKafkaProducer

                producer = AIOKafkaProducer(**self._config)
                try:
                    await producer.start()  # bounded by the caller's wait_for
                except BaseException:
                    self._stop_later(producer)
                    raise
                self._lease = _Lease(producer)
                log.info(
                    "kafka producer connected to %s", ",".join(self._config["bootstrap_servers"])
                )
        return self._lease

    def _stop_later(self, producer: Any) -> None:
        """Flush and stop a producer nobody uses any more, in the background and bounded."""

        async def _stop() -> None:
            try:
                await asyncio.wait_for(producer.stop(), self.timeout_s)
            except BaseException as exc:  # it failed already; just do not leak it
                log.debug("replaced kafka producer did not stop cleanly: %r", exc)

        task = asyncio.get_running_loop().create_task(_stop())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _retire(self, lease: _Lease | None) -> None:
        """New requests get a fresh producer; `lease` serves its current users, then stops."""
        if lease is None or lease.retired:
            return
        lease.retired = True
        if self._lease is lease:
            self._lease = None
            self.replacements += 1
        self._retired.add(lease)
        self._stop_if_unused(lease)

    def _release(self, lease: _Lease) -> None:
        lease.users -= 1
        self._stop_if_unused(lease)

    def _stop_if_unused(self, lease: _Lease) -> None:
        if lease.retired and lease.users == 0 and lease in self._retired:
            self._retired.discard(lease)
            self._stop_later(lease.producer)

    def _check_sizes(self, records: list[tuple[str, bytes]]) -> None:
        """RecordRejected(too_large) before anything is sent if a record cannot fit the record limit."""
        from aiokafka.record.default_records import DefaultRecordBatchBuilder

        estimate = DefaultRecordBatchBuilder.estimate_size_in_bytes
        errors = []
        for i, (key, value) in enumerate(records):
            size = estimate(key.encode() if isinstance(key, str) else key, value, [])
            if size > self.max_record_bytes:
                errors.append(
                    (
                        i,
                        f"the Kafka record would be {size} bytes; the record limit is {self.max_record_bytes}",
                    )
                )
        if errors:
            raise RecordRejected(errors, too_large=True)

    async def produce(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """Send `(key, value)` records; return once the broker acknowledged all of them.

        Raises RecordRejected when Kafka refuses records of this batch for what they are, and
        KafkaUnavailable when the batch is not acknowledged within `kafka_produce_timeout`.
        """
        if not records:
            return
        from aiokafka.errors import KafkaError

        self._check_sizes(records)
        held: list[_Lease] = []  # the producer this batch went to
        try:
            await asyncio.wait_for(self._produce(topic, records, held), self.timeout_s)
        except RecordRejected:
            raise
        except TimeoutError:
            self._retire(held[0] if held else None)
            raise KafkaUnavailable(
                f"Kafka did not acknowledge the batch within {self.timeout_s:g}s",
                self.retry_after_s,
            ) from None
        except (KafkaError, OSError) as exc:
            self._retire(held[0] if held else None)
            raise KafkaUnavailable(
                f"Kafka is unavailable: {type(exc).__name__}: {exc}", self.retry_after_s
            ) from None
        finally:
            if held:
                self._release(held[0])

    async def _produce(
        self, topic: str, records: list[tuple[str, bytes]], held: list[_Lease]
    ) -> None:
        lease = await self._get_lease()
        lease.users += 1
        held.append(lease)
        record_errors = _record_errors()
        send = lease.producer.send
        futures = []
        for i, (key, value) in enumerate(records):
            try:
                futures.append(await send(topic, value, key=key))
            except record_errors as exc:  # refused by the client before it was queued
                raise RecordRejected(
                    [(i, f"{type(exc).__name__}: {exc}")], too_large=_is_size(exc)
                ) from None
        results = await asyncio.gather(*futures, return_exceptions=True)
        rejected = [(i, r) for i, r in enumerate(results) if isinstance(r, record_errors)]
        if rejected:
            log.warning(
                "Kafka refused %d record(s) of a batch of %d: %r",
                len(rejected),
                len(records),
                rejected[0][1],
            )
            raise RecordRejected(
                [(i, f"Kafka refused the record: {type(r).__name__}: {r}") for i, r in rejected],
                too_large=all(_is_size(r) for _, r in rejected),
            )
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed

    async def connect(self) -> None:
        """Start the producer now (at start-up) instead of on the first request, and lower the
        record-size check to the topic's limit if that is smaller; errors are logged."""
        try:
            await asyncio.wait_for(self._get_lease(), self.timeout_s)
        except Exception as exc:  # Kafka may be down at start-up; requests retry the connection
            log.warning(
                "kafka not reachable at start-up (%s: %s); POST /v1/events answers 503 until it is",
                type(exc).__name__,
                exc,
            )
            return
        try:
            limit = await asyncio.wait_for(self._topic_record_limit(), self.timeout_s)
        except Exception as exc:  # the check is a safeguard; the configured limit stays in force
            log.warning(
                "could not read max.message.bytes of %s (%s: %s); records are checked against %d bytes",
                self._topic,
                type(exc).__name__,
                exc,
                self.max_record_bytes,
            )
            return
        if limit is not None and limit < self.max_record_bytes:
            log.warning(
                "%s accepts records of at most %d bytes (max.message.bytes), less than the %d the API is "
                "configured for; larger events are answered 413. Set the topic's max.message.bytes to %d.",
                self._topic,
                limit,
                self.max_record_bytes,
                self.max_record_bytes,
            )
            self.max_record_bytes = limit

    async def _topic_record_limit(self) -> int | None:
        """The topic's effective `max.message.bytes` as the broker reports it (None if it has no such topic)."""
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

        admin = AIOKafkaAdminClient(
            bootstrap_servers=self._config["bootstrap_servers"],
            request_timeout_ms=self._config["request_timeout_ms"],
        )
        await admin.start()
        try:
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, self._topic, {"max.message.bytes": None})]
            )
        finally:
            await admin.close()
        for resource in responses[0].to_object()["resources"]:
            if resource["error_code"] != 0:
                return None
            for entry in resource["config_entries"]:
                if entry["config_names"] == "max.message.bytes":
                    return int(entry["config_value"])
        return None

    async def aclose(self) -> None:
        """Flush what is buffered (bounded by the produce timeout) and stop. Safe to call twice."""
        self._closed = True
        leases = [lease for lease in (self._lease, *self._retired) if lease is not None]
        self._lease = None
        self._retired.clear()
        for lease in leases:
            try:
                await asyncio.wait_for(lease.producer.stop(), self.timeout_s)
            except BaseException as exc:
                log.warning("kafka producer did not stop within %.1fs: %r", self.timeout_s, exc)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _is_size(exc: BaseException) -> bool:
    from aiokafka import errors as E

    return isinstance(exc, (E.MessageSizeTooLargeError, E.RecordListTooLargeError))
