"""Fixtures of the replica integration tests: real replicas (uvicorn on free ports) on the session's
real Kafka broker and MLflow server, tiny policies, and readers of the topics they write."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.replica.config import ReplicaConfig
from app.settings import Settings
from tests.unit.replica.conftest import TINY, tiny_state  # noqa: F401  (shared tiny policy)


def read_topic(settings: Settings, name: str, want: int, timeout_s: float = 30.0,
               where: Callable[[dict], bool] = lambda _e: True) -> list[dict[str, Any]]:
    """Every JSON record of `<ns>.<name>` from the beginning until `want` match `where`."""
    from kafka import TopicPartition

    from app.kafka_io import make_consumer

    consumer = make_consumer(settings, group_id=None)
    try:
        topic = settings.topic(name)
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                out.extend(e for e in (json.loads(r.value) for r in records) if where(e))
            if len(out) >= want:
                break
        return out
    finally:
        consumer.close()


@pytest.fixture()
def replica_factory(make_settings, tmp_path) -> Iterator[Callable[..., Any]]:
    """Start a replica app (real uvicorn in a thread); every one started is stopped after the test."""
    from app.api.server import ServerThread
    from app.replica.server import create_app

    started: list[ServerThread] = []

    def _start(settings: Settings | None = None, start_sync: bool = True, **cfg: Any):
        settings = settings or make_settings()
        cfg.setdefault("cache_dir", tmp_path / f"cache-{cfg.get('id', 'replica-1')}")
        config = ReplicaConfig(**cfg)
        server = ServerThread(create_app(settings, config, start_sync=start_sync)).start()
        started.append(server)
        server.settings, server.config, server.replica = settings, config, server.server.config.app.state.replica
        return server

    yield _start
    for s in started:
        s.stop()
