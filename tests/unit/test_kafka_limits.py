"""The Kafka record limits form one chain (app/contracts/topics.py): an event the API accepts fits a
record the producer sends, which fits the topic's and the broker's limit; every record of
every topic fits the kafka-python producers and consumers; a body holds one maximal event.
The live broker's values are checked in tests/integration/test_kafka_broker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from app.contracts.events import MAX_ID_LEN
from app.contracts.topics import (
    KAFKA_DELTAS_MAX_MESSAGE_BYTES,
    KAFKA_MESSAGE_MAX_BYTES,
    KAFKA_PRODUCER_MAX_REQUEST_BYTES,
    KAFKA_RECORD_OVERHEAD_BYTES,
    TOPICS,
)
from app.infra.event_producer import EventProducer
from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def topic_limit(name: str) -> int:
    return int(TOPICS[name].get("max.message.bytes", KAFKA_MESSAGE_MAX_BYTES))


def test_a_maximal_event_with_a_maximal_key_fits_the_producers_and_the_topics_record_limit():
    s = Settings()
    key = ("\U0001f600" * MAX_ID_LEN).encode()  # the longest request_id in bytes: 4-byte characters
    record = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, b"x" * s.max_event_bytes, [])
    assert record <= s.max_event_bytes + KAFKA_RECORD_OVERHEAD_BYTES, (
        f"{record=} overhead {record - s.max_event_bytes}"
    )
    producer = EventProducer(s)
    assert (
        record
        <= producer.max_record_bytes
        == topic_limit("interactions")
        == KAFKA_MESSAGE_MAX_BYTES
    ), "the API producer refuses exactly what the topic would refuse"


def test_the_event_limit_setting_cannot_exceed_the_topic_limit_and_a_body_holds_one_event():
    with pytest.raises(ValueError, match="max_event_bytes"):
        Settings(max_event_bytes=KAFKA_MESSAGE_MAX_BYTES)
    with pytest.raises(ValueError, match="FLYWHEEL_MAX_BODY_BYTES"):
        Settings(max_event_bytes=100_000, max_body_bytes=100_000)
    s = Settings()
    assert s.max_body_bytes >= s.max_event_bytes + len(b'{"events":[]}')


def test_records_that_embed_an_event_fit_their_topics():
    s = Settings()
    base64_event = (
        (s.max_event_bytes + 2) // 3 * 4
    )  # the dead-letter record carries the value as base64
    for name in ("dlq", "rollouts", "late"):
        assert topic_limit(name) >= base64_event + 64 * 1024, f"{name}: {topic_limit(name)}"
    assert topic_limit("deltas") == KAFKA_DELTAS_MAX_MESSAGE_BYTES > s.delta_push_max_bytes


def test_kafka_python_producers_and_consumers_handle_the_largest_record_of_any_topic():
    largest = max(topic_limit(name) for name in TOPICS)
    assert KAFKA_PRODUCER_MAX_REQUEST_BYTES >= largest
    assert KAFKA_DELTAS_MAX_MESSAGE_BYTES >= largest  # make_consumer's max_partition_fetch_bytes


def test_the_compose_broker_and_the_embedded_broker_use_the_same_record_limit(tmp_path):
    from app.infra.broker import LocalKafka

    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert (
        int(compose["services"]["kafka"]["environment"]["KAFKA_MESSAGE_MAX_BYTES"])
        == KAFKA_MESSAGE_MAX_BYTES
    )
    cfg = LocalKafka(home=tmp_path)._write_config().read_text()
    assert f"message.max.bytes={KAFKA_MESSAGE_MAX_BYTES}\n" in cfg
