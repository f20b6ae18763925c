"""Every Kafka topic of the service: its name under the namespace and its configuration.

`Settings.topic(name)` turns a name declared here into the full topic name
(`interactions` -> `flywheel.interactions`) and refuses any other; `ensure_topics()`
(app/infra/broker.py) creates exactly these topics with exactly these configurations; the
producer and consumer factory (app/infra/kafka.py) sizes its requests and fetches from the
record limits below. tests/unit/test_kafka_limits.py checks that the limits form one chain, and
tests/integration/test_kafka_broker.py that the broker holds what is declared here.

Record limits (bytes), one chain from the HTTP body to the broker. An event of `max_event_bytes`
becomes one record whose batch is at most `max_event_bytes + KAFKA_RECORD_OVERHEAD_BYTES`: a v2
batch header is 61 bytes, a record's framing (length, attributes, timestamp and offset deltas,
key and value lengths, header count; varints) at most 31, and the key (a request_id of up to 128
characters) at most 512 bytes of UTF-8.

This module imports nothing of the project: app/settings.py reads its limits from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# broker message.max.bytes and <ns>.interactions max.message.bytes (Kafka's default, set explicitly)
KAFKA_MESSAGE_MAX_BYTES = 1_048_588
# upper bound of batch header + record framing + key for one event record
KAFKA_RECORD_OVERHEAD_BYTES = 1024
# rollouts / late / dlq: records that embed an event (base64 in the dlq: x4/3)
KAFKA_DERIVED_MAX_MESSAGE_BYTES = 4 << 20
# <ns>.deltas: pushed weight deltas (delta_push_max_bytes <= 7 MiB)
KAFKA_DELTAS_MAX_MESSAGE_BYTES = 8 << 20
# kafka-python producers: any record of any topic must fit
KAFKA_PRODUCER_MAX_REQUEST_BYTES = 8 << 20

INTERACTIONS = "interactions"
ROLLOUTS = "rollouts"
VERSION_METRICS = "version-metrics"
DEPLOYMENTS = "deployments"
LATE = "late"
DLQ = "dlq"
DELTAS = "deltas"
REPLICA_STATUS = "replica-status"
STREAMS_TICKS = "streams-ticks"
STREAMS_METRIC_PARTIALS = "streams-metric-partials"
STREAMS_TURNS = "streams-turns"
STREAMS_LEDGER_TICKS = "streams-ledger-ticks"


@dataclass(frozen=True)
class Topic:
    """One topic: `name` under the namespace, its key, its Kafka configuration and, for topics
    whose partition count is a setting, that setting's field name (else `default_partitions`)."""

    name: str
    key: str
    config: dict[str, str] = field(default_factory=dict)
    partitions_setting: str = "default_partitions"


TOPIC_SPECS: tuple[Topic, ...] = (
    # editor events and generations (app/contracts/events.py)
    Topic(
        INTERACTIONS,
        key="request_id",
        config={"max.message.bytes": str(KAFKA_MESSAGE_MAX_BYTES)},
        partitions_setting="interactions_partitions",
    ),
    # reward-labelled rollouts (app/contracts/rollouts.py); compacted: a relabel replaces a rollout
    Topic(
        ROLLOUTS,
        key="request_id",
        config={
            "cleanup.policy": "compact",
            "max.message.bytes": str(KAFKA_DERIVED_MAX_MESSAGE_BYTES),
        },
        partitions_setting="rollouts_partitions",
    ),
    # per-version metric sums (app/contracts/rollouts.py)
    Topic(VERSION_METRICS, key="model version"),
    # the deployment log (app/contracts/deployments.py): decisions, in order
    Topic(DEPLOYMENTS, key="model name"),
    # events that arrived after their rollout was labelled
    Topic(
        LATE, key="request_id", config={"max.message.bytes": str(KAFKA_DERIVED_MAX_MESSAGE_BYTES)}
    ),
    # dead letters of every role (app/contracts/deadletter.py)
    Topic(DLQ, key="none", config={"max.message.bytes": str(KAFKA_DERIVED_MAX_MESSAGE_BYTES)}),
    # pushed deltas (app/contracts/pushed.py): a copy for replicas; MLflow keeps the originals
    Topic(
        DELTAS,
        key="model name",
        config={
            "retention.ms": str(24 * 3600 * 1000),
            "retention.bytes": str(1 << 30),
            "max.message.bytes": str(KAFKA_DELTAS_MAX_MESSAGE_BYTES),
        },
    ),
    # replica heartbeats (app/contracts/replica_status.py): compaction keeps the latest report of
    # each replica; hourly segments so the cleaner can reach them
    Topic(
        REPLICA_STATUS,
        key="replica id",
        config={
            "cleanup.policy": "compact",
            "segment.ms": str(3600 * 1000),
            "min.cleanable.dirty.ratio": "0.1",
        },
    ),
)

# name -> topic configuration
TOPICS: dict[str, dict[str, str]] = {t.name: t.config for t in TOPIC_SPECS}

# The streams role's own topics, read and written by it alone: created with the interactions
# partition count by streams/app.py (`ensure_internal_topics`, beside its tables' changelogs).
STREAMS_INTERNAL_SPECS: tuple[Topic, ...] = (
    # one tick per interactions partition, so labels close on quiet partitions
    Topic(
        STREAMS_TICKS,
        key="none",
        config={"retention.ms": str(3600_000)},
        partitions_setting="interactions_partitions",
    ),
    # per-partition metric partials, merged into <ns>.version-metrics
    Topic(
        STREAMS_METRIC_PARTIALS,
        key="model version",
        config={"retention.ms": str(7 * 86400_000)},
        partitions_setting="interactions_partitions",
    ),
    # labelled chat turns and session outcomes, re-keyed by session for the session ledger
    Topic(
        STREAMS_TURNS,
        key="session_id",
        config={
            "retention.ms": str(7 * 86400_000),
            "max.message.bytes": str(KAFKA_DERIVED_MAX_MESSAGE_BYTES),
        },
        partitions_setting="interactions_partitions",
    ),
    # one tick per turns partition, so sessions close on quiet partitions
    Topic(
        STREAMS_LEDGER_TICKS,
        key="none",
        config={"retention.ms": str(3600_000)},
        partitions_setting="interactions_partitions",
    ),
)


class _Partitions(Protocol):
    """What `topic_partitions` reads of the settings (app.settings.Settings, which imports this
    module for its limits: a Protocol keeps the two free of a cycle)."""

    interactions_partitions: int
    rollouts_partitions: int
    default_partitions: int


def topic_partitions(settings: _Partitions, name: str) -> int:
    """The partition count `name` is created with."""
    spec = next(t for t in TOPIC_SPECS + STREAMS_INTERNAL_SPECS if t.name == name)
    return int(getattr(settings, spec.partitions_setting))
