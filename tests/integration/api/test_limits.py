"""Event and record size limits on the real API and the real broker, and the isolation of one
request's failure from every other request's answer.

- An event of exactly `max_event_bytes` (compact JSON) is accepted and read back unchanged from
  Kafka; one byte more is 413 naming the event and the limit (the broker's, the topic's and the
  producer's limits are the chain of app/contracts/topics.py, checked in tests/integration/test_kafka_broker.py).
- A client sending oversized and poison batches while other clients send valid ones concurrently:
  every valid batch gets 202 and is on Kafka, and the shared producer is never replaced.
- The producer itself (EventProducer on the real broker): a record over its record limit is
  RecordRejected before anything of its batch is sent and leaves the producer alone; replacing
  the producer (what a broker failure does) does not fail the batches in flight on the old one;
  a topic configured by hand with a smaller limit lowers the producer's check to it (413, not a
  broker refusal that would break the partition's idempotent sequence).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx
import orjson
import pytest

from app.contracts.events import format_ts, parse_ts
from app.infra.event_producer import EventProducer, RecordRejected
from tests.integration.api.conftest import event, read_interactions

pytestmark = pytest.mark.integration


def event_of_size(n: int, i: int = 0) -> dict:
    """A valid generation event whose compact JSON is exactly `n` bytes (prompt padded with tokens)."""
    ev = event("generation", i, prompt_tokens=[])
    base = len(
        orjson.dumps(ev)
    )  # '[]' -> '[1,1,...,1]' adds 2 bytes per token, minus 1 for the first comma
    tokens = max(1, (n - base + 1) // 2)
    ev["prompt_tokens"] = [1] * tokens
    short = n - len(orjson.dumps(ev))
    assert 0 <= short <= 1, f"cannot pad to {n}: {short}"
    if short:
        ev["prompt_tokens"][0] = 10  # one more digit
    assert len(orjson.dumps(ev)) == n
    return ev


def test_an_event_of_exactly_the_limit_is_accepted_and_read_back_and_one_byte_more_is_413_naming_it(
    api,
):
    limit = api.settings.max_event_bytes
    at_limit = event_of_size(limit, 1)
    resp = api.post_events({"events": [event("accept", 0), at_limit]})
    assert resp.status_code == 202, resp.text[:500]
    values = {json.loads(v)["event_id"]: v for _, v in read_interactions(api.settings)}
    stored = {
        **at_limit,
        "ts": format_ts(parse_ts(at_limit["ts"])),
    }  # ingest writes the canonical `ts`
    assert values[at_limit["event_id"]] == orjson.dumps(stored), (
        "the full event is on Kafka, byte for byte"
    )

    over = event_of_size(limit + 1, 2)
    resp = api.post_events({"events": [event("accept", 3), over, event("accept", 4)]})
    assert resp.status_code == 413, resp.text[:500]
    assert resp.json() == {
        "errors": [
            {
                "index": 1,
                "field": "(event)",
                "message": f"event is {limit + 1} bytes as compact JSON; the limit is {limit} bytes (max_event_bytes)",
            }
        ]
    }
    assert len(read_interactions(api.settings)) == 2, "nothing of the refused batch is written"


def test_a_smaller_configured_event_limit_is_enforced_and_never_answered_503(api_factory):
    api = api_factory(max_event_bytes=5000)
    resp = api.post_events(
        {"events": [event_of_size(5000, 0), event_of_size(5001, 1), event_of_size(9000, 2)]}
    )
    assert resp.status_code == 413, resp.text
    assert [e["index"] for e in resp.json()["errors"]] == [1, 2]
    assert "the limit is 5000 bytes" in resp.json()["errors"][1]["message"]
    assert api.post_events({"events": [event_of_size(5000, 3)]}).status_code == 202


def test_oversized_and_poison_batches_never_fail_the_concurrent_valid_batches_of_other_clients(api):
    limit = api.settings.max_event_bytes
    poison_bodies = [
        orjson.dumps(
            {"events": [event("accept", 900), event_of_size(limit + 1, 901)]}
        ),  # 413 naming event 1
        orjson.dumps({"events": [event_of_size(limit + 50_000, 902)] * 3}),  # 413, three events
        b'{"events": [{"type": "followup", "sentiment": NaN}]}',  # 422
        b'{"events": [' + b"[" * 5000 + b"]" * 5000 + b"]}",  # 422, too deep
        orjson.dumps({"events": [event("accept", 903, logprobs=[0.5])]}),  # 422, unknown field
    ]
    n_clients, batches_each = 6, 8
    valid: dict[int, list[list[dict]]] = {
        c: [[event("accept", 1000 * c + 10 * b + k) for k in range(5)] for b in range(batches_each)]
        for c in range(n_clients)
    }
    answers: dict[int, list[int]] = {c: [] for c in range(n_clients)}
    poison_answers: list[int] = []
    stop = threading.Event()
    headers = {"Authorization": f"Bearer {api.ingest_key}", "Content-Type": "application/json"}

    def poisoner() -> None:
        with httpx.Client(base_url=api.url, headers=headers, timeout=60) as http:
            while not stop.is_set():
                for body in poison_bodies:
                    poison_answers.append(http.post("/v1/events", content=body).status_code)

    def editor(c: int) -> None:
        with httpx.Client(base_url=api.url, headers=headers, timeout=60) as http:
            for batch in valid[c]:
                answers[c].append(
                    http.post("/v1/events", content=orjson.dumps({"events": batch})).status_code
                )

    bad = threading.Thread(target=poisoner)
    bad.start()
    editors = [threading.Thread(target=editor, args=(c,)) for c in range(n_clients)]
    for t in editors:
        t.start()
    for t in editors:
        t.join(180)
    stop.set()
    bad.join(120)
    assert not bad.is_alive() and not any(t.is_alive() for t in editors), "a request hung"

    assert answers == {c: [202] * batches_each for c in range(n_clients)}, answers
    assert len(poison_answers) >= len(poison_bodies) and set(poison_answers) <= {413, 422}, (
        poison_answers
    )
    on_kafka = {json.loads(v)["event_id"] for _, v in read_interactions(api.settings)}
    sent = {e["event_id"] for batches in valid.values() for batch in batches for e in batch}
    assert on_kafka == sent, f"missing: {len(sent - on_kafka)}, unexpected: {len(on_kafka - sent)}"
    assert api.server.server.config.app.state.event_producer.replacements == 0, (
        "no request's failure may replace the producer"
    )


def test_a_record_over_the_producers_limit_is_refused_before_sending_and_leaves_the_producer_alone(
    make_settings,
):
    settings = make_settings()
    topic = settings.topic("interactions")

    async def scenario() -> tuple[list, EventProducer]:
        producer = EventProducer(settings, max_request_size=20_000)
        try:
            await producer.connect()
            valid = [
                [(f"req-{b}-{k}", orjson.dumps(event("accept", 100 * b + k))) for k in range(20)]
                for b in range(10)
            ]
            poison = [
                ("req-p", orjson.dumps(event("accept", 9999))),
                ("req-q", b'{"x":"' + b"a" * 30_000 + b'"}'),
            ]
            results = await asyncio.gather(
                *(producer.produce(topic, batch) for batch in valid),
                producer.produce(topic, poison),
                return_exceptions=True,
            )
            return [valid, results], producer
        finally:
            await producer.aclose()

    (valid, results), producer = asyncio.run(scenario())
    assert results[:-1] == [None] * len(valid), results
    assert isinstance(results[-1], RecordRejected) and results[-1].too_large, results[-1]
    assert [i for i, _ in results[-1].errors] == [1] and "20000" in results[-1].errors[0][1]
    assert producer.replacements == 0
    keys = sorted(k for k, _ in read_interactions(settings))
    assert keys == sorted(k for batch in valid for k, _ in batch), (
        "all valid records, none of the refused batch"
    )


def test_replacing_the_producer_does_not_fail_the_batches_in_flight_on_the_old_one(make_settings):
    settings = make_settings()
    topic = settings.topic("interactions")

    async def scenario() -> tuple[list, list, EventProducer, bool]:
        producer = EventProducer(settings)
        try:
            await producer.connect()
            old = producer._lease
            batches = [
                [(f"req-{b}-{k}", orjson.dumps(event("accept", 100 * b + k))) for k in range(50)]
                for b in range(20)
            ]
            tasks = [asyncio.create_task(producer.produce(topic, batch)) for batch in batches]
            while old.users < len(
                batches
            ):  # every batch holds the old producer and is sending on it
                await asyncio.sleep(0)
            producer._retire(old)  # what a KafkaUnavailable of another request does
            later = [(f"req-later-{k}", orjson.dumps(event("reject", k))) for k in range(10)]
            results = await asyncio.gather(
                *tasks, producer.produce(topic, later), return_exceptions=True
            )
            return batches + [later], results, producer, producer._lease is not old
        finally:
            await producer.aclose()

    batches, results, producer, fresh = asyncio.run(scenario())
    assert results == [None] * len(batches), results
    assert fresh and producer.replacements == 1, "requests after the replacement use a new producer"
    keys = sorted(k for k, _ in read_interactions(settings))
    assert keys == sorted(k for batch in batches for k, _ in batch)


def test_a_topic_configured_with_a_smaller_record_limit_lowers_the_check_and_larger_events_are_413(
    api_factory, kafka
):
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    namespace = f"small{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:  # an interactions topic set up by hand with a 200,000-byte record limit
        admin.create_topics(
            [
                NewTopic(
                    f"{namespace}.interactions",
                    num_partitions=3,
                    replication_factor=1,
                    topic_configs={"max.message.bytes": "200000"},
                )
            ]
        )
    finally:
        admin.close()
    api = api_factory(topic_namespace=namespace, create_topics=False)
    producer = api.server.server.config.app.state.event_producer
    deadline = time.monotonic() + 30
    while producer.max_record_bytes != 200_000:  # connect() runs in the background at start-up
        assert time.monotonic() < deadline, f"the producer kept {producer.max_record_bytes}"
        time.sleep(0.1)

    big = event_of_size(250_000, 1)
    resp = api.post_events({"events": [event("accept", 0), big]})
    assert resp.status_code == 413, resp.text[:300]
    (error,) = resp.json()["errors"]
    assert error["index"] == 1 and "the record limit is 200000" in error["message"], error
    ok = [event("accept", 2), event_of_size(150_000, 3)]
    assert api.post_events({"events": ok}).status_code == 202
    assert sorted(json.loads(v)["event_id"] for _, v in read_interactions(api.settings)) == sorted(
        e["event_id"] for e in ok
    )
    assert producer.replacements == 0
