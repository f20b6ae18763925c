"""FeedbackClient behaviour that needs no server: ids and timestamps, JSON checks, and keeping
events pending (same event_ids) when the server cannot be reached. The server-facing behaviour
(batching, retries on 503/429, rejections) is tested against the real API in
tests/integration/api/test_client.py."""

from __future__ import annotations

import uuid

import pytest

from app.client import FeedbackClient, FeedbackUnavailable
from tests.conftest import free_port


def dead_client(**kw) -> FeedbackClient:
    # a port nobody listens on: every attempt is a connection error
    return FeedbackClient(f"http://127.0.0.1:{free_port()}", "fw_key", flush_interval_s=0, backoff_initial_s=0.01,
                          backoff_max_s=0.02, timeout_s=2, **kw)


def test_event_ids_are_uuid4_and_ts_is_utc_when_absent_and_kept_when_given():
    fc = dead_client(batch_size=10)
    generated = fc.accept("r1", "s1")
    assert uuid.UUID(generated).version == 4
    assert fc.rating("r1", "s1", value=1, event_id="mine-1", ts="2026-01-01T00:00:00+02:00") == "mine-1"
    pending = list(fc._pending)
    assert pending[0]["ts"].endswith("Z") and "T" in pending[0]["ts"]
    assert pending[1] == {"type": "rating", "request_id": "r1", "session_id": "s1", "value": 1,
                          "event_id": "mine-1", "ts": "2026-01-01T00:00:00+02:00"}


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
