"""One completion's whole round trip, as an editor makes it (docs/EDITORS.md), on the real parts:
a streamed completion from a replica's OpenAI-compatible API through the official `openai` Python
package, its feedback (accept, edit persistence, rating) through `FeedbackClient` to the ingest
API, and the reward-labelled rollout the real streams worker writes for it.

Real uvicorn servers for the replica and the API, the session's Kafka broker, and
`python -m streams.worker` as its own process; nothing is mocked. The replica serves tiny
version 7 from its verified cache (no MLflow needed for serving)."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from app.client import FeedbackClient
from tests.integration.clients.servers import serve_api, serve_replica
from tests.integration.streams.conftest import WorkerProc, streams_env

pytestmark = pytest.mark.integration

SESSION = "editor-session-1"
WINDOW_S = 8.0  # the wait window: long enough for the feedback below on a loaded machine


def _rollouts(settings, request_id: str, timeout_s: float) -> list[dict[str, Any]]:
    from kafka import TopicPartition

    from app.infra.kafka import make_consumer

    consumer = make_consumer(settings, group_id=None)
    try:
        topic = settings.topic("rollouts")
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not out:
            for records in consumer.poll(timeout_ms=500).values():
                out += [json.loads(x.value) for x in records]
            out = [r for r in out if r["request_id"] == request_id]
        return out
    finally:
        consumer.close()


def test_a_streamed_completion_and_its_feedback_become_one_rollout(make_settings, tmp_path):
    settings = make_settings()
    worker = WorkerProc(
        streams_env(settings, FLYWHEEL_WAIT_WINDOW=str(WINDOW_S)), tmp_path / "worker.log"
    )
    replica = serve_replica(settings, tmp_path, "replica-editor")
    api, ingest_key = serve_api(settings, "editor")
    try:
        # 1. The editor asks for a completion, streamed, with its session as `user`.
        client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=2)
        stream = client.completions.create(
            model=settings.model_name,
            prompt="def add(a, b):\n    return",
            max_tokens=12,
            temperature=0.8,
            user=SESSION,
            stream=True,
        )
        chunks = list(stream)
        request_id = chunks[0].id
        text = "".join(c.text for chunk in chunks for c in chunk.choices)
        finish = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
        assert all(chunk.id == request_id for chunk in chunks)
        assert chunks[0].system_fingerprint == "flywheel-v7" and len(finish) == 1

        # 2. The user accepts it; 80% of it is still there later; they rate it up.
        with FeedbackClient(api.url, ingest_key, flush_interval_s=0) as fc:
            fc.accept(request_id, SESSION, model_version="7")
            fc.edit_persistence(request_id, SESSION, fraction=0.8, after_s=30.0)
            fc.rating(request_id, SESSION, value=1, model_version="7")

        # 3. The streams worker closes the label when the window ends: one rollout.
        got = _rollouts(settings, request_id, timeout_s=180.0)
        assert len(got) == 1, f"no rollout for {request_id}; worker log:\n{worker.tail()}"
        rollout = got[0]
    finally:
        api.stop()
        replica.stop()
        worker.kill()

    assert rollout["session_id"] == SESSION and rollout["model_version"] == "7"
    assert rollout["finish_reason"] == finish[0] and rollout["temperature"] == 0.8
    # what the editor showed is what the trainer will learn from: the logged tokens decode to it
    shown = bytes(t for t in rollout["completion_tokens"] if t < 256).decode("utf-8", "replace")
    assert shown == text and len(rollout["logprobs"]) == len(rollout["completion_tokens"])
    # reward spec v1: accept +0.75, persistence 1.0 x 0.8, rating 0.5 x 1
    assert rollout["components"] == {
        "decision": 0.75,
        "persistence": 0.8,
        "rating": 0.5,
        "followup": None,
        "tool_errors": None,
    }
    assert rollout["reward"] == pytest.approx(2.05)
