"""Limits of every HTTP server Flywheel runs (the API and the replicas): sizes, timeouts, a connection cap.

Two layers, both configured from `app.settings.Settings` (the `http_*` fields):

- **Connections** (`GuardedHttpToolsProtocol`, uvicorn's httptools protocol with three additions):
  a connection must deliver a complete request head within `http_head_timeout` of opening (or of
  the first byte of its next request), else it is closed (408 if part of a head arrived); a head
  over `http_max_head_bytes` is answered 431 and closed; at most `http_max_connections`
  connections are open at once, one more is answered 503 + Retry-After and closed at once.
  uvicorn has no head-read timeout and httptools no head-size limit of their own, so they live
  here rather than in a proxy: the limits hold wherever `flywheel api` / `flywheel replica` run,
  with nothing else to deploy. Idle keep-alive connections close after `http_keepalive_timeout`
  (uvicorn's own timer).
- **Request bodies** (`BodyLimitMiddleware`, pure ASGI, outermost in each app): a per-route byte
  limit (`Content-Length` over it is answered 413 before anything is read; chunked or lying
  bodies are counted as they stream and cut at the limit); waits for body bytes are bounded
  (`http_body_idle_timeout` between chunks, `http_body_timeout` in total, answered 408).
  A request answered before its whole body arrived (a 413, a 401 from auth, any early answer)
  is settled so the client can read the answer: a client that sent `Expect: 100-continue` was
  never told to send the body, so it gets the answer at once; any other client's remaining body
  is read and discarded up to `http_drain_max_bytes` / `http_drain_timeout` first (clients such
  as urllib send the whole body before reading; closing on unread bytes resets the connection
  and loses the answer). Beyond those bounds the answer goes out with `Connection: close`.

    config = uvicorn_config(app, settings, host="127.0.0.1", port=8000)
    uvicorn.Server(config).run()

    app.add_middleware(BodyLimitMiddleware, limits=body_limits(settings, {"/v1/events": 4 << 20}))

Counted in `flywheel_http_rejected_total{reason}` and `flywheel_http_drained_bytes_total`.

`GuardedHttpToolsProtocol` subclasses uvicorn's private `HttpToolsProtocol` and its
`data_received` is uvicorn's with the head accounting added, so it is written against one
uvicorn: `UVICORN_VERSION`, pinned in pyproject.toml. tests/unit/test_httplimits_uvicorn.py fails,
saying what to port, when another uvicorn is installed or the copied method changed upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httptools
from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.settings import Settings

log = logging.getLogger(__name__)

# the uvicorn whose HttpToolsProtocol this module subclasses, and the sha256 of the source of the
# `data_received` that `GuardedHttpToolsProtocol.data_received` copies
UVICORN_VERSION = "0.54.0"
UVICORN_DATA_RECEIVED_SHA256 = "010a7ae59a5d3b1a5e7326ce246878568629d126a076d8af5ba10cab040fae43"

REJECTED = Counter(
    "flywheel_http_rejected_total",
    "Requests and connections refused by the HTTP limits, by reason "
    "(body_too_large, body_timeout, head_timeout, head_too_large, connection_limit).",
    ["reason"],
)
DRAINED = Counter(
    "flywheel_http_drained_bytes_total",
    "Body bytes read and discarded so that a client that was "
    "answered early (413, 401, ...) can read the answer.",
)


# --- settings -> limits -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerLimits:
    """Per-connection limits of the uvicorn protocol."""

    head_timeout_s: float  # complete request head within this long
    keepalive_timeout_s: float  # idle keep-alive connection closed after this long
    max_connections: int  # open connections at once; one more is answered 503 and closed
    max_head_bytes: int  # request line + headers


@dataclass(frozen=True)
class BodyLimits:
    """Per-request body limits of `BodyLimitMiddleware`."""

    default_bytes: int  # routes without their own limit
    routes: tuple[
        tuple[str, int], ...
    ]  # (path or path prefix ending in '/', limit); the longest match wins
    idle_timeout_s: float  # longest wait for the next body chunk
    total_timeout_s: float  # total time spent waiting for body bytes
    drain_max_bytes: int  # read and discard at most this much of an early-answered request's body
    drain_timeout_s: float  # ... for at most this long

    def limit_for(self, path: str) -> int:
        best, best_len = self.default_bytes, -1
        for route, limit in self.routes:
            hit = path.startswith(route) if route.endswith("/") else path == route
            if hit and len(route) > best_len:
                best, best_len = limit, len(route)
        return best


def server_limits(settings: Settings) -> ServerLimits:
    return ServerLimits(
        head_timeout_s=settings.http_head_timeout,
        keepalive_timeout_s=settings.http_keepalive_timeout,
        max_connections=settings.http_max_connections,
        max_head_bytes=settings.http_max_head_bytes,
    )


def body_limits(settings: Settings, routes: Mapping[str, int] | None = None) -> BodyLimits:
    """The body limits of `settings`, with per-route byte limits (`{"/v1/events": n, "/v1/admin/": m}`)."""
    return BodyLimits(
        default_bytes=settings.http_max_body_bytes,
        routes=tuple((routes or {}).items()),
        idle_timeout_s=settings.http_body_idle_timeout,
        total_timeout_s=settings.http_body_timeout,
        drain_max_bytes=settings.http_drain_max_bytes,
        drain_timeout_s=settings.http_drain_timeout,
    )


def proxy_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's proxy options for `trusted_proxies`: X-Forwarded-For is honoured only from those peers.

    uvicorn's own default trusts it from loopback peers; this turns that off unless configured.
    """
    trusted = settings.trusted_proxies.strip()
    return {"proxy_headers": bool(trusted), "forwarded_allow_ips": trusted or None}


def uvicorn_config(
    app: Any, settings: Settings, *, host: str, port: int, log_level: str = "info", **kwargs: Any
):
    """A `uvicorn.Config` serving `app` with the connection limits of `settings`."""
    import uvicorn

    limits = server_limits(settings)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http=GuardedHttpToolsProtocol.with_limits(limits),
        # the protocol closes connection max+1 itself; uvicorn's own check (503 on a request
        # while connections or tasks >= limit) then never fires below that cap
        limit_concurrency=limits.max_connections + 1,
        timeout_keep_alive=limits.keepalive_timeout_s,  # type: ignore[arg-type]  (float works)
        h11_max_incomplete_event_size=limits.max_head_bytes,
        **{**proxy_options(settings), **kwargs},
    )


async def read_capped(request: Any, limit: int, too_large_detail: str) -> bytes:
    """A route's body, or HTTPException(413, too_large_detail) as soon as it is known to exceed `limit`.

    `BodyLimitMiddleware` already bounds every route; a route with a tighter, route-specific limit
    (and its own 413 message) reads through this: the declared length first, then the bytes as
    they stream (chunked or lying clients cannot get past it).
    """
    from fastapi import HTTPException

    too_large = HTTPException(413, too_large_detail)
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _raw_response(status: int, phrase: str, message: str, extra: str = "") -> bytes:
    body = message.encode()
    return (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
        f"{extra}connection: close\r\n\r\n"
    ).encode() + body


# --- connections ------------------------------------------------------------------------------------
class _HeadTooLarge(Exception):
    pass


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a request-head timeout, a head-size limit and a connection cap.

    Use `GuardedHttpToolsProtocol.with_limits(limits)` as uvicorn's `http=` (see `uvicorn_config`).
    """

    limits: ServerLimits = ServerLimits(
        head_timeout_s=10.0, keepalive_timeout_s=5.0, max_connections=1000, max_head_bytes=16384
    )

    @classmethod
    def with_limits(cls, limits: ServerLimits) -> type[GuardedHttpToolsProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head, self._head_bytes, self._head_seen, self._head_too_large = True, 0, 0, False
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            REJECTED.labels("connection_limit").inc()
            log.debug(
                "refused a connection from %s: %d open, the cap is %d",
                self.client,
                len(self.connections) - 1,
                self.limits.max_connections,
            )
            self.connections.discard(
                self
            )  # not admitted: it must not count against the admitted ones
            transport.write(
                _raw_response(
                    503,
                    "Service Unavailable",
                    f"too many open connections (limit {self.limits.max_connections}); retry",
                    extra="retry-after: 1\r\n",
                )
            )
            transport.close()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._head_too_large:
                self._refuse_head(
                    431,
                    "Request Header Fields Too Large",
                    "head_too_large",
                    f"request head over {self.limits.max_head_bytes} bytes",
                )
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        if self._in_head and not self.transport.is_closing():
            # a head still incomplete after this chunk: count the chunk (httptools buffers a header
            # value internally until it ends, so the callbacks alone would not see a giant value)
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse_head(
                    431,
                    "Request Header Fields Too Large",
                    "head_too_large",
                    f"request head over {self.limits.max_head_bytes} bytes",
                )

    # parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._head_seen = True, 0, 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    # helpers
    def _count_head(self, n: int) -> None:
        self._head_seen += n
        if self._head_seen > self.limits.max_head_bytes:
            self._head_too_large = True
            raise _HeadTooLarge()  # httptools turns it into HttpParserCallbackError; data_received answers 431

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes or self._head_seen:
            self._refuse_head(
                408,
                "Request Timeout",
                "head_timeout",
                f"request head not complete within {self.limits.head_timeout_s:g}s",
            )
        else:  # a connection that never sent a byte (or went quiet between requests' heads)
            REJECTED.labels("head_timeout").inc()
            self.transport.close()

    def _refuse_head(self, status: int, phrase: str, reason: str, message: str) -> None:
        REJECTED.labels(reason).inc()
        log.debug("closing connection from %s: %s", self.client, message)
        self._cancel_head_timer()
        self.transport.write(_raw_response(status, phrase, message))
        self.transport.close()


# --- request bodies ---------------------------------------------------------------------------------
class BodyLimitMiddleware:
    """Pure ASGI middleware: per-route body limit, body read timeouts, and settling early answers.

    Add it last (`app.add_middleware` puts it outermost), so that it sees every response.
    """

    def __init__(self, app: Any, limits: BodyLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await _Exchange(self.limits, scope, receive, send).run(self.app)


class _Exchange:
    """One request/response under `BodyLimits`: wraps the app's receive and send."""

    def __init__(self, limits: BodyLimits, scope: dict, receive: Any, send: Any):
        self.limits, self.scope, self._receive, self._send = limits, scope, receive, send
        self.limit = limits.limit_for(scope["path"])
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").strip()
        self.declared = int(declared) if declared.isdigit() else None
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        self.expect_continue = headers.get(b"expect", b"").lower() == b"100-continue"
        self.body_done = not chunked and not self.declared  # no body to wait for
        self.received = 0
        self.wait_budget = limits.total_timeout_s
        self.receive_called = False
        self.response_started = False
        self.answered = False  # this middleware sent the response; the app's own is dropped

    async def run(self, app: Any) -> None:
        if self.declared is not None and self.declared > self.limit:
            await self.reject(
                413,
                "body_too_large",
                f"request body of {self.declared} bytes exceeds the "
                f"{self.limit}-byte limit of {self.scope['path']}",
            )
            return
        try:
            await app(self.scope, self.receive, self.send)
        except Exception:
            if not self.answered:
                raise
            log.debug(
                "%s %s: the app failed after the request was answered by the HTTP limits",
                self.scope.get("method"),
                self.scope["path"],
                exc_info=True,
            )

    async def receive(self) -> dict:
        if self.answered:
            return {"type": "http.disconnect"}
        if self.body_done:
            return (
                await self._receive()
            )  # after the body: disconnect notifications, unbounded by design
        self.receive_called = True
        message = await self._timed_receive(min(self.limits.idle_timeout_s, self.wait_budget))
        if message is None:
            await self.reject(
                408,
                "body_timeout",
                f"request body not received in time (at most "
                f"{self.limits.idle_timeout_s:g}s between chunks, "
                f"{self.limits.total_timeout_s:g}s in all)",
            )
            return {"type": "http.disconnect"}
        if message["type"] != "http.request":
            self.body_done = True
            return message
        self.received += len(message.get("body", b""))
        if not message.get("more_body", False):
            self.body_done = True
        if self.received > self.limit:
            await self.reject(
                413,
                "body_too_large",
                f"request body exceeds the {self.limit}-byte limit of {self.scope['path']}",
            )
            return {"type": "http.disconnect"}
        return message

    async def send(self, message: dict) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start" and not self.response_started:
            self.response_started = True
            if not self.body_done:
                message = await self._settled(message)
        await self._send(message)

    async def reject(self, status: int, reason: str, detail: str) -> None:
        """Answer `status` with `{"detail": ...}` in place of the app (if it has not started answering)."""
        REJECTED.labels(reason).inc()
        log.info(
            "%s %s answered %d: %s", self.scope.get("method"), self.scope["path"], status, detail
        )
        if (
            self.response_started
        ):  # nothing can be said any more; dropping the rest makes uvicorn close
            self.answered = True
            return
        self.response_started = True
        body = json.dumps({"detail": detail}).encode()
        start = {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
        if status != 408:
            start = await self._settled(start)
        else:
            start["headers"].append((b"connection", b"close"))
        self.answered = True
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    # helpers
    async def _timed_receive(self, timeout_s: float) -> dict | None:
        if timeout_s <= 0:
            return None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._receive()
        except TimeoutError:
            return None
        finally:
            self.wait_budget -= loop.time() - t0

    async def _settled(self, start: dict) -> dict:
        """Drain the unread body within bounds; if some is still unread, answer with Connection: close."""
        await self._drain()
        if not self.body_done:
            start = {**start, "headers": [*start.get("headers", []), (b"connection", b"close")]}
        return start

    async def _drain(self) -> None:
        if self.expect_continue and not self.receive_called:
            return  # uvicorn sends 100 Continue only when the app reads: the client has not sent the body
        if (
            self.declared is not None
            and self.declared - self.received > self.limits.drain_max_bytes
        ):
            return  # too much to read for an answer: close instead
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.drain_timeout_s
        drained = 0
        while not self.body_done and drained <= self.limits.drain_max_bytes:
            message = await self._timed_receive(
                min(deadline - loop.time(), self.limits.idle_timeout_s)
            )
            if message is None:
                break
            if message["type"] != "http.request":
                self.body_done = True
                break
            drained += len(message.get("body", b""))
            self.body_done = not message.get("more_body", False)
        self.received += drained
        DRAINED.inc(drained)
