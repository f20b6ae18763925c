"""FeedbackClient: the small Python client editors use to send interaction events.

It batches events, fills in `event_id` (uuid4) and `ts` (now, UTC) when absent, and posts
batches to `POST /v1/events`. 503 / 429 / 5xx answers and connection errors are retried
with exponential backoff and jitter (tenacity), honouring the server's Retry-After, and a
retry re-sends the SAME events with the SAME event_ids, so the pipeline's event_id dedupe
makes retries safe. A 4xx answer is never re-sent as it was:

- 413 naming events (each over the server's `max_event_bytes`): those events are refused
  and the rest of the batch is posted again without them;
- 413 for the whole body (over `max_body_bytes`): the batch is halved and each half posted,
  down to one event, which is then refused;
- any other 4xx (422 validation, 401, 403): the batch is refused.

Refused events end in one `FeedbackRejected` per flush, raised after every other pending
event was posted, carrying the server's `errors` (`[{"index", "field", "message"}]`, index
into the exception's `events`); background flushes collect it in `errors` and `close()`
raises it. Event ids never change. Pending events are flushed when the batch is full,
every `flush_interval_s` by a background thread, on `flush()`, on `close()` and on leaving
a `with` block.

    from app.client import FeedbackClient

    with FeedbackClient("http://127.0.0.1:8000", api_key) as fc:
        fc.generation("req-1", "sess-1", model_version="3", prompt_tokens=[1, 2],
                      completion_tokens=[3], logprobs=[-0.1], temperature=1.0)
        fc.accept("req-1", "sess-1")
        fc.rating("req-1", "sess-1", value=1)
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0


class FeedbackError(Exception):
    """Base class of the client's errors."""


class FeedbackRejected(FeedbackError):
    """The server refused events for a reason retrying cannot fix (422, 413 for one event, 401, 403).

    `events` are the refused events (the rest of the flush was posted); `errors` is the
    server's list of `{"index", "field", "message"}` with `index` into `events`, or one entry
    built from the server's `detail` for non-validation answers. `status_code` is the first
    refusal's; `accepted` counts the events of the same flush that were accepted.
    """

    def __init__(
        self,
        status_code: int,
        errors: list[dict[str, Any]],
        events: list[dict[str, Any]],
        accepted: int = 0,
    ):
        self.status_code, self.errors, self.events, self.accepted = (
            status_code,
            errors,
            events,
            accepted,
        )
        lines = "; ".join(
            f"[{e.get('index')}] {e.get('field')}: {e.get('message')}" for e in errors[:10]
        )
        more = f" (+{len(errors) - 10} more)" if len(errors) > 10 else ""
        super().__init__(
            f"server rejected a batch of {len(events)} events with HTTP {status_code}: {lines}{more}"
        )


class FeedbackUnavailable(FeedbackError):
    """The server or Kafka stayed unavailable through every retry; the events stay pending."""


class _Unsent(Exception):
    """FeedbackUnavailable during a flush: the events not yet accepted (kept pending), and the
    count accepted and the refusals before it happened."""

    def __init__(
        self,
        error: FeedbackUnavailable,
        events: list[dict[str, Any]],
        accepted: int,
        refused: list[FeedbackRejected],
    ):
        super().__init__(str(error))
        self.error, self.events, self.accepted, self.refused = error, events, accepted, refused


class Retryable(Exception):
    """A request the server refused for now, or that never reached it: worth trying again, after at
    least `retry_after_s` (the server's Retry-After; None: the backoff alone)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def wait_retry_after(
    backoff: Callable[[RetryCallState], float],
) -> Callable[[RetryCallState], float]:
    """A tenacity wait: `backoff`, and never less than the failed attempt's `retry_after_s`."""

    def wait(state: RetryCallState) -> float:
        b = backoff(state)
        exc = state.outcome.exception() if state.outcome else None
        retry_after = getattr(exc, "retry_after_s", None)
        return max(b, retry_after) if retry_after is not None else b

    return wait


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class FeedbackClient:
    """Batching, retrying client of `POST /v1/events`. Thread-safe; one instance per process is enough."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        batch_size: int = 100,
        flush_interval_s: float = 1.0,
        max_retries: int = 8,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 10.0,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ):
        """
        base_url: the API root, e.g. http://127.0.0.1:8000.
        api_key: a key with the `ingest` scope (`flywheel keys create --scope ingest`).
        batch_size: events per POST (the server accepts at most 1000).
        flush_interval_s: a background thread flushes pending events this often; 0 disables it.
        max_retries: retries of one batch on 503/429/5xx/connection errors before FeedbackUnavailable.
        backoff_initial_s, backoff_max_s: exponential backoff with jitter between retries; a
            Retry-After from the server is honoured (up to 60 s) when it asks for longer.
        timeout_s: HTTP timeout of one request.
        transport: an httpx transport to use instead of the network (tests, proxies).
        """
        assert 1 <= batch_size <= 1000, (
            f"batch_size must be in 1..1000 (the server's limit), got {batch_size}"
        )
        assert max_retries >= 0 and flush_interval_s >= 0, (
            f"{max_retries=} {flush_interval_s=} must be >= 0"
        )
        self.batch_size, self.max_retries = batch_size, max_retries
        self.errors: list[FeedbackError] = []  # failures of background flushes (also logged)
        self._wait = wait_retry_after(
            wait_exponential_jitter(initial=backoff_initial_s, max=backoff_max_s)
        )
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            timeout=timeout_s,
            transport=transport,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        )
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # guards _pending
        self._flush_lock = threading.Lock()  # one batch in flight at a time, in order
        self._stop = threading.Event()
        self._closed = False
        self._timer = None
        if flush_interval_s > 0:
            self._timer = threading.Thread(
                target=self._flush_periodically,
                args=(flush_interval_s,),
                name="feedback-flush",
                daemon=True,
            )
            self._timer.start()

    # --- events -----------------------------------------------------------------------------------
    def send(self, event: dict[str, Any]) -> str:
        """Queue one event (a dict in the docs/DESIGN.md §Editor events schema); returns its event_id."""
        if self._closed:
            raise FeedbackError("the client is closed")
        ev = {k: v for k, v in event.items() if v is not None}
        ev.setdefault("event_id", str(uuid.uuid4()))
        ts = ev.setdefault("ts", now_rfc3339())
        if isinstance(ts, datetime):
            assert ts.tzinfo is not None, f"ts must be timezone-aware, got {ts!r}"
            ev["ts"] = ts.isoformat().replace("+00:00", "Z")
        try:  # fail here, at the caller, rather than in a later (background) flush
            json.dumps(ev, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"event {ev['event_id']} is not valid JSON ({exc}); NaN/Infinity are rejected"
            ) from None
        with self._lock:
            self._pending.append(ev)
            full = len(self._pending) >= self.batch_size
        if full:
            self.flush()
        return ev["event_id"]

    def _event(
        self, type_: str, request_id: str, session_id: str, common: dict[str, Any], **fields: Any
    ) -> str:
        return self.send(
            {"type": type_, "request_id": request_id, "session_id": session_id, **common, **fields}
        )

    def generation(
        self,
        request_id: str,
        session_id: str,
        *,
        model_version: str,
        prompt_tokens: list[int],
        completion_tokens: list[int],
        logprobs: list[float],
        temperature: float,
        tokenizer: str = "byte-v1",
        routes: str | None = None,
        route_shape: list[int] | None = None,
        group_id: str | None = None,
        latency_ms: float | None = None,
        **common: Any,
    ) -> str:
        return self._event(
            "generation",
            request_id,
            session_id,
            common,
            model_version=model_version,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            logprobs=logprobs,
            temperature=temperature,
            tokenizer=tokenizer,
            routes=routes,
            route_shape=list(route_shape) if route_shape is not None else None,
            group_id=group_id,
            latency_ms=latency_ms,
        )

    def accept(self, request_id: str, session_id: str, **common: Any) -> str:
        return self._event("accept", request_id, session_id, common)

    def reject(self, request_id: str, session_id: str, **common: Any) -> str:
        return self._event("reject", request_id, session_id, common)

    def edit_persistence(
        self, request_id: str, session_id: str, fraction: float, after_s: float, **common: Any
    ) -> str:
        return self._event(
            "edit_persistence", request_id, session_id, common, fraction=fraction, after_s=after_s
        )

    def rating(self, request_id: str, session_id: str, value: int, **common: Any) -> str:
        return self._event("rating", request_id, session_id, common, value=value)

    def tool_error(
        self,
        request_id: str,
        session_id: str,
        message: str,
        token_index: int,
        hint: str | None = None,
        **common: Any,
    ) -> str:
        return self._event(
            "tool_error",
            request_id,
            session_id,
            common,
            message=message,
            token_index=token_index,
            hint=hint,
        )

    def followup(self, request_id: str, session_id: str, sentiment: float, **common: Any) -> str:
        return self._event("followup", request_id, session_id, common, sentiment=sentiment)

    def session_outcome(self, request_id: str, session_id: str, outcome: str, **common: Any) -> str:
        """How agent session `session_id` ended: `success`, `failure` or `abandoned`. `request_id`
        names its last generation (docs/AGENTS.md "Sessions")."""
        return self._event("session_outcome", request_id, session_id, common, outcome=outcome)

    # --- flushing -------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self) -> int:
        """Post every pending event; returns how many were accepted.

        Raises FeedbackRejected for the events the server refused (after posting all the
        others: they cannot succeed by resending) or FeedbackUnavailable (the events not yet
        accepted stay pending, in order, for the next flush).
        """
        accepted, refused = 0, []
        with self._flush_lock:
            while True:
                with self._lock:
                    batch = self._pending[: self.batch_size]
                    del self._pending[: len(batch)]
                if not batch:
                    break
                try:
                    n, rejected = self._post(batch)
                except _Unsent as exc:
                    with self._lock:
                        self._pending[:0] = (
                            exc.events
                        )  # keep order and event_ids for the next attempt
                    refused.extend(exc.refused)
                    if refused:  # not lost: reported like a background failure
                        self._record(_merge(refused, accepted + exc.accepted))
                    raise exc.error from None
                accepted += n
                refused.extend(rejected)
        if refused:
            raise _merge(refused, accepted)
        return accepted

    def _post(self, batch: list[dict[str, Any]]) -> tuple[int, list[FeedbackRejected]]:
        """Post `batch`, splitting it on 413; returns (accepted, refusals). Raises _Unsent."""
        accepted, refused = 0, []
        todo = [batch]
        while todo:
            part = todo.pop(0)
            try:
                resp = self._post_with_retries(part)
            except FeedbackUnavailable as exc:
                raise _Unsent(
                    exc, [ev for p in [part, *todo] for ev in p], accepted, refused
                ) from None
            if resp.status_code == 202:
                accepted += int(resp.json().get("accepted", len(part)))
                continue
            errors = _server_errors(resp)
            named = sorted(
                {
                    e["index"]
                    for e in errors
                    if isinstance(e.get("index"), int) and 0 <= e["index"] < len(part)
                }
            )
            if (
                resp.status_code == 413 and named
            ):  # events over the per-event limit: refuse them, post the rest
                refused.append(
                    FeedbackRejected(
                        413,
                        [_reindex(e, named) for e in errors if e.get("index") in named],
                        [part[i] for i in named],
                    )
                )
                rest = [ev for i, ev in enumerate(part) if i not in named]
                if rest:
                    todo.insert(0, rest)
            elif (
                resp.status_code == 413 and len(part) > 1
            ):  # too many bytes for one request: halve it
                half = len(part) // 2
                todo[:0] = [part[:half], part[half:]]
            else:
                refused.append(FeedbackRejected(resp.status_code, errors, part))
        return accepted, refused

    def _post_with_retries(self, batch: list[dict[str, Any]]) -> httpx.Response:
        """The server's answer to `batch` other than 429/5xx; FeedbackUnavailable after every retry."""
        body = json.dumps({"events": batch}, separators=(",", ":"), allow_nan=False).encode()
        retrying = Retrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=retry_if_exception_type(Retryable),
            reraise=True,
            before_sleep=self._log_retry,
        )
        try:
            for attempt in retrying:
                with attempt:
                    resp = self._post_once(body)
        except Retryable as exc:
            raise FeedbackUnavailable(
                f"{len(batch)} events not accepted after {self.max_retries} retries: {exc}"
            ) from exc
        return resp

    def _post_once(self, body: bytes) -> httpx.Response:
        try:
            resp = self._http.post("/v1/events", content=body)
        except httpx.TransportError as exc:
            raise Retryable(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code in RETRY_STATUSES:
            raise Retryable(f"HTTP {resp.status_code}: {resp.text[:300]}", retry_after(resp))
        return resp

    @staticmethod
    def _log_retry(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "feedback batch not accepted (%s); retry %d in %.2fs",
            exc,
            state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
        )

    def _flush_periodically(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.flush()
            except FeedbackError as exc:
                self._record(exc)

    def _record(self, exc: FeedbackError) -> None:
        log.error("flush failed: %s", exc)
        self.errors.append(exc)

    # --- lifecycle ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush what is pending and release the connection. Raises if the final flush fails,
        or the first background-flush error when a background flush dropped a rejected batch."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
        try:
            self.flush()
        finally:
            self._http.close()
        rejected = [e for e in self.errors if isinstance(e, FeedbackRejected)]
        if rejected:
            raise rejected[0]

    def __enter__(self) -> FeedbackClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _reindex(error: dict[str, Any], named: list[int]) -> dict[str, Any]:
    return {**error, "index": named.index(error["index"])}


def _merge(refused: list[FeedbackRejected], accepted: int) -> FeedbackRejected:
    """One FeedbackRejected for the refusals of one flush (indices shifted into the joined events)."""
    events: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for r in refused:
        errors.extend(
            {**e, "index": e["index"] + len(events)} if isinstance(e.get("index"), int) else e
            for e in r.errors
        )
        events.extend(r.events)
    return FeedbackRejected(refused[0].status_code, errors, events, accepted)


def retry_after(resp: httpx.Response) -> float | None:
    """A response's Retry-After in seconds (at most MAX_RETRY_AFTER_S); None when absent or a date."""
    value = resp.headers.get("retry-after")
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(value))) if value is not None else None
    except ValueError:  # an HTTP date: not sent by this server; fall back to the backoff
        return None


def _server_errors(resp: httpx.Response) -> list[dict[str, Any]]:
    try:
        body = resp.json()
    except ValueError:
        return [{"index": None, "field": "(response)", "message": resp.text[:500]}]
    if isinstance(body, dict) and isinstance(body.get("errors"), list):
        return body["errors"]
    detail = body.get("detail") if isinstance(body, dict) else body
    return [{"index": None, "field": "(request)", "message": str(detail)}]
