"""The embedded Kafka broker: real KRaft node started by the project, topics per docs/DESIGN.md §Topics."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.contracts.topics import KAFKA_MESSAGE_MAX_BYTES, KAFKA_RECORD_OVERHEAD_BYTES, TOPICS
from app.infra.broker import LocalKafka, ensure_topics
from tests.conftest import free_port

pytestmark = pytest.mark.integration


def test_topics_are_created_with_configured_partitions_and_rollouts_compacted(make_settings):
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    s = make_settings(create_topics=False, interactions_partitions=4, rollouts_partitions=2)
    created = ensure_topics(s)
    assert sorted(created) == sorted(s.topic(t) for t in TOPICS)
    assert ensure_topics(s) == [], "a second call must create nothing"

    admin = KafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    try:
        meta = {t["name"]: t for t in admin.describe_topics([s.topic(n) for n in TOPICS])}
        assert len(meta[s.topic("interactions")]["partitions"]) == 4
        assert len(meta[s.topic("rollouts")]["partitions"]) == 2
        assert len(meta[s.topic("deployments")]["partitions"]) == 1
        res = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, s.topic("rollouts"))]
        )
        assert res["topic"][s.topic("rollouts")]["cleanup.policy"]["value"] == "compact"
        res = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, s.topic("deltas"))])
        deltas = res["topic"][s.topic("deltas")]
        assert int(deltas["max.message.bytes"]["value"]) > s.delta_push_max_bytes, (
            "a pushed delta must fit"
        )
        assert deltas["retention.ms"]["value"] == str(24 * 3600 * 1000)
    finally:
        admin.close()


def test_two_callers_creating_the_topics_at_once_split_them_and_neither_fails(make_settings):
    """Roles start side by side and each ensures the topics: a topic the other created in
    between is not an error, each topic is reported created by exactly one caller, and every
    topic is visible as soon as either call returns."""
    from concurrent.futures import ThreadPoolExecutor

    from kafka import KafkaAdminClient

    s = make_settings(create_topics=False)
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: ensure_topics(s), range(2))
    assert sorted(first + second) == sorted(s.topic(t) for t in TOPICS)
    admin = KafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    try:
        assert {s.topic(t) for t in TOPICS} <= set(admin.list_topics())
    finally:
        admin.close()


def test_record_limits_agree_from_the_http_body_to_the_live_broker(make_settings):
    """The chain of app/contracts/topics.py, read from the running broker and the configured clients."""
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    from app.infra.event_producer import EventProducer
    from app.infra.kafka import make_consumer, make_producer

    s = make_settings()
    admin = KafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    try:
        brokers = admin.describe_configs(
            [ConfigResource(ConfigResourceType.BROKER, "1")], config_filter="all"
        )["broker"]
        broker = next(iter(brokers.values()))
        topics = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, s.topic(n)) for n in TOPICS],
            config_filter="all",
        )["topic"]
    finally:
        admin.close()
    limits = {n: int(topics[s.topic(n)]["max.message.bytes"]["value"]) for n in TOPICS}
    assert int(broker["message.max.bytes"]["value"]) == KAFKA_MESSAGE_MAX_BYTES
    api_producer = EventProducer(s)
    assert (
        s.max_event_bytes + KAFKA_RECORD_OVERHEAD_BYTES
        <= api_producer.max_record_bytes
        <= limits["interactions"]
    ), "an accepted event fits the API producer's record limit, which is within the topic's"
    assert s.max_body_bytes >= s.max_event_bytes + len(b'{"events":[]}')
    producer = make_producer(s)
    consumer = make_consumer(s, group_id=None)
    try:
        assert producer.config["max_request_size"] >= max(limits.values()), limits
        assert consumer.config["max_partition_fetch_bytes"] >= max(limits.values()), limits
    finally:
        producer.close(timeout=5)
        consumer.close()


def test_broker_restarts_on_same_storage_and_keeps_records(tmp_path):
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.admin import NewTopic

    broker = LocalKafka(
        home=tmp_path / "kafka", port=free_port(), controller_port=free_port(), heap="384m"
    )
    broker.start(timeout=120)
    try:
        assert (broker.home / "data" / "meta.properties").exists(), (
            "storage must be formatted on first start"
        )
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.create_topics([NewTopic("restart-check", num_partitions=1, replication_factor=1)])
        admin.close()
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
        producer.send("restart-check", b"before-restart").get(timeout=30)
        producer.close()
        assert broker.stop() is True
        assert not broker.running()
        broker.start(timeout=120)  # same storage, no re-format
        consumer = KafkaConsumer(
            "restart-check",
            bootstrap_servers=broker.bootstrap,
            auto_offset_reset="earliest",
            consumer_timeout_ms=10000,
        )
        values = [m.value for m in consumer]
        consumer.close()
        assert values == [b"before-restart"]
        assert (broker.home / "logs" / "server.log").stat().st_size > 0, (
            "the broker must log (log4j2 on the classpath)"
        )
    finally:
        broker.stop()
    assert broker.stop() is False


def test_cli_kafka_start_status_stop(tmp_path):
    port = free_port()
    env = {
        "FLYWHEEL_DATA_DIR": str(tmp_path),
        "FLYWHEEL_KAFKA_BOOTSTRAP": f"localhost:{port}",
        "FLYWHEEL_KAFKA_CONTROLLER_PORT": str(free_port()),
        "FLYWHEEL_KAFKA_HEAP": "384m",
    }
    import os

    env = dict(os.environ, **env)
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "app.cli", "kafka", *a],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run("status").returncode == 1
    started = run("start")
    try:
        assert started.returncode == 0, started.stderr
        assert "flywheel.interactions" in started.stderr
        assert run("status").returncode == 0
    finally:
        stopped = run("stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stderr
    assert run("status").returncode == 1
