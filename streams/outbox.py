"""The worker's output path: whole record batches to Kafka, awaited until the broker has them.

Why not Faust's producer. `topic.send()` / `table[k] = v` go through Faust's per-message
path (a FutureMessage, the producer-buffer task, one aiokafka `send()` per record) which
cost more than the join itself. The agent already works in batches, so it hands each
topic its records at once: they are grouped by partition into aiokafka `BatchBuilder`s
and submitted with `send_batch`, and `send()` returns when the broker acknowledged all
of them (acks=all, idempotent producer). Because every send is awaited inside the batch,
a batch's records are on the broker before Faust acks (and later commits) its input
offsets, independent of Faust's commit-time flush.

Partitions: changelog records carry theirs (the input record's partition); keyed outputs
use Kafka's default partitioner (murmur2 of the key, as the Java and kafka-python
clients do) so one request_id / model_version always lands on one partition; records
without a key (DLQ) go to a random partition.

    outbox = KafkaOutbox(settings.kafka_bootstrap)
    offsets = await outbox.send("ns.rollouts", [(b"req-1", b"{...}", None)])   # {partition: base offset}
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from app.infra.kafka import outbox_producer_options

log = logging.getLogger(__name__)

Record = tuple[
    bytes | None, bytes | None, int | None
]  # key, value (None: tombstone), partition (None: by key)


class Outbox(Protocol):
    async def send(self, topic: str, records: list[Record]) -> dict[int, int]:
        """Deliver `records` to `topic` (in order per partition); returns {partition: first offset written}."""


class KafkaOutbox:
    """An idempotent aiokafka producer used through `create_batch`/`send_batch` (started on first use)."""

    def __init__(self, bootstrap: str, max_batch_bytes: int = 1024 * 1024):
        self.bootstrap = [h.strip() for h in bootstrap.split(",")]
        self.max_batch_bytes = max_batch_bytes
        self._producer: AIOKafkaProducer | None = None
        self._partitioner = DefaultPartitioner()
        self._lock = asyncio.Lock()

    async def _ensure(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    **outbox_producer_options(self.bootstrap, self.max_batch_bytes)
                )
                await producer.start()
                self._producer = producer
        return self._producer

    async def send(self, topic: str, records: list[Record]) -> dict[int, int]:
        if not records:
            return {}
        producer = await self._ensure()
        partitions = sorted(await producer.partitions_for(topic))
        by_partition: dict[int, list[Record]] = {}
        for rec in records:
            p = rec[2]
            if p is None:
                p = self._partitioner(rec[0], partitions, partitions)
            by_partition.setdefault(p, []).append(rec)
        futures: list[tuple[int, Any]] = []
        for p, recs in by_partition.items():
            batch = producer.create_batch()
            for key, value, _ in recs:
                if (
                    batch.append(key=key, value=value, timestamp=None) is None
                ):  # full: ship it, start another
                    futures.append((p, await producer.send_batch(batch, topic, partition=p)))
                    batch = producer.create_batch()
                    meta = batch.append(key=key, value=value, timestamp=None)
                    assert meta is not None, (
                        f"one record of {len(value or b'')} bytes exceeds the batch limit {self.max_batch_bytes}"
                    )
            futures.append((p, await producer.send_batch(batch, topic, partition=p)))
        results = await asyncio.gather(*(f for _, f in futures))
        first: dict[int, int] = {}
        for (p, _), md in zip(futures, results):
            if p not in first and md is not None:
                first[p] = md.offset
        return first

    async def stop(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()
