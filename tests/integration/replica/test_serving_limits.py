"""Serving limits of a real replica over real HTTP on the real broker: a full generation queue answers
503 + Retry-After at once while the queued requests still complete, a client that left while queued
costs no generation, the optional serving key, and the queue's Prometheus metrics.

The generation thread is held by a test-controlled call in the replica's own queue (HeldThread), so
"the queue is full" is a state the test sets up, not a race against the model's speed."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.integration.replica.conftest import HeldThread, metric, read_topic, wait_for

pytestmark = pytest.mark.integration

SMALL = {"max_n": 2, "max_tokens": 16}  # a maximal request costs 2 * 16 = 32


def post_in_thread(url: str, body: dict, results: list, **kw: Any) -> threading.Thread:
    def go() -> None:
        try:
            results.append(
                httpx.post(f"{url}/v1/complete", json=body, timeout=kw.get("timeout", 120))
            )
        except httpx.HTTPError as exc:
            results.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_a_full_queue_answers_503_with_retry_after_at_once_and_the_queued_requests_still_complete(
    seeded_replica,
):
    srv = seeded_replica(id="replica-full", max_queued=2, max_queued_cost=64, **SMALL)
    rid = srv.config.id
    body = {"session_id": "s", "prompt": "def f(", "max_tokens": 16, "n": 2}
    queued: list = []
    with HeldThread(srv):
        threads = [post_in_thread(srv.url, body, queued) for _ in range(2)]
        wait_for(lambda: srv.replica.queue.depth == 2, 30, "two requests queued")
        assert metric(srv, "flywheel_replica_queue_depth", replica_id=rid) == 2
        assert metric(srv, "flywheel_replica_queue_cost", replica_id=rid) == 64

        r = httpx.post(f"{srv.url}/v1/complete", json={**body, "max_tokens": 1, "n": 1}, timeout=30)
        assert r.status_code == 503, r.text
        assert (
            int(r.headers["Retry-After"]) >= 1
            and "2 requests are already queued" in r.json()["detail"]
        )
        assert (
            metric(
                srv, "flywheel_replica_queue_rejections_total", replica_id=rid, reason="requests"
            )
            == 1
        )
        assert (
            metric(srv, "flywheel_replica_requests_total", replica_id=rid, outcome="rejected") == 1
        )
        assert not queued, "nothing answered while the thread is held"
    for t in threads:
        t.join(120)
    assert [q.status_code for q in queued] == [200, 200], queued
    assert metric(srv, "flywheel_replica_queue_depth", replica_id=rid) == 0
    assert (
        metric(srv, "flywheel_replica_queue_wait_seconds_count", replica_id=rid) >= 3
    )  # held call + 2
    ids = [c["request_id"] for q in queued for c in q.json()["completions"]]
    events = read_topic(srv.settings, "interactions", 4, where=lambda e: e.get("request_id") in ids)
    assert len(events) == 4, "the queued requests were generated and logged"


def test_the_cost_bound_refuses_what_would_exceed_it_and_admits_what_fits(seeded_replica):
    srv = seeded_replica(id="replica-cost", max_queued=8, max_queued_cost=40, **SMALL)
    rid = srv.config.id
    done: list = []
    with HeldThread(srv):
        t1 = post_in_thread(
            srv.url, {"session_id": "a", "prompt": "x", "max_tokens": 16, "n": 2}, done
        )  # 32
        wait_for(lambda: srv.replica.queue.depth == 1, 30, "the first request queued")
        r = httpx.post(
            f"{srv.url}/v1/complete",
            json={"session_id": "b", "prompt": "x", "max_tokens": 16},
            timeout=30,
        )  # 32 + 16 > 40
        assert r.status_code == 503 and "Retry-After" in r.headers, r.text
        assert "would exceed the bound of 40" in r.json()["detail"]
        t2 = post_in_thread(
            srv.url, {"session_id": "c", "prompt": "x", "max_tokens": 8}, done
        )  # 32 + 8 fits
        wait_for(lambda: srv.replica.queue.depth == 2, 30, "the request that fits queued")
    t1.join(120)
    t2.join(120)
    assert sorted(d.status_code for d in done) == [200, 200], done
    assert (
        metric(srv, "flywheel_replica_queue_rejections_total", replica_id=rid, reason="cost") == 1
    )


def test_a_client_that_left_while_queued_costs_no_generation(seeded_replica):
    srv = seeded_replica(id="replica-gone", **SMALL)
    rid = srv.config.id
    gone: list = []
    with HeldThread(srv):
        t = post_in_thread(
            srv.url, {"session_id": "s", "prompt": "x", "max_tokens": 16}, gone, timeout=1.0
        )
        wait_for(lambda: srv.replica.queue.depth == 1, 30, "the request queued")
        t.join(30)
        assert isinstance(gone[0], httpx.TimeoutException), (
            gone
        )  # the client gave up and closed its connection
        time.sleep(1.0)  # let the server read the close
        generated_before = metric(srv, "flywheel_replica_generation_seconds_count", replica_id=rid)
    wait_for(
        lambda: (
            metric(srv, "flywheel_replica_requests_total", replica_id=rid, outcome="disconnected")
            == 1
        ),
        30,
        "the queued request to be dropped as disconnected",
    )
    assert (
        metric(srv, "flywheel_replica_generation_seconds_count", replica_id=rid) == generated_before
    )
    ok = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "s", "prompt": "x", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_the_serving_key_guards_complete_and_leaves_health_readiness_and_metrics_open(
    seeded_replica,
):
    srv = seeded_replica(id="replica-key", api_key="s3cret-serving-key")
    body = {"session_id": "s", "prompt": "x", "max_tokens": 2}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "s3cret-serving-key"},
        {"Authorization": "Basic s3cret-serving-key"},
        {"Authorization": "Bearer s3cret-serving-ke"},
    ):
        r = httpx.post(f"{srv.url}/v1/complete", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["WWW-Authenticate"] == "Bearer"
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json=body,
        headers={"Authorization": "Bearer s3cret-serving-key"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json=body,
        headers={"authorization": "bearer s3cret-serving-key"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert httpx.get(f"{srv.url}/healthz").status_code == 200
    assert httpx.get(f"{srv.url}/readyz").status_code == 200
    assert httpx.get(f"{srv.url}/v1/status").status_code == 200
    assert (
        metric(
            srv, "flywheel_replica_requests_total", replica_id="replica-key", outcome="unauthorized"
        )
        == 5
    )


def test_a_request_without_the_key_is_refused_before_its_body_is_read(seeded_replica):
    srv = seeded_replica(id="replica-key-early", api_key="k")
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        # claims 500 KB (under the 1 MiB body limit, so the size check lets it through) and sends none
        # of it: only an answer that does not wait for the body arrives
        sock.sendall(
            b"POST /v1/complete HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500000\r\n\r\n"
        )
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head[:200]
