"""On a fresh cluster the worker's internal topics (its tables' changelogs included) exist with
the source's partition count before Faust starts: Faust's own declaration can race its metadata
refresh and crash an agent ("changelog topic has 0 partitions")."""

from __future__ import annotations

import pytest

from streams.app import TABLES, ensure_internal_topics, internal_topics
from streams.config import StreamsConfig

pytestmark = pytest.mark.integration


def test_internal_topics_and_changelogs_are_created_with_the_source_partitions(make_settings):
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    settings = make_settings(create_topics=False, interactions_partitions=4)
    cfg = StreamsConfig()
    ensure_internal_topics(settings, cfg)
    wanted = internal_topics(settings, cfg)
    assert sum(name.endswith("-changelog") for name in wanted) == len(TABLES)
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:
        described = {t["name"]: t for t in admin.describe_topics(list(wanted))}
        for name in wanted:
            assert len(described[name]["partitions"]) == 4, name
        changelog = f"{settings.topic_namespace}-streams-labels-changelog"
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, changelog)])
        assert configs["topic"][changelog]["cleanup.policy"]["value"] == "compact"
    finally:
        admin.close()
    ensure_internal_topics(settings, cfg)  # idempotent


def test_the_broker_creates_no_topic_on_request_and_a_misshapen_one_fails_the_worker_at_once(
    make_settings,
):
    """A producer writing to an internal topic before the worker made it waits for it (the
    embedded broker does not auto-create topics, app/infra/broker.py); a topic made by something
    else with other partitions fails `ensure_internal_topics` at once, naming it."""
    import time

    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import KafkaTimeoutError

    from app.infra.kafka import make_producer
    from streams.app import MisshapenTopic

    settings = make_settings(create_topics=False, interactions_partitions=3)
    ticks = f"{settings.topic_namespace}.streams-ticks"
    prod = make_producer(settings, key_serializer=None, max_block_ms=2000)
    try:
        with pytest.raises(KafkaTimeoutError):
            prod.send(ticks, value=b"early").get(timeout=10)
    finally:
        prod.close(timeout=5)
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:
        assert ticks not in admin.list_topics(), "the broker created a topic on request"
        admin.create_topics([NewTopic(ticks, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    start = time.monotonic()
    with pytest.raises(
        MisshapenTopic, match=rf"topic {ticks} has 1 partition\(s\), the streams worker needs 3"
    ):
        ensure_internal_topics(settings, StreamsConfig())
    assert time.monotonic() - start < 60, "refused without waiting out the timeout"
