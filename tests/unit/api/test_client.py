"""FeedbackClient behaviour that needs no server: ids and timestamps, JSON checks, and keeping
events pending (same event_ids) when the server cannot be reached, and how 413/422 answers
are handled (split, refuse, never re-send as-is) against a stand-in server. The server-facing
behaviour (batching, retries on 503/429, rejections) is tested against the real API in
tests/integration/api/test_client.py."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from app.client import FeedbackClient, FeedbackRejected, FeedbackUnavailable
from tests.conftest import free_port


def dead_client(**kw) -> FeedbackClient:
    # a port nobody listens on: every attempt is a connection error
    return FeedbackClient(
        f"http://127.0.0.1:{free_port()}",
        "fw_key",
        flush_interval_s=0,
        backoff_initial_s=0.01,
        backoff_max_s=0.02,
        timeout_s=2,
        **kw,
    )


def test_event_ids_are_uuid4_and_ts_is_utc_when_absent_and_kept_when_given():
    fc = dead_client(batch_size=10)
    generated = fc.accept("r1", "s1")
    assert uuid.UUID(generated).version == 4
    assert (
        fc.rating("r1", "s1", value=1, event_id="mine-1", ts="2026-01-01T00:00:00+02:00")
        == "mine-1"
    )
    pending = list(fc._pending)
    assert pending[0]["ts"].endswith("Z") and "T" in pending[0]["ts"]
    assert pending[1] == {
        "type": "rating",
        "request_id": "r1",
        "session_id": "s1",
        "value": 1,
        "event_id": "mine-1",
        "ts": "2026-01-01T00:00:00+02:00",
    }


def test_optional_fields_left_out_are_not_sent_as_null():
    fc = dead_client()
    fc.tool_error("r1", "s1", message="boom", token_index=3)
    assert "hint" not in fc._pending[0] and "model_version" not in fc._pending[0]


def test_nan_is_refused_at_the_call_not_in_a_later_flush():
    fc = dead_client()
    with pytest.raises(ValueError, match="NaN"):
        fc.followup("r1", "s1", sentiment=float("nan"))
    assert fc.pending == 0


def test_unreachable_server_raises_unavailable_after_retries_and_keeps_the_same_events_pending():
    fc = dead_client(batch_size=2, max_retries=2)
    ids = [fc.accept("r1", "s1")]
    with pytest.raises(FeedbackUnavailable, match="after 2 retries"):
        fc.reject("r2", "s1")  # fills the batch: flushes
    assert [e["event_id"] for e in fc._pending][:1] == ids
    assert fc.pending == 2, "nothing may be dropped when the server is unreachable"
    with pytest.raises(FeedbackUnavailable):
        fc.flush()
    assert fc.pending == 2
    with pytest.raises(FeedbackUnavailable):
        fc.close()


# --- 413/422 handling against a stand-in server ----------------------------------------------------------
# httpx.MockTransport plays the server here so that every request the client makes can be counted and
# inspected; it answers with the real API's shapes (app/api/routes/events.py). The same behaviour is
# tested against the real API and broker in tests/integration/api/test_client.py.


class LimitServer:
    """Answers POST /v1/events like the API: 413 for a body over `body_limit` ({"detail"}), 413 naming
    each event over `event_limit` ({"errors": [...]}), 422 for events with `"bad": true`, else 202."""

    def __init__(
        self, event_limit: int = 10_000, body_limit: int = 1_000_000, down_after: int | None = None
    ):
        self.event_limit, self.body_limit, self.down_after = event_limit, body_limit, down_after
        self.posts: list[list[dict]] = []
        self.accepted: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = request.content
        events = json.loads(body)["events"]
        self.posts.append(events)
        if self.down_after is not None and len(self.posts) > self.down_after:
            return httpx.Response(
                503, json={"detail": "Kafka is unavailable"}, headers={"Retry-After": "0"}
            )
        if len(body) > self.body_limit:
            return httpx.Response(
                413, json={"detail": f"request body exceeds {self.body_limit} bytes"}
            )
        big = [
            {
                "index": i,
                "field": "(event)",
                "message": f"event is {n} bytes; the limit is {self.event_limit}",
            }
            for i, e in enumerate(events)
            if (n := len(json.dumps(e, separators=(",", ":")))) > self.event_limit
        ]
        if big:
            return httpx.Response(413, json={"errors": big})
        bad = [
            {"index": i, "field": "bad", "message": "unknown field"}
            for i, e in enumerate(events)
            if e.get("bad")
        ]
        if bad:
            return httpx.Response(422, json={"errors": bad})
        self.accepted.extend(e["event_id"] for e in events)
        return httpx.Response(202, json={"accepted": len(events)})


def client_of(server: LimitServer, **kw) -> FeedbackClient:
    kw.setdefault("flush_interval_s", 0)
    return FeedbackClient(
        "http://api.test",
        "fw_key",
        transport=httpx.MockTransport(server),
        max_retries=2,
        backoff_initial_s=0.001,
        backoff_max_s=0.002,
        **kw,
    )


def test_an_event_over_the_event_limit_is_refused_alone_and_the_rest_of_its_batch_is_accepted():
    server = LimitServer(event_limit=500)
    fc = client_of(server, batch_size=100)
    ids = [
        fc.tool_error(f"r{i}", "s", message="x" * (2000 if i in (2, 6) else 10), token_index=0)
        for i in range(10)
    ]
    with pytest.raises(FeedbackRejected) as exc:
        fc.flush()
    assert exc.value.status_code == 413
    assert [e["event_id"] for e in exc.value.events] == [ids[2], ids[6]]
    assert [e["index"] for e in exc.value.errors] == [
        0,
        1,
    ] and "the limit is 500" in exc.value.errors[0]["message"]
    assert exc.value.accepted == 8
    assert server.accepted == [i for k, i in enumerate(ids) if k not in (2, 6)], (
        "same ids, in order"
    )
    assert len(server.posts) == 2, (
        "one post naming the events, one with the rest; never the big ones again"
    )
    assert fc.pending == 0


def test_a_batch_over_the_body_limit_is_halved_until_each_part_fits_and_keeps_its_event_ids():
    server = LimitServer(body_limit=1500)
    fc = client_of(server, batch_size=100)
    ids = [fc.tool_error(f"r{i}", "s", message="y" * 200, token_index=0) for i in range(16)]
    assert fc.flush() == 16
    assert server.accepted == ids
    sizes = [len(p) for p in server.posts]
    assert sizes == [16, 8, 4, 4, 8, 4, 4], sizes


def test_one_event_over_the_body_limit_is_refused_and_not_retried():
    server = LimitServer(body_limit=300)
    fc = client_of(server, batch_size=100)
    small = fc.accept("r0", "s")
    big = fc.tool_error("r1", "s", message="z" * 400, token_index=0)
    with pytest.raises(FeedbackRejected) as exc:
        fc.flush()
    assert exc.value.status_code == 413 and [e["event_id"] for e in exc.value.events] == [big]
    assert "exceeds 300 bytes" in exc.value.errors[0]["message"]
    assert server.accepted == [small]
    assert [len(p) for p in server.posts] == [2, 1, 1], (
        "halved once, the big event posted alone once"
    )


def test_422_is_never_retried_and_the_other_batches_of_the_flush_are_still_posted():
    server = LimitServer()
    fc = client_of(server, batch_size=100)
    ok = [fc.accept("r0", "s"), fc.accept("r1", "s")]
    fc.send({"type": "accept", "request_id": "r2", "session_id": "s", "bad": True})
    ok.append(fc.accept("r3", "s"))
    ok.append(fc.accept("r4", "s"))
    fc.batch_size = 2  # posts [r0 r1] [r2 r3] [r4]
    with pytest.raises(FeedbackRejected) as exc:
        fc.flush()
    assert (
        exc.value.status_code == 422 and len(exc.value.events) == 2
    )  # the batch with the bad event
    assert server.accepted == [ok[0], ok[1], ok[3]], "the batches after the refused one are posted"
    assert len(server.posts) == 3
    assert fc.pending == 0


def test_a_background_flush_reports_an_oversized_event_in_errors_and_close_raises_it():
    server = LimitServer(event_limit=300)
    fc = client_of(server, batch_size=100, flush_interval_s=0.05)
    big = fc.tool_error("r1", "s", message="w" * 1000, token_index=0)
    ok = fc.accept("r2", "s")
    deadline = time.monotonic() + 30
    while not fc.errors:
        assert time.monotonic() < deadline, "the background flush never reported the refusal"
        time.sleep(0.02)
    assert isinstance(fc.errors[0], FeedbackRejected) and fc.errors[0].events[0]["event_id"] == big
    with pytest.raises(FeedbackRejected):
        fc.close()
    assert server.accepted == [ok]
    assert sum(e["event_id"] == big for p in server.posts for e in p) == 1, (
        "refused once, never re-sent"
    )


def test_unavailable_after_a_refusal_keeps_the_unsent_events_pending_and_records_the_refusal():
    server = LimitServer(
        event_limit=300, down_after=1
    )  # the retry without the big event meets a 503
    fc = client_of(server, batch_size=3)
    a = fc.accept("r0", "s")
    big = fc.tool_error("r1", "s", message="v" * 1000, token_index=0)
    with pytest.raises(FeedbackUnavailable):
        fc.accept("r2", "s")  # fills the batch: flushes
    assert [e["event_id"] for e in fc._pending][0] == a and fc.pending == 2, (
        "the rest stays pending, in order"
    )
    assert len(fc.errors) == 1 and fc.errors[0].events[0]["event_id"] == big, (
        "the refusal is not lost"
    )
    server.down_after = None
    assert fc.flush() == 2
    assert fc.pending == 0
