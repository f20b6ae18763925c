"""HTTP limits of the API on real uvicorn and real sockets (app/httplimits.py).

Slow-loris connections (half-sent head, half-sent or trickled body, idle, no credentials) are
closed within the configured timeouts; the connection cap holds and frees up; oversized bodies
are answered 413 in a way the client can read (urllib, Expect: 100-continue) or without being
read at all (400 MiB). The timeouts are set short here (1 s / 3 s) so the bounds are tested,
not waited out; each test prints what it measured (`pytest -s`).
"""

from __future__ import annotations

import json
import select
import socket
import time
import urllib.error
import urllib.request

import httpx
import pytest

from tests.integration.hostile.apiserver import (
    connect,
    head,
    read_until_closed,
    start_api,
    status_of,
)

pytestmark = pytest.mark.integration

HEAD_S, IDLE_S, TOTAL_S = 1.0, 1.0, 3.0
MAX_CONNECTIONS = 8
SLACK_S = 5.0  # generous: the machine is shared; a hang shows up as 30 s


@pytest.fixture()
def api(make_settings):
    api = start_api(
        make_settings,
        http_head_timeout=HEAD_S,
        http_body_idle_timeout=IDLE_S,
        http_body_timeout=TOTAL_S,
        http_max_connections=MAX_CONNECTIONS,
        webhook_secret="hostile-secret",
    )
    yield api
    api.server.stop()


def metric(api, name: str, labels: str = "") -> float:
    text = httpx.get(f"{api.url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + (("{" + labels + "}") if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- oversized bodies --------------------------------------------------------------------------
def test_urllib_reads_the_413_for_a_4_3_mb_ingest_body(api):
    """urllib sends `Connection: close` and the whole body before reading: the server must read
    (and discard) the rest before answering, or the client sees a reset instead of the 413."""
    body = b'{"events": [' + b" " * 4_300_000 + b"]}"
    req = urllib.request.Request(
        f"{api.url}/v1/events",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", **api.auth("ingest")},
    )
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    elapsed = time.monotonic() - t0
    assert exc.value.code == 413
    detail = json.loads(exc.value.read())["detail"]
    assert "4194304-byte limit" in detail, detail
    print(f"\nurllib 4.3 MB POST /v1/events: 413 in {elapsed:.3f}s: {detail}")
    # and without a key the same (the size is checked before auth, nothing is read for it)
    req = urllib.request.Request(f"{api.url}/v1/events", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    assert exc.value.code == 413


def test_expect_100_continue_gets_the_413_before_sending_anything(api):
    s = connect(api)
    s.sendall(
        head(
            "POST",
            "/v1/events",
            {
                "Content-Length": "4300000",
                "Expect": "100-continue",
                "Content-Type": "application/json",
                **api.auth("ingest"),
            },
        )
    )
    raw, elapsed = read_until_closed(s)
    assert status_of(raw) == 413, raw[:200]
    assert b"100 Continue" not in raw and b"connection: close" in raw.lower()
    assert elapsed < SLACK_S
    print(
        f"\nExpect: 100-continue, 4.3 MB declared: 413 and close after {elapsed:.3f}s, no body sent"
    )


def test_a_chunked_body_over_the_limit_is_cut_at_the_limit(api):
    """No Content-Length to check up front: the body is counted as it streams."""

    def chunks():
        for _ in range(80):  # 80 x 64 KiB = 5 MiB > 4 MiB
            yield b" " * 65536

    r = httpx.post(f"{api.url}/v1/events", content=chunks(), headers=api.auth("ingest"), timeout=30)
    assert r.status_code == 413, r.text


def _send_until_answered(
    s: socket.socket, total: int, timeout_s: float = 60.0
) -> tuple[int, bytes, float]:
    """Send up to `total` zero bytes without blocking while watching for an answer.
    Returns (bytes the kernel accepted before the answer arrived, the answer, seconds)."""
    s.setblocking(False)
    chunk = b"\0" * 65536
    sent, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        readable, writable, _ = select.select([s], [s] if sent < total else [], [], 0.5)
        if readable:
            break
        if writable:
            try:
                sent += s.send(chunk[: min(len(chunk), total - sent)])
            except (BlockingIOError, InterruptedError):
                pass
            except (BrokenPipeError, ConnectionResetError):
                break
    elapsed = time.monotonic() - t0
    s.setblocking(True)
    raw, _ = read_until_closed(s, timeout_s=10)
    return sent, raw, elapsed


@pytest.mark.parametrize("signed_headers", [False, True], ids=["unsigned", "with-fake-signature"])
def test_a_400_mib_webhook_post_is_answered_without_being_read(api, signed_headers):
    drained_before = metric(api, "flywheel_http_drained_bytes_total")
    total = 400 * 1024 * 1024
    hdrs = {"Content-Length": str(total), "Content-Type": "application/json"}
    if signed_headers:
        hdrs.update(
            {
                "X-MLflow-Delivery-Id": "d-400",
                "X-MLflow-Timestamp": str(int(time.time())),
                "X-MLflow-Signature": "v1,AAAA",
            }
        )
    s = connect(api)
    s.sendall(head("POST", "/v1/hooks/mlflow", hdrs))
    sent, raw, elapsed = _send_until_answered(s, total)
    s.close()
    assert status_of(raw) in (401, 413), raw[:300]
    assert sent < 32 * 1024 * 1024, (
        f"{sent} bytes went out before the answer: the body was being read"
    )
    assert metric(api, "flywheel_http_drained_bytes_total") == drained_before, "nothing was drained"
    print(
        f"\n400 MiB webhook ({'fake-signed' if signed_headers else 'unsigned'}): {status_of(raw)} after "
        f"{elapsed:.3f}s; the client got {sent} bytes ({sent / 2**20:.2f} MiB) into socket buffers first"
    )


def test_an_unsigned_webhook_is_refused_before_its_body_is_read(api):
    """Headers checked first: with Expect: 100-continue the server never asks for the body."""
    s = connect(api)
    s.sendall(
        head("POST", "/v1/hooks/mlflow", {"Content-Length": "60000", "Expect": "100-continue"})
    )
    raw, elapsed = read_until_closed(s)
    assert status_of(raw) == 401 and b"missing X-MLflow-Delivery-Id" in raw, raw[:300]
    assert b"100 Continue" not in raw
    print(
        f"\nunsigned webhook, 60 kB declared, Expect: 100-continue: 401 after {elapsed:.3f}s, no body read"
    )


# --- slow clients --------------------------------------------------------------------------------
def test_a_half_sent_head_is_answered_408_and_closed_after_the_head_timeout(api):
    before = metric(api, "flywheel_http_rejected_total", 'reason="head_timeout"')
    s = connect(api)
    s.sendall(b"POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    raw, elapsed = read_until_closed(s)
    assert status_of(raw) == 408, raw[:200]
    assert HEAD_S * 0.8 <= elapsed < HEAD_S + SLACK_S
    assert metric(api, "flywheel_http_rejected_total", 'reason="head_timeout"') == before + 1
    print(f"\nhalf-sent head: 408 and closed after {elapsed:.2f}s (http_head_timeout {HEAD_S}s)")


def test_a_head_sent_one_byte_at_a_time_is_cut_at_the_head_timeout(api):
    """The head timeout is a deadline for the whole head, not an idle timeout a trickle can reset."""
    s = connect(api)
    t0 = time.monotonic()
    data = head("GET", "/healthz", {"X-Padding": "p" * 200})
    closed_at = None
    for b in data:
        try:
            s.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            closed_at = time.monotonic() - t0
            break
        time.sleep(0.05)  # 250 bytes at 20/s would take 12 s
        if select.select([s], [], [], 0)[0]:
            break
    raw, _ = read_until_closed(s)
    closed_at = closed_at or time.monotonic() - t0
    assert status_of(raw) == 408 or raw == b"", raw[:200]
    assert closed_at < HEAD_S + SLACK_S
    print(f"\nhead trickled at 20 B/s: closed after {closed_at:.2f}s")


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(api):
    s = connect(api)
    raw, elapsed = read_until_closed(s)
    assert raw == b"" and HEAD_S * 0.8 <= elapsed < HEAD_S + SLACK_S
    print(f"\nsilent connection: closed after {elapsed:.2f}s")


def test_a_half_sent_body_without_credentials_is_closed(api):
    """No key: 401 before the body is read; the unread rest is waited for only up to the idle timeout."""
    s = connect(api)
    s.sendall(
        head("POST", "/v1/events", {"Content-Length": "100000", "Content-Type": "application/json"})
    )
    s.sendall(b'{"events": [')
    raw, elapsed = read_until_closed(s)
    assert status_of(raw) == 401 and b"connection: close" in raw.lower(), raw[:300]
    assert elapsed < IDLE_S + SLACK_S
    print(f"\nhalf-sent body, no key: 401 and closed after {elapsed:.2f}s")


def test_a_stalled_body_is_answered_408_after_the_idle_timeout(api):
    s = connect(api)
    s.sendall(
        head(
            "POST",
            "/v1/events",
            {"Content-Length": "100000", "Content-Type": "application/json", **api.auth("ingest")},
        )
    )
    s.sendall(b'{"events": [')
    raw, elapsed = read_until_closed(s)
    assert status_of(raw) == 408, raw[:300]
    assert b"connection: close" in raw.lower() and IDLE_S * 0.8 <= elapsed < IDLE_S + SLACK_S
    print(
        f"\nstalled body (valid key): 408 and closed after {elapsed:.2f}s (http_body_idle_timeout {IDLE_S}s)"
    )


def test_a_trickled_body_is_answered_408_at_the_total_body_timeout(api):
    """One byte every 0.4 s never trips the 1 s idle timeout; the 3 s total does."""
    s = connect(api)
    s.sendall(
        head(
            "POST",
            "/v1/deployments/pause",
            {"Content-Length": "10000", "Content-Type": "application/json", **api.auth("admin")},
        )
    )
    t0 = time.monotonic()
    while time.monotonic() - t0 < TOTAL_S + SLACK_S:
        if select.select([s], [], [], 0.4)[0]:
            break
        try:
            s.sendall(b" ")
        except (BrokenPipeError, ConnectionResetError):
            break
    raw, _ = read_until_closed(s)
    elapsed = time.monotonic() - t0
    assert status_of(raw) == 408, raw[:300]
    assert TOTAL_S * 0.8 <= elapsed < TOTAL_S + SLACK_S
    print(
        f"\nbody trickled at 2.5 B/s: 408 and closed after {elapsed:.2f}s (http_body_timeout {TOTAL_S}s)"
    )


def test_an_oversized_head_is_answered_431(api):
    s = connect(api)
    s.sendall(head("GET", "/healthz", {"X-Big": "b" * 40_000}))
    raw, _ = read_until_closed(s)
    assert status_of(raw) == 431, raw[:200]


def test_an_endless_header_value_is_answered_431_without_waiting_for_its_end(api):
    """httptools buffers a header value until it ends: the raw bytes of an unfinished head count too."""
    s = connect(api)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
    t0 = time.monotonic()
    try:
        for _ in range(64):  # up to 64 x 1 KiB, never a line end
            s.sendall(b"e" * 1024)
            if select.select([s], [], [], 0.005)[0]:
                break  # the answer is there: stop sending (more bytes would make the close a reset)
    except (BrokenPipeError, ConnectionResetError):
        pass
    raw, _ = read_until_closed(s)
    assert status_of(raw) == 431, raw[:200]
    assert time.monotonic() - t0 < HEAD_S, "refused on size, not by the head timeout"


# --- connection cap -------------------------------------------------------------------------------
def test_the_connection_cap_holds_and_frees_up(api):
    hogs = [connect(api) for _ in range(MAX_CONNECTIONS)]  # open, silent
    for h in hogs:
        h.sendall(b"GET /hea")  # half a head each
    time.sleep(0.2)
    extra = connect(api)
    raw, elapsed = read_until_closed(extra)
    assert status_of(raw) == 503 and b"retry-after: 1" in raw.lower() and elapsed < SLACK_S, raw[
        :200
    ]
    refused = 1
    for _ in range(5):  # the cap keeps holding while the hogs are open
        extra = connect(api)
        raw, _ = read_until_closed(extra)
        refused += status_of(raw) == 503
    assert refused == 6
    t0 = time.monotonic()
    for h in hogs:  # the head timeout closes the hogs ...
        read_until_closed(h)
    freed = time.monotonic() - t0
    r = httpx.get(f"{api.url}/healthz", timeout=10)  # ... and the server serves again
    assert r.status_code == 200
    print(
        f"\nconnection cap {MAX_CONNECTIONS}: {refused} further connections answered 503 + Retry-After at once; "
        f"the hogs were closed {freed:.2f}s later by the head timeout and /healthz answered 200"
    )


def test_keep_alive_connections_serve_requests_within_the_limits(api):
    """The limits do not get in the way of a normal client: several requests on one connection."""
    with httpx.Client(base_url=api.url, timeout=10) as client:
        for _ in range(5):
            assert client.get("/healthz").status_code == 200
        r = client.post("/v1/deployments/pause", content=b"{}", headers=api.auth("read"))
        assert r.status_code == 403
        assert client.get("/healthz").status_code == 200
