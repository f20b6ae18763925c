"""Webhook signatures agree with MLflow's own signer; stale, forged and repeated deliveries are refused."""

from __future__ import annotations

import json

import pytest
from mlflow.webhooks.delivery import _generate_hmac_signature

from app.controller.aliases import AliasMove, Snapshot, detect_moves
from app.controller.webhooks import DeliveryDedupe, WebhookRejected, sign, verify

BODY = json.dumps({"entity": "model_version_alias", "action": "created", "data": {"name": "m", "alias": "champion"}})


def headers(sig, did="d-1", ts="1700000000"):
    return {"X-MLflow-Delivery-Id": did, "X-MLflow-Timestamp": ts, "X-MLflow-Signature": sig}


def test_signature_matches_mlflows_signer():
    assert sign("s3cret", "d-1", "1700000000", BODY.encode()) == _generate_hmac_signature("s3cret", "d-1", "1700000000", BODY)


def test_verify_accepts_genuine_fresh_delivery_and_rejects_the_rest():
    sig = _generate_hmac_signature("s3cret", "d-1", "1700000000", BODY)
    assert verify("s3cret", headers(sig), BODY.encode(), window_s=300, now=1700000100) == "d-1"
    for bad, why in [(("other", headers(sig), BODY.encode(), 1700000100), "signature"),
                     (("s3cret", headers(sig), BODY.encode() + b" ", 1700000100), "signature"),
                     (("s3cret", headers(sig, did="d-2"), BODY.encode(), 1700000100), "signature"),
                     (("s3cret", headers(sig), BODY.encode(), 1700001000), "replay window"),
                     (("s3cret", {"X-MLflow-Signature": sig}, BODY.encode(), 1700000100), "missing")]:
        with pytest.raises(WebhookRejected, match=why) as exc:
            verify(*bad[:3], window_s=300, now=bad[3])
        assert exc.value.status == 401


def test_dedupe_remembers_ids_and_forgets_failed_ones():
    d = DeliveryDedupe(window_s=10)
    assert d.first_time("a", now=0) and not d.first_time("a", now=1)
    d.forget("a")
    assert d.first_time("a", now=2)
    assert d.first_time("a", now=100), "ids older than the replay window are dropped (verify rejects them anyway)"


def test_detect_moves_and_deterministic_event_ids():
    snap = Snapshot(aliases={"champion": "2", "candidate": None}, acked={"champion": "1", "candidate": "3"}, seq=7)
    moves = detect_moves(snap)
    assert moves == [AliasMove("champion", "1", "2", 7), AliasMove("candidate", "3", None, 7)]
    assert moves[0].event_id("m") == AliasMove("champion", "1", "2", 7).event_id("m") != moves[0].event_id("other")
    assert len(moves[0].event_id("m")) == 32
    assert detect_moves(Snapshot(aliases={"champion": "1", "candidate": None},
                                 acked={"champion": "1", "candidate": None}, seq=0)) == []
