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
