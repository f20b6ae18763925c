"""`stream: true`: the OpenAI-compatible answer as server-sent events, the way OpenAI's clients
read them.

`data: {chunk}\\n\\n` per generated token (chunk object `text_completion`, or
`chat.completion.chunk` whose first chunk per choice carries the role; with tools, each call the
moment its block closes as OpenAI's tool-call deltas: one with its index, id, type and name and
empty arguments, then its arguments), then one chunk per choice
with its `finish_reason`, a usage chunk when `stream_options.include_usage`, and
`data: [DONE]\\n\\n`. Text that may be the start of a stop string, or of a character whose bytes
have not all been generated, is held back until it is decided (choice_text.py). If Kafka does not
acknowledge the events at the end, the stream ends with `data: {"error": {...}}` and no `[DONE]`
(OpenAI's clients raise it). A client that disconnects mid-stream stops the generation after the
current token; each choice that generated at least one token still gets its one generation event
(`finish_reason: "cancelled"`, `stream: true`); a stream cancelled before its first token
generated nothing and writes no event (counted in
`flywheel_replica_streams_cancelled_total{recorded="no"}`). At most `max_open_streams` streams
are open at once (`OpenStreams`, `flywheel_replica_streams_open`); one more is 503
`too_many_streams`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response, StreamingResponse

from app.replica import metrics as m
from app.replica.admission import ClientGone
from app.replica.openai.calls import Call
from app.replica.openai.errors import OpenAIError, unavailable
from app.replica.openai.generation import Outcome, admit, generate, generation_error, usage
from app.replica.openai.plan import Plan
from app.replica.replica import Replica

log = logging.getLogger(__name__)


@dataclass
class OpenStreams:
    """The streamed responses one replica app has open now (app.state.streams), at most `limit`
    (`max_open_streams`), mirrored in `flywheel_replica_streams_open`."""

    replica_id: str
    limit: int
    count: int = 0

    def check_room(self) -> None:
        if self.count >= self.limit:
            raise unavailable(
                f"{self.count} streams are open (at most {self.limit})",
                "too_many_streams",
                1,
                "rejected",
            )

    def opened(self) -> None:
        self.count += 1
        m.STREAMS_OPEN.labels(self.replica_id).set(self.count)

    def closed(self) -> None:
        self.count -= 1
        m.STREAMS_OPEN.labels(self.replica_id).set(self.count)


def stream(replica: Replica, streams: OpenStreams, p: Plan) -> Response:
    """Start generating `p` as a job the replica owns and answer with its events; the job
    releases the plan when the generation is over (OpenAIError before the stream starts)."""
    streams.check_room()
    ticket = admit(replica, p)
    s = _Stream(replica, streams, p)
    replica.spawn(s.job(ticket))
    streams.opened()
    return EventStream(
        s.events(),
        on_close=s.closed,
        media_type="text/event-stream",
        headers={**p.headers(), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _Stream:
    """One streamed request: the generation job, which puts what happens on a queue (text deltas,
    then the outcome or an error), and the server-sent events read from it."""

    def __init__(self, replica: Replica, streams: OpenStreams, p: Plan):
        self.replica, self.streams, self.p = replica, streams, p
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.q: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.done = False  # the events ended as they should: closing then cancels nothing

    def push(self, deltas: list[tuple[int, str]]) -> None:
        """Queue text for the stream, in order, from the generation thread or the loop's own."""
        if threading.get_ident() == self.loop_thread:
            self.q.put_nowait(("deltas", deltas))
        else:
            self.loop.call_soon_threadsafe(self.q.put_nowait, ("deltas", deltas))

    async def job(self, ticket: Any) -> None:
        try:
            await self._run(ticket)
        finally:
            self.p.release()

    async def _run(self, ticket: Any) -> None:
        p, rid = self.p, self.replica.id
        try:
            out = await generate(self.replica, p, ticket, self.cancelled, self.push)
        except ClientGone:
            m.STREAMS_CANCELLED.labels(rid, "no").inc()
            m.count_openai(rid, p.endpoint, "disconnected")
            return
        except Exception as exc:  # the stream has started: say so in it (and in the log)
            err = generation_error(exc)
            if err is None:
                log.exception("streamed generation failed")
                err = OpenAIError(
                    500, f"generation failed: {exc}", type_="server_error", outcome="error"
                )
            self.q.put_nowait(("error", err))
            m.count_openai(rid, p.endpoint, err.outcome)
            return
        if self.cancelled.is_set():
            recorded = any(s.tokens for s in out.samples)
            m.STREAMS_CANCELLED.labels(rid, "yes" if recorded else "no").inc()
            m.count_openai(rid, p.endpoint, "cancelled")
            return
        m.count_openai(rid, p.endpoint, "ok")
        m.REQUEST_SECONDS.labels(rid).observe(time.perf_counter() - p.t_start)
        self.q.put_nowait(("done", out))

    async def events(self) -> AsyncIterator[bytes]:
        p = self.p
        if p.endpoint == "chat":
            yield _chunk(p, [_piece(p, i, "", None, first=True) for i in range(p.n)])
        while True:
            kind, item = await self.q.get()
            if kind == "deltas":
                for i, piece in item:
                    if isinstance(piece, str):
                        yield _chunk(p, [_piece(p, i, piece, None)])
                    else:
                        for delta in _call_deltas(piece):
                            yield _chunk(p, [_piece(p, i, None, None, calls=[delta])])
            elif kind == "error":
                self.done = True
                yield b"data: " + json.dumps(item.body()).encode() + b"\n\n"
                return
            else:
                out: Outcome = item
                for i, reason in enumerate(out.reasons):
                    yield _chunk(p, [_piece(p, i, None if p.endpoint == "chat" else "", reason)])
                if p.include_usage:
                    yield _chunk(p, [], usage(p, out), with_usage=True)
                self.done = True
                yield b"data: [DONE]\n\n"
                return

    def closed(self) -> None:
        self.streams.closed()
        if not self.done:
            self.cancelled.set()  # the client went away: stop after the current token


def _chunk(
    p: Plan, choices: list[dict[str, Any]], usage: dict | None = None, with_usage: bool = False
) -> bytes:
    body: dict[str, Any] = {
        "id": p.top_id,
        "object": "chat.completion.chunk" if p.endpoint == "chat" else "text_completion",
        "created": p.created,
        "model": p.model,
        "system_fingerprint": p.fingerprint,
        "choices": choices,
    }
    if with_usage or p.include_usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _call_deltas(call: Call) -> list[dict[str, Any]]:
    """OpenAI's tool-call deltas of one call: index, id, type and name first, then the arguments."""
    head = {"index": call.index, "id": call.id, "type": "function"}
    head["function"] = {"name": call.name, "arguments": ""}
    return [head, {"index": call.index, "function": {"arguments": call.arguments}}]


def _piece(
    p: Plan,
    i: int,
    text: str | None,
    reason: str | None,
    first: bool = False,
    calls: list[dict[str, Any]] | None = None,
) -> dict:
    c: dict[str, Any] = {"index": i}
    if p.endpoint == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if calls is not None:
            delta["tool_calls"] = calls
        c["delta"] = delta
    else:
        c["text"] = text or ""
    c["logprobs"] = None
    c["finish_reason"] = reason
    c["request_id"] = p.ids[i]
    return c


class EventStream(StreamingResponse):
    """A StreamingResponse that reports when it is over, finished or not (a client that disconnects
    cancels the send loop, even before its first chunk): `on_close` runs either way, synchronously."""

    def __init__(self, content: Any, *, on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
