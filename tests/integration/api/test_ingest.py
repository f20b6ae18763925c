"""POST /v1/events over real HTTP (uvicorn) into the real Kafka broker (docs/DESIGN.md §HTTP APIs).

Accepted events are read back with a plain kafka-python consumer: same keys, same JSON.
Every bad input is answered as specified and leaves the topic empty.
"""

from __future__ import annotations

import json

import httpx
import pytest

from app.contracts.events import format_ts, parse_ts
from tests.integration.api.conftest import event, read_interactions

pytestmark = pytest.mark.integration

ALL_TYPES = (
    "generation",
    "accept",
    "reject",
    "edit_persistence",
    "rating",
    "tool_error",
    "followup",
)


def stored(ev: dict) -> dict:
    """The event as ingest writes it: its own JSON with `ts` in the canonical form (docs/API.md, "Timestamps")."""
    return {**ev, "ts": format_ts(parse_ts(ev["ts"]))}


def test_valid_batch_is_acknowledged_and_on_kafka_keyed_by_request_id_with_the_same_json(api):
    events = [event(t, i) for i, t in enumerate(ALL_TYPES)]
    events.append(event("accept", 99, session_id="sessé-ünïcode", model_version="3"))
    resp = api.post_events({"events": events})
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": len(events)}

    records = read_interactions(api.settings)
    assert len(records) == len(events)
    by_id = {json.loads(v)["event_id"]: (k, v) for k, v in records}
    for ev in events:
        key, value = by_id[ev["event_id"]]
        assert key == ev["request_id"]
        assert json.loads(value) == stored(ev)
        assert (
            value == json.dumps(stored(ev), separators=(",", ":"), ensure_ascii=False).encode()
        ), "compact, original JSON"


def test_a_batch_of_exactly_the_limit_is_accepted(api):
    events = [event("accept", i) for i in range(api.settings.max_batch_events)]
    resp = api.post_events({"events": events})
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": 1000}
    assert sorted(json.loads(v)["event_id"] for _, v in read_interactions(api.settings)) == sorted(
        e["event_id"] for e in events
    )


def _errors(resp: httpx.Response) -> list[dict]:
    body = resp.json()
    assert set(body) == {"errors"}, body
    assert all(set(e) == {"index", "field", "message"} for e in body["errors"]), body
    return body["errors"]


BAD_BODIES = [
    # (id, raw body, expected (index, field) of the first error, message fragment)
    ("not-json", b'{"events": [', (None, "(body)"), "not valid JSON"),
    (
        "nan",
        b'{"events": [{"type": "followup", "sentiment": NaN}]}',
        (None, "(body)"),
        "NaN and Infinity are not JSON",
    ),
    (
        "infinity",
        b'{"events": [{"type": "followup", "sentiment": Infinity}]}',
        (None, "(body)"),
        "Infinity",
    ),
    (
        "minus-infinity",
        b'{"events": [{"type": "followup", "sentiment": -Infinity}]}',
        (None, "(body)"),
        "Infinity",
    ),
    ("array-body", b'[{"type": "accept"}]', (None, "(body)"), '{"events": [...]}'),
    ("events-not-list", b'{"events": {"type": "accept"}}', (None, "events"), "JSON array"),
    ("unknown-top-level", b'{"events": [], "extra": 1}', (None, "extra"), "unknown field"),
    ("empty-batch", b'{"events": []}', (None, "events"), "empty batch"),
]


@pytest.mark.parametrize(
    "raw, first, fragment", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES]
)
def test_bad_bodies_are_422_with_the_reason_and_nothing_is_written(api, raw, first, fragment):
    resp = api.post_events(content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    errors = _errors(resp)
    assert (errors[0]["index"], errors[0]["field"]) == first
    assert fragment in errors[0]["message"], errors
    assert read_interactions(api.settings) == []


BAD_EVENTS = [
    ("unknown-field", {"colour": "red"}, "accept", "colour", "unknown field"),
    (
        "logprobs-length",
        {"logprobs": [-0.5]},
        "generation",
        "logprobs",
        "logprobs has 1 entries but completion_tokens has 2",
    ),
    (
        "positive-logprob",
        {"logprobs": [-0.5, 0.25]},
        "generation",
        "logprobs.1",
        "less than or equal to 0",
    ),
    ("long-event-id", {"event_id": "e" * 129}, "accept", "event_id", "at most 128 characters"),
    (
        "long-request-id",
        {"request_id": "r" * 129},
        "reject",
        "request_id",
        "at most 128 characters",
    ),
    ("naive-timestamp", {"ts": "2026-11-21T10:00:00"}, "rating", "ts", "timezone"),
    ("unknown-type", {"type": "applause"}, "accept", "type", "expected one of"),
]


@pytest.mark.parametrize(
    "changes, type_, field, fragment", [b[1:] for b in BAD_EVENTS], ids=[b[0] for b in BAD_EVENTS]
)
def test_one_invalid_event_rejects_the_whole_batch_naming_index_and_field(
    api, changes, type_, field, fragment
):
    events = [event("accept", 0), event(type_, 1, **changes), event("followup", 2)]
    resp = api.post_events({"events": events})
    assert resp.status_code == 422, resp.text
    assert [(e["index"], e["field"]) for e in _errors(resp)] == [(1, field)]
    assert fragment in _errors(resp)[0]["message"]
    assert read_interactions(api.settings) == [], (
        "all-or-nothing: the valid events must not be written"
    )


def test_every_bad_event_of_a_batch_is_listed(api):
    events = [
        event("rating", 0, value=0),
        event("accept", 1),
        event("edit_persistence", 2, fraction=2.0, after_s=-1),
        "not-an-object",
    ]
    resp = api.post_events({"events": events})
    assert resp.status_code == 422
    assert [(e["index"], e["field"]) for e in _errors(resp)] == [
        (0, "value"),
        (2, "fraction"),
        (2, "after_s"),
        (3, "(event)"),
    ]
    assert read_interactions(api.settings) == []


def test_over_the_event_limit_is_422_and_nothing_is_written(api):
    events = [event("accept", i) for i in range(api.settings.max_batch_events + 1)]
    resp = api.post_events({"events": events})
    assert resp.status_code == 422
    errors = _errors(resp)
    assert errors[0]["field"] == "events" and "limit is 1000" in errors[0]["message"]
    assert read_interactions(api.settings) == []


def test_body_over_4_mib_is_413_by_content_length(api):
    limit = api.settings.max_body_bytes
    assert limit == 4 * 1024 * 1024, "the contract's limit"
    big = json.dumps({"events": [event("tool_error", 0, message="x" * 4000)] * 1100}).encode()
    assert len(big) > limit
    resp = api.post_events(content=big, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text
    assert "exceeds" in resp.json()["detail"]
    assert read_interactions(api.settings) == []


def test_body_over_4_mib_is_413_when_streamed_chunked_without_content_length(api):
    chunk = b" " * (256 * 1024)

    def body():  # valid JSON padded with whitespace: only the byte count can reject it
        yield b'{"events": [' + json.dumps(event("accept", 0)).encode()
        for _ in range(17):  # 17 x 256 KiB = 4.25 MiB
            yield chunk
        yield b"]}"

    resp = api.post_events(content=body(), headers={"Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in resp.request.headers}, "must be sent chunked"
    assert resp.status_code == 413, resp.text
    assert read_interactions(api.settings) == []


def test_a_small_chunked_body_is_accepted(api):
    ev = event("accept", 0)
    resp = api.post_events(
        content=iter([b'{"events": [', json.dumps(ev).encode(), b"]}"]),
        headers={"Content-Type": "application/json"},
    )
    assert resp.status_code == 202, resp.text
    assert [json.loads(v) for _, v in read_interactions(api.settings)] == [stored(ev)]


def test_missing_or_invalid_key_is_401_and_a_key_without_ingest_scope_is_403(api):
    body = {"events": [event("accept", 0)]}
    missing = api.post_events(body, key=None)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert api.post_events(body, key="fw_00000000_not-a-real-key").status_code == 401
    assert (
        api.post_events(
            body, key=None, headers={"Authorization": f"Basic {api.ingest_key}"}
        ).status_code
        == 401
    )
    forbidden = api.post_events(body, key="read")
    assert forbidden.status_code == 403 and "ingest" in forbidden.json()["detail"]
    assert read_interactions(api.settings) == []


def test_per_key_rate_limit_is_429_with_retry_after(api_factory):
    api = api_factory(rate_limit_per_s=0.2, rate_limit_burst=2)
    accepted = [api.post_events({"events": [event("accept", i)]}) for i in range(2)]
    assert [r.status_code for r in accepted] == [202, 202]
    limited = api.post_events({"events": [event("accept", 2)]})
    assert limited.status_code == 429
    assert int(limited.headers["retry-after"]) >= 1
    assert len(read_interactions(api.settings)) == 2, "the limited request must not be written"


def test_healthz_readyz_and_metrics(api):
    assert httpx.get(f"{api.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{api.url}/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["ready"] is True
    assert set(ready.json()["checks"]) == {"kafka", "database"}

    assert api.post_events({"events": [event("accept", 0), event("reject", 1)]}).status_code == 202
    assert api.post_events({"events": []}).status_code == 422
    text = httpx.get(f"{api.url}/metrics").text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["flywheel_api_events_accepted_total"] >= 2
    assert samples['flywheel_api_batches_total{outcome="empty_batch"}'] >= 1
    assert samples["flywheel_api_produce_seconds_count"] >= 1
    assert (
        samples['flywheel_api_http_requests_total{method="POST",route="/v1/events",status="202"}']
        >= 1
    )
    assert (
        samples['flywheel_api_http_requests_total{method="GET",route="/readyz",status="200"}'] >= 1
    )


def test_events_land_on_the_same_partition_a_kafka_python_producer_would_choose(api):
    """The API (aiokafka) and the replicas (kafka-python) must agree on request_id -> partition."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.partitioner.default import murmur2

    events = [event("accept", i) for i in range(60)]
    assert api.post_events({"events": events}).status_code == 202
    topic = api.settings.topic("interactions")
    n = api.settings.interactions_partitions
    consumer = KafkaConsumer(
        bootstrap_servers=api.settings.kafka_bootstrap, group_id=None, enable_auto_commit=False
    )
    try:
        tps = [TopicPartition(topic, p) for p in range(n)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end, seen = consumer.end_offsets(tps), {}
        while any(consumer.position(tp) < end[tp] for tp in tps):
            for tp, records in consumer.poll(timeout_ms=500).items():
                seen.update({r.key.decode(): tp.partition for r in records})
    finally:
        consumer.close()
    assert len(seen) == 60
    for key, partition in seen.items():
        assert partition == (murmur2(key.encode()) & 0x7FFFFFFF) % n, key
    assert len(set(seen.values())) > 1, "60 keys over several partitions"
