"""kafka-python producers and consumers configured the same way in every role.

Producers use acks=all with idempotence (kafka-python 3.x defaults, made explicit here),
crc32c from the `crc32c` extra, and a bounded `max_block_ms` so an unreachable broker
surfaces as an error instead of a hang. Values are JSON bytes; keys are UTF-8 strings.
`max_request_size` (a per-record cap as well as a request cap in kafka-python) is the largest
record limit of any topic (`<ns>.deltas`, app/settings.py), and consumers fetch records up
to that size from one partition.
"""

from __future__ import annotations

import json
from typing import Any

from app.settings import KAFKA_DELTAS_MAX_MESSAGE_BYTES, KAFKA_PRODUCER_MAX_REQUEST_BYTES, Settings


def make_producer(settings: Settings, **overrides: Any) -> KafkaProducer:  # noqa: F821
    from kafka import KafkaProducer

    cfg: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": 2,
        "batch_size": 256 * 1024,
        "max_request_size": KAFKA_PRODUCER_MAX_REQUEST_BYTES,  # every topic's largest record fits (deltas)
        "max_block_ms": int(settings.kafka_produce_timeout * 1000),
        "request_timeout_ms": max(1000, int(settings.kafka_produce_timeout * 1000)),
        "retry_backoff_ms": 50,
        "key_serializer": lambda k: k.encode() if isinstance(k, str) else k,
    }
    cfg.update(overrides)
    return KafkaProducer(**cfg)


def make_consumer(
    settings: Settings, *topics: str, group_id: str | None, **overrides: Any
) -> KafkaConsumer:  # noqa: F821
    """A consumer of `topics` (full names). Manual commits: roles commit when work is durable."""
    from kafka import KafkaConsumer

    cfg: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap.split(","),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_poll_records": 1000,
        "fetch_max_bytes": 32 * 1024 * 1024,
        "max_partition_fetch_bytes": KAFKA_DELTAS_MAX_MESSAGE_BYTES,  # the largest record of any topic
    }
    cfg.update(overrides)
    return KafkaConsumer(*topics, **cfg)


def dumps(obj: Any) -> bytes:
    """Compact JSON; rejects NaN/Infinity so nothing invalid reaches a topic."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_default).encode()


def _default(o: Any) -> Any:
    from datetime import datetime

    if isinstance(o, datetime):
        return o.isoformat().replace("+00:00", "Z")
    raise TypeError(f"cannot JSON-encode {type(o).__name__}")
