"""FeedbackClient against the real API (uvicorn) and the real broker: batching, flushing,
rejections surfaced with the server's errors, 429s retried honouring Retry-After."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from app.client import FeedbackClient, FeedbackRejected
from tests.integration.api.conftest import read_interactions

pytestmark = pytest.mark.integration


def _accepted_batches(api) -> float:
    for line in httpx.get(f"{api.url}/metrics").text.splitlines():
        if line.startswith('flywheel_api_batches_total{outcome="accepted"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_batches_every_event_type_and_flushes_on_context_exit(api):
    before = _accepted_batches(api)
    with FeedbackClient(api.url, api.ingest_key, batch_size=3, flush_interval_s=0) as fc:
        ids = [
            fc.generation(
                "req-1",
                "s",
                model_version="4",
                prompt_tokens=[1, 2],
                completion_tokens=[3, 4],
                logprobs=[-0.5, -0.25],
                temperature=0.7,
                group_id="g",
                latency_ms=3.5,
            ),
            fc.accept("req-1", "s"),
            fc.reject("req-2", "s", model_version="4"),
            fc.edit_persistence("req-1", "s", fraction=0.9, after_s=120),
            fc.rating("req-1", "s", value=-1),
            fc.tool_error("req-1", "s", message="KeyError", hint="check the key", token_index=1),
            fc.followup("req-1", "s", sentiment=0.3),
        ]
        assert fc.pending == 1, "two full batches of 3 are posted as soon as they fill"
    assert _accepted_batches(api) - before == 3

    records = read_interactions(api.settings)
    events = {json.loads(v)["event_id"]: (k, json.loads(v)) for k, v in records}
    assert set(events) == set(ids)
    assert all(uuid.UUID(i).version == 4 for i in ids)
    types = [events[i][1]["type"] for i in ids]
    assert types == [
        "generation",
        "accept",
        "reject",
        "edit_persistence",
        "rating",
        "tool_error",
        "followup",
    ]
    assert events[ids[0]][1]["logprobs"] == [-0.5, -0.25] and events[ids[0]][0] == "req-1"
    assert events[ids[2]][0] == "req-2"


def test_background_flush_sends_pending_events_without_an_explicit_flush(api):
    fc = FeedbackClient(api.url, api.ingest_key, batch_size=100, flush_interval_s=0.2)
    try:
        event_id = fc.accept("req-1", "s")
        deadline = time.monotonic() + 30
        while not read_interactions(api.settings):
            assert time.monotonic() < deadline, "the background flush never sent the event"
            time.sleep(0.2)
        assert [json.loads(v)["event_id"] for _, v in read_interactions(api.settings)] == [event_id]
    finally:
        fc.close()


def test_validation_failure_raises_with_the_servers_errors_and_writes_nothing(api):
    fc = FeedbackClient(api.url, api.ingest_key, batch_size=10, flush_interval_s=0)
    fc.accept("req-1", "s")
    fc.rating("req-1", "s", value=0)
    with pytest.raises(FeedbackRejected) as exc:
        fc.flush()
    assert exc.value.status_code == 422
    assert exc.value.errors == [
        {"index": 1, "field": "value", "message": "Input should be -1 or 1"}
    ]
    assert "[1] value: Input should be -1 or 1" in str(exc.value)
    assert fc.pending == 0, (
        "a rejected batch cannot succeed by resending; it is handed back in the error"
    )
    assert len(exc.value.events) == 2
    fc.close()
    assert read_interactions(api.settings) == []


def test_a_key_without_the_ingest_scope_is_not_retried(api):
    fc = FeedbackClient(
        api.url, api.read_key, flush_interval_s=0, max_retries=50, backoff_initial_s=5
    )
    fc.accept("req-1", "s")
    with pytest.raises(FeedbackRejected) as exc:
        fc.flush()  # would take minutes if 403 were retried
    assert exc.value.status_code == 403


def test_429_is_retried_honouring_retry_after(api_factory):
    api = api_factory(rate_limit_per_s=1.0, rate_limit_burst=1)
    # the backoff alone (at most 0.05 s x 3 retries) is far shorter than the 1 s the bucket needs:
    # success is only possible by waiting as long as Retry-After says
    with FeedbackClient(
        api.url,
        api.ingest_key,
        batch_size=1,
        flush_interval_s=0,
        max_retries=3,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
    ) as fc:
        ids = [fc.accept(f"req-{i}", "s") for i in range(3)]
    assert sorted(json.loads(v)["event_id"] for _, v in read_interactions(api.settings)) == sorted(
        ids
    )
    text = httpx.get(f"{api.url}/metrics").text
    assert 'route="/v1/events",status="429"' in text


def test_an_oversized_event_is_refused_alone_and_the_rest_of_its_batch_lands_with_the_same_ids(api):
    fc = FeedbackClient(api.url, api.ingest_key, batch_size=100, flush_interval_s=0)
    ids = [fc.accept(f"req-{i}", "s") for i in range(4)]
    tokens = [7] * (api.settings.max_event_bytes // 2 + 10)  # '7,' per token: just over the limit
    big = fc.generation(
        "req-big",
        "s",
        model_version="4",
        prompt_tokens=tokens,
        completion_tokens=[1],
        logprobs=[-0.5],
        temperature=1.0,
    )
    ids += [fc.reject(f"req-{i}", "s") for i in range(4, 8)]
    with pytest.raises(FeedbackRejected) as exc:
        fc.flush()
    assert exc.value.status_code == 413
    assert [e["event_id"] for e in exc.value.events] == [big]
    assert (
        exc.value.errors[0]["index"] == 0
        and f"the limit is {api.settings.max_event_bytes} bytes" in exc.value.errors[0]["message"]
    )
    assert exc.value.accepted == 8 and fc.pending == 0
    fc.close()
    assert sorted(json.loads(v)["event_id"] for _, v in read_interactions(api.settings)) == sorted(
        ids
    )


def test_a_batch_over_the_body_limit_is_halved_until_every_part_is_accepted(api_factory):
    api = api_factory(max_event_bytes=10_000, max_body_bytes=40_000)
    refused_before = _too_large_count(api.url)
    with FeedbackClient(api.url, api.ingest_key, batch_size=100, flush_interval_s=0) as fc:
        ids = [
            fc.tool_error(f"req-{i}", "s", message="m" * 4000, token_index=0) for i in range(24)
        ]  # ~100 KB
        assert fc.flush() == 24
    assert sorted(json.loads(v)["event_id"] for _, v in read_interactions(api.settings)) == sorted(
        ids
    )
    assert _too_large_count(api.url) > refused_before, "the server saw the over-limit body first"


def _too_large_count(url: str) -> float:
    """Bodies refused for their size so far (the body-limit middleware's and the ingest route's counters)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(
            (
                'flywheel_http_rejected_total{reason="body_too_large"}',
                'flywheel_api_batches_total{outcome="too_large"}',
            )
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total
