"""The one place Kafka clients are configured: kafka-python producers and consumers, the
asyncio (aiokafka) producers' options and the Faust app's producer options.

Producers use acks=all with idempotence (kafka-python 3.x defaults, made explicit here),
crc32c from the `crc32c` extra, and a bounded `max_block_ms` so an unreachable broker
surfaces as an error instead of a hang. Values are JSON bytes; keys are UTF-8 strings.
`max_request_size` (a per-record cap as well as a request cap in kafka-python) is the largest
record limit of any topic (`<ns>.deltas`, app/contracts/topics.py), and consumers fetch records
up to that size from one partition. Every client made here waits a bounded time on kafka-python's
network thread (app/infra/kafka_net.py). A consumer-group member (the trainer, the deployments
projector) gets a 10 s session (`GROUP_SESSION_TIMEOUT_MS`), so a role restarted after a crash
joins its group without waiting out kafka-python's 45 s default for its dead predecessor.

Two producer profiles, chosen by what the records are for:

- `"batched"` (the default): records linger 2 ms to fill batches of up to 256 KiB; for streams of
  records (events, rollouts, dead letters of the trainer, benchmarks).
- `"immediate"`: no linger; for one record that a reader waits for (a deployment event, a pushed
  delta, a dead letter written and flushed at once).

    producer = make_producer(settings)                       # batched
    producer = make_producer(settings, profile="immediate")  # the deployment log, pushed deltas
    consumer = make_consumer(settings, settings.topic("rollouts"), group_id="trainer")

The ingest API and the replicas produce from asyncio with aiokafka (app/infra/event_producer.py):
`aio_producer_options` gives them the same profile in aiokafka's names. The streams role's Faust
app takes `FAUST_PRODUCER_OPTIONS` and its outbox `outbox_producer_options`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from app.contracts.topics import (
    KAFKA_DELTAS_MAX_MESSAGE_BYTES,
    KAFKA_MESSAGE_MAX_BYTES,
    KAFKA_PRODUCER_MAX_REQUEST_BYTES,
)
from app.infra import kafka_net
from app.settings import Settings

Profile = Literal["batched", "immediate"]

BATCH_BYTES = 256 * 1024
# profile -> linger (ms) of a producer's batches
LINGER_MS: dict[str, int] = {"batched": 2, "immediate": 0}
RETRY_BACKOFF_MS = 50

# the streams role's Faust app: one in-flight produce request per broker, so it batches more per request
FAUST_PRODUCER_OPTIONS: dict[str, Any] = {
    "producer_acks": -1,
    "producer_linger_ms": 5,
    "producer_max_batch_size": 1024 * 1024,
    "producer_max_request_size": 8 * 1024 * 1024,
}


def _key_bytes(k: Any) -> Any:
    return k.encode() if isinstance(k, str) else k


def make_producer(
    settings: Settings, profile: Profile = "batched", **overrides: Any
) -> KafkaProducer:  # noqa: F821
    """A kafka-python producer with `profile`'s linger; `overrides` for tests and benchmarks."""
    from kafka import KafkaProducer

    kafka_net.install()

    cfg: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": LINGER_MS[profile],
        "batch_size": BATCH_BYTES,
        "max_request_size": KAFKA_PRODUCER_MAX_REQUEST_BYTES,  # every topic's largest record fits (deltas)
        "max_block_ms": int(settings.kafka_produce_timeout * 1000),
        "request_timeout_ms": max(1000, int(settings.kafka_produce_timeout * 1000)),
        "retry_backoff_ms": RETRY_BACKOFF_MS,
        "key_serializer": _key_bytes,
    }
    cfg.update(overrides)
    return KafkaProducer(**cfg)


# A group member's session: how long the group waits for a member that stopped heartbeating (a
# SIGKILLed or crashed process) before it rebalances without it. A restarted role's join waits that
# long for its dead predecessor (measured: a member restarted after a SIGKILL joined after 40.7 s
# with kafka-python 3's default of 45 s, within 10 s with this). kafka-python heartbeats from a
# background thread every 3 s (`heartbeat_interval_ms`), so a member busy between polls (a
# training step) is not taken for dead; `max_poll_interval_ms` (300 s) still bounds the time
# between polls.
GROUP_SESSION_TIMEOUT_MS = 10_000


def make_consumer(
    settings: Settings, *topics: str, group_id: str | None, **overrides: Any
) -> KafkaConsumer:  # noqa: F821
    """A consumer of `topics` (full names). Manual commits: roles commit when work is durable.
    A group member gets `GROUP_SESSION_TIMEOUT_MS`."""
    from kafka import KafkaConsumer

    kafka_net.install()

    cfg: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_poll_records": 1000,
        "fetch_max_bytes": 32 * 1024 * 1024,
        "max_partition_fetch_bytes": KAFKA_DELTAS_MAX_MESSAGE_BYTES,  # the largest record of any topic
    }
    if group_id is not None:
        cfg["session_timeout_ms"] = GROUP_SESSION_TIMEOUT_MS
    cfg.update(overrides)
    return KafkaConsumer(*topics, **cfg)


def aio_producer_options(
    settings: Settings, client_id: str, profile: Profile = "batched"
) -> dict[str, Any]:
    """aiokafka producer options of the `<ns>.interactions` writers (the ingest API, the replicas):
    `make_producer`'s, with the interactions topic's record limit as `max_request_size`, so a
    record the broker would refuse is refused by the producer first."""
    timeout_ms = int(float(settings.kafka_produce_timeout) * 1000)
    return {
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "client_id": client_id,
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": LINGER_MS[profile],
        "max_batch_size": BATCH_BYTES,
        "max_request_size": KAFKA_MESSAGE_MAX_BYTES,
        "request_timeout_ms": max(1000, timeout_ms),
        "retry_backoff_ms": RETRY_BACKOFF_MS,
        "key_serializer": _key_bytes,
    }


def outbox_producer_options(bootstrap: list[str], max_batch_bytes: int) -> dict[str, Any]:
    """aiokafka producer options of the streams outbox (streams/outbox.py), which builds its own
    batches of up to `max_batch_bytes` and sends each at once."""
    return {
        "bootstrap_servers": bootstrap,
        "acks": "all",
        "enable_idempotence": True,
        "max_batch_size": max_batch_bytes,
        "linger_ms": LINGER_MS["immediate"],
        "max_request_size": 8 * max_batch_bytes,
    }


def dumps(obj: Any) -> bytes:
    """Compact JSON; rejects NaN/Infinity so nothing invalid reaches a topic."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_default).encode()


def _default(o: Any) -> Any:
    from datetime import datetime

    if isinstance(o, datetime):
        return o.isoformat().replace("+00:00", "Z")
    raise TypeError(f"cannot JSON-encode {type(o).__name__}")
