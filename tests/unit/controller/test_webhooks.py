"""Webhook signatures agree with MLflow's own signer; stale, forged, malformed and repeated deliveries are
refused; the dedupe keeps ids while a replay could pass and is bounded without forgetting them."""

from __future__ import annotations

import json

import pytest
from mlflow.webhooks.delivery import _generate_hmac_signature

from app.contracts.aliases import AliasMove, Snapshot, detect_moves
from app.registry.webhooks import (
    DeliveryDedupe,
    Seen,
    WebhookRejected,
    check_headers,
    sign,
    verify,
)

BODY = json.dumps(
    {
        "entity": "model_version_alias",
        "action": "created",
        "data": {"name": "m", "alias": "champion"},
    }
)


def headers(sig, did="d-1", ts="1700000000"):
    return {"X-MLflow-Delivery-Id": did, "X-MLflow-Timestamp": ts, "X-MLflow-Signature": sig}


def test_signature_matches_mlflows_signer():
    assert sign("s3cret", "d-1", "1700000000", BODY.encode()) == _generate_hmac_signature(
        "s3cret", "d-1", "1700000000", BODY
    )


def test_verify_accepts_genuine_fresh_delivery_and_rejects_the_rest():
    sig = _generate_hmac_signature("s3cret", "d-1", "1700000000", BODY)
    assert verify("s3cret", headers(sig), BODY.encode(), window_s=300, now=1700000100) == "d-1"
    for bad, why in [
        (("other", headers(sig), BODY.encode(), 1700000100), "signature"),
        (("s3cret", headers(sig), BODY.encode() + b" ", 1700000100), "signature"),
        (("s3cret", headers(sig, did="d-2"), BODY.encode(), 1700000100), "signature"),
        (("s3cret", headers(sig), BODY.encode(), 1700001000), "replay window"),
        (("s3cret", {"X-MLflow-Signature": sig}, BODY.encode(), 1700000100), "missing"),
    ]:
        with pytest.raises(WebhookRejected, match=why) as exc:
            verify(*bad[:3], window_s=300, now=bad[3])
        assert exc.value.status == 401


@pytest.mark.parametrize(
    "ts, why",
    [
        ("nan", "not a finite number"),
        ("NaN", "not a finite number"),
        ("inf", "not a finite number"),
        ("-inf", "not a finite number"),
        ("Infinity", "not a finite number"),
        ("1e400", "not a finite number"),
        ("", "empty"),
        ("   ", "empty"),
        ("yesterday", "not a number"),
        ("0x10", "not a number"),
        ("1_700_000_000", "not plain unix seconds"),
        ("1.7e9", "not plain unix seconds"),
        ("-1700000000", "not plain"),
    ],
)
def test_non_finite_and_unparsable_timestamps_are_refused_with_a_reason(ts, why):
    """A timestamp of nan compares False with everything, so it would pass an `abs(age) > window` check."""
    sig = sign("s3cret", "d-1", ts, BODY.encode())
    with pytest.raises(WebhookRejected, match=why) as exc:
        verify("s3cret", headers(sig, ts=ts), BODY.encode(), window_s=300, now=1700000100)
    assert exc.value.status == 401


@pytest.mark.parametrize(
    "hdrs, why",
    [
        (
            {"X-MLflow-Timestamp": "1700000000", "X-MLflow-Signature": "v1,x"},
            "missing X-MLflow-Delivery-Id",
        ),
        ({"X-MLflow-Delivery-Id": "d", "X-MLflow-Signature": "v1,x"}, "missing X-MLflow-Timestamp"),
        (
            {"X-MLflow-Delivery-Id": "d", "X-MLflow-Timestamp": "1700000000"},
            "missing X-MLflow-Signature",
        ),
        (
            {
                "X-MLflow-Delivery-Id": "d" * 129,
                "X-MLflow-Timestamp": "1700000000",
                "X-MLflow-Signature": "v1,x",
            },
            "1-128",
        ),
        (
            {
                "X-MLflow-Delivery-Id": "a b",
                "X-MLflow-Timestamp": "1700000000",
                "X-MLflow-Signature": "v1,x",
            },
            "1-128",
        ),
        (
            {
                "X-MLflow-Delivery-Id": "d",
                "X-MLflow-Timestamp": "1700000000",
                "X-MLflow-Signature": " ",
            },
            "empty",
        ),
    ],
)
def test_headers_are_checked_before_the_body(hdrs, why):
    with pytest.raises(WebhookRejected, match=why):
        check_headers(hdrs, window_s=300, now=1700000100)


def test_a_fresh_delivery_passes_the_header_check_with_its_timestamp():
    d = check_headers(headers("v1,x", ts="1700000000.5"), window_s=300, now=1700000100)
    assert (d.delivery_id, d.timestamp, d.ts) == ("d-1", "1700000000.5", 1700000000.5)


def test_dedupe_remembers_done_ids_and_forgets_failed_ones():
    d = DeliveryDedupe(window_s=10, skew_s=5)
    assert d.begin("a", ts=0, now=0, wall=0) is Seen.NEW
    assert d.begin("a", ts=0, now=1, wall=1) is Seen.IN_PROGRESS, (
        "a concurrent repeat is not told 'delivered'"
    )
    d.forget("a")  # processing failed
    assert d.begin("a", ts=0, now=2, wall=2) is Seen.NEW, (
        "a failed delivery is processed again on retry"
    )
    d.done("a")
    assert d.begin("a", ts=0, now=3, wall=3) is Seen.DUPLICATE


def test_dedupe_keeps_an_id_while_a_replay_could_still_pass_the_window():
    """window 10, skew 5: a delivery stamped 10 s in the future (the edge of the window) passes the
    window check until wall time ts + 10 = 20 s after it arrived; the id must outlive that."""
    window, skew = 10.0, 5.0
    d = DeliveryDedupe(window_s=window, skew_s=skew)
    arrived = 1000.0
    ts = arrived + window  # future-dated as far as verify allows
    assert d.begin("x", ts=ts, now=arrived, wall=arrived) is Seen.NEW
    d.done("x")
    last_accepted = ts + window  # verify accepts a replay until wall time ts + window
    for t in (arrived + 1, last_accepted - 1, last_accepted, last_accepted + skew):
        assert d.begin("x", ts=ts, now=t, wall=t) is Seen.DUPLICATE, f"forgotten at {t - arrived}s"
    t = last_accepted + skew + 1
    assert d.begin("y", ts=t, now=t, wall=t) is Seen.NEW and "x" not in d._seen, (
        "expired ids are dropped"
    )


def test_dedupe_survives_a_wall_clock_step_back_within_the_skew():
    d = DeliveryDedupe(window_s=10, skew_s=5)
    assert d.begin("x", ts=1000, now=0, wall=1000) is Seen.NEW
    d.done("x")
    # 24 s later on the monotonic clock (retention 2 x 10 + 5 = 25 s), the wall clock stepped back 4 s
    assert d.begin("x", ts=1000, now=24, wall=1020) is Seen.DUPLICATE
    # monotonic retention over, but the wall clock says a replay (ts 1000) could still pass: keep it
    assert d.begin("x", ts=1000, now=30, wall=1012) is Seen.DUPLICATE


def test_a_full_dedupe_refuses_new_ids_instead_of_forgetting_live_ones():
    d = DeliveryDedupe(window_s=10, skew_s=5, max_ids=100)
    for i in range(100):
        assert d.begin(f"id-{i}", ts=0, now=i * 0.01, wall=0) is Seen.NEW
        d.done(f"id-{i}")
    assert d.begin("new", ts=0, now=2, wall=2) is Seen.FULL
    assert d.retry_after_s(now=2) == 23  # the oldest (arrived at 0) expires at 2 x 10 + 5 = 25
    assert all(d.begin(f"id-{i}", ts=0, now=2, wall=2) is Seen.DUPLICATE for i in range(100)), (
        "no live id was evicted to make room"
    )
    assert len(d) == 100
    assert d.begin("new", ts=26, now=26, wall=26) is Seen.NEW, "room again once ids expired"
    assert len(d) == 1


def test_detect_moves_and_deterministic_event_ids():
    snap = Snapshot(
        aliases={"champion": "2", "candidate": None},
        acked={"champion": "1", "candidate": "3"},
        seq=7,
    )
    moves = detect_moves(snap)
    assert moves == [AliasMove("champion", "1", "2", 7), AliasMove("candidate", "3", None, 7)]
    assert (
        moves[0].event_id("m")
        == AliasMove("champion", "1", "2", 7).event_id("m")
        != moves[0].event_id("other")
    )
    assert len(moves[0].event_id("m")) == 32
    assert (
        detect_moves(
            Snapshot(
                aliases={"champion": "1", "candidate": None},
                acked={"champion": "1", "candidate": None},
                seq=0,
            )
        )
        == []
    )
