"""Fixtures of the API integration tests: a real uvicorn server on a free port, serving the app
on the session's real Kafka broker (or one a test starts itself), with an SQLite app database
migrated by `upgrade(url)` and API keys created in it; plus a plain kafka-python reader of the
interactions topic."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from app.settings import Settings

TS = "2026-11-21T10:00:00Z"


def event(type_: str = "accept", i: int = 0, **fields: Any) -> dict[str, Any]:
    """A valid event of `type_`; `i` makes its ids unique within a test."""
    ev: dict[str, Any] = {
        "event_id": f"ev-{i}-{uuid.uuid4().hex[:8]}",
        "type": type_,
        "request_id": f"req-{i}",
        "session_id": "sess-1",
        "ts": TS,
    }
    ev.update(
        {
            "generation": {
                "model_version": "3",
                "prompt_tokens": [72, 105],
                "completion_tokens": [33, 10],
                "logprobs": [-0.5, -0.0625],
                "temperature": 1.0,
                "tokenizer": "byte-v1",
            },
            "edit_persistence": {"fraction": 0.5, "after_s": 60.0},
            "rating": {"value": 1},
            "tool_error": {
                "message": "TypeError: x is None",
                "hint": "check x first",
                "token_index": 1,
            },
            "followup": {"sentiment": 0.25},
        }.get(type_, {})
    )
    ev.update(fields)
    return ev


@dataclass
class Api:
    url: str
    settings: Settings
    ingest_key: str
    read_key: str
    server: Any

    def post_events(
        self,
        body: Any = None,
        *,
        content: Any = None,
        key: str | None = "ingest",
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> httpx.Response:
        h = dict(headers or {})
        if key == "ingest":
            h["Authorization"] = f"Bearer {self.ingest_key}"
        elif key == "read":
            h["Authorization"] = f"Bearer {self.read_key}"
        elif key is not None:
            h["Authorization"] = f"Bearer {key}"
        if body is not None:
            content = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        return httpx.post(f"{self.url}/v1/events", content=content, headers=h, timeout=timeout)


@pytest.fixture()
def api_factory(make_settings) -> Iterator[Callable[..., Api]]:
    """Start the API (real uvicorn in a thread) on Settings(**overrides); stopped after the test."""
    from app.api.main import create_app
    from app.api.server import ServerThread
    from app.db.keys import create_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    servers: list[ServerThread] = []

    def _start(**overrides: Any) -> Api:
        settings = make_settings(**overrides)
        upgrade(settings.db_url)
        with session_scope(settings.db_url) as session:
            ingest_key, _ = create_key(session, ["ingest"], name="test-ingest")
            read_key, _ = create_key(session, ["read"], name="test-read")
        server = ServerThread(create_app(settings)).start()
        servers.append(server)
        return Api(server.url, settings, ingest_key, read_key, server)

    yield _start
    for server in servers:
        server.stop()


@pytest.fixture()
def api(api_factory) -> Api:
    return api_factory()


def read_interactions(
    settings: Settings, bootstrap: str | None = None, timeout_s: float = 30.0
) -> list[tuple[str, bytes]]:
    """Every (key, value) on the interactions topic, read from the beginning to the end offsets."""
    from kafka import KafkaConsumer, TopicPartition

    topic = settings.topic("interactions")
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap or settings.kafka_bootstrap,
        group_id=None,
        enable_auto_commit=False,
        request_timeout_ms=int(timeout_s * 1000),
    )
    try:
        deadline = time.monotonic() + timeout_s
        parts = consumer.partitions_for_topic(topic)
        while not parts:
            assert time.monotonic() < deadline, f"no metadata for {topic}"
            consumer.topics()
            time.sleep(0.1)
            parts = consumer.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out: list[tuple[str, bytes]] = []
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, (
                f"could not read {topic} to its end offsets {end} in {timeout_s}s"
            )
            for records in consumer.poll(timeout_ms=500).values():
                out.extend((r.key.decode(), r.value) for r in records)
        return out
    finally:
        consumer.close()
