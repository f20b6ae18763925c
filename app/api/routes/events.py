"""POST /v1/events: the ingest endpoint editors call (docs/DESIGN.md §HTTP APIs).

A batch is all-or-nothing:

- a `Content-Encoding` other than identity -> 415 (bodies are plain JSON; nothing is
  decompressed);
- body over `max_body_bytes` (4 MiB) -> 413, checked on Content-Length up front and again
  on the bytes actually streamed (chunked or lying clients cannot get past it);
- not JSON (including NaN/Infinity, lone surrogates, invalid UTF-8, nesting deeper than
  orjson's 1024 levels), not `{"events": [...]}`, empty, or over `max_batch_events` (1000)
  -> 422 `{"errors": [{"index", "field", "message"}]}` (`index` is null for problems with
  the whole body);
- any event whose compact JSON (the Kafka record value) is over `max_event_bytes`
  (1,000,000) -> 413 `{"errors": [...]}` naming every such event by index and the limit;
- any event invalid, or an object with a duplicate key -> 422 listing every problem;
- otherwise each event's original JSON object (compact) goes to `<ns>.interactions` keyed
  by its `request_id`, and 202 `{"accepted": n}` comes back only after the broker
  acknowledged every record (acks=all, idempotent producer);
- Kafka refuses a record for what it is -> 413/422 naming it (never retryable);
  Kafka unreachable or slower than `kafka_produce_timeout` -> 503 with Retry-After.

Nothing of a refused batch is produced. The size limits form one chain (app/contracts/topics.py):
`max_event_bytes` + key and framing <= the producer's `max_request_size` = the topic's and
broker's record limit, and `max_body_bytes` holds at least one event of `max_event_bytes`.

The body is parsed once with orjson (which rejects NaN/Infinity like standard JSON), the
dicts are validated with the strict pydantic union of app/contracts/events.py (which rewrites `ts` to its
canonical form in place), and the producer gets `orjson.dumps(dict)`: no per-event pydantic
re-serialisation on the hot path.
orjson keeps the last of duplicate keys silently; a cheap count of `"key":` markers finds
bodies that may have any, and only those are parsed a second time to name them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, status
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter

from app.api.deps import require_scope
from app.api.metrics import BATCHES, EVENTS_ACCEPTED, EVENTS_REJECTED, PRODUCE_SECONDS
from app.api.ratelimit import TokenBucketLimiter
from app.contracts.events import Event, validate_batch
from app.db.models import ApiKey
from app.httplimits import read_capped
from app.infra.event_producer import EventProducer, KafkaUnavailable, RecordRejected

log = logging.getLogger(__name__)

router = APIRouter(tags=["ingest"])

_NON_STANDARD_CONSTANTS = ("NaN", "Infinity", "-Infinity")
_KEY_MARKER = re.compile(rb'"\s*:')  # every object key ends with one; so may a string value


def _reject(
    outcome: str, errors: list[dict[str, Any]], n_events: int = 0, code: int = 422
) -> JSONResponse:
    BATCHES.labels(outcome).inc()
    if n_events:
        EVENTS_REJECTED.labels(outcome).inc(n_events)
    return JSONResponse({"errors": errors}, status_code=code)


def _body_error(field: str, message: str) -> dict[str, Any]:
    return {"index": None, "field": field, "message": message}


def _json_error_message(body: bytes, exc: orjson.JSONDecodeError) -> str:
    pos = getattr(exc, "pos", None)
    if isinstance(pos, int):
        tail = body[pos : pos + 9].decode("utf-8", "replace")
        for const in _NON_STANDARD_CONSTANTS:
            if tail.startswith(const) or (const != "NaN" and tail.startswith(const.lstrip("-"))):
                return (
                    f"not valid JSON: {const.lstrip('-')} at char {pos} "
                    "(NaN and Infinity are not JSON; send finite numbers)"
                )
    return f"not valid JSON: {exc}"


def _oversized(records: list[tuple[str, bytes]], limit: int) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "field": "(event)",
            "message": f"event is {len(value)} bytes as compact JSON; the limit is {limit} bytes (max_event_bytes)",
        }
        for i, (_key, value) in enumerate(records)
        if len(value) > limit
    ]


def _duplicate_key_errors(
    body: bytes, doc: dict[str, Any], events: list[Any]
) -> list[dict[str, Any]]:
    """Objects of a valid batch that name a key twice (orjson kept the last value), by event index.

    Runs after validation, so the events are flat objects: a second parse is needed only when
    the body has more `"...":` markers than the parsed objects have keys (a duplicate, or a
    string value that contains `":`).
    """
    if len(_KEY_MARKER.findall(body)) == len(doc) + sum(len(e) for e in events):
        return []
    found: list[dict[str, Any]] = []
    objects = 0

    def hook(
        pairs: list[tuple[str, Any]],
    ) -> dict[str, Any]:  # called per event in order, then the body
        nonlocal objects
        keys = [k for k, _ in pairs]
        index = objects if objects < len(events) else None
        found.extend(
            {
                "index": index,
                "field": k,
                "message": "duplicate key: a JSON object may name each field once",
            }
            for k in sorted({k for k in keys if keys.count(k) > 1})
        )
        objects += 1
        return dict(pairs)

    json.loads(body, object_pairs_hook=hook)
    return found


@router.post(
    "/v1/events",
    status_code=status.HTTP_202_ACCEPTED,
    summary="Ingest a batch of interaction events (all-or-nothing)",
    responses={
        202: {
            "description": "every event acknowledged by Kafka",
            "content": {"application/json": {"example": {"accepted": 2}}},
        },
        413: {
            "description": "body over max_body_bytes, or events over max_event_bytes (`errors` names them)"
        },
        415: {"description": "a Content-Encoding other than identity (send plain JSON)"},
        422: {
            "description": "invalid body or events; nothing written",
            "content": {
                "application/json": {
                    "example": {
                        "errors": [
                            {
                                "index": 0,
                                "field": "logprobs.1",
                                "message": "Input should be less than or equal to 0",
                            }
                        ]
                    }
                }
            },
        },
        429: {"description": "per-key rate limit; see Retry-After"},
        503: {"description": "Kafka unavailable; retry after Retry-After with the same event_ids"},
    },
)
async def post_events(
    request: Request, _key: Annotated[ApiKey, Depends(require_scope("ingest"))]
) -> Response:
    settings = request.app.state.settings
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        BATCHES.labels("unsupported_encoding").inc()
        return JSONResponse(
            {
                "errors": [
                    _body_error(
                        "(Content-Encoding)",
                        f"Content-Encoding {encoding!r} is not supported; send the body as plain JSON",
                    )
                ]
            },
            status_code=415,
        )
    try:
        body = await read_capped(
            request,
            settings.max_body_bytes,
            f"request body exceeds {settings.max_body_bytes} bytes; "
            "split the events into smaller batches",
        )
    except HTTPException:
        BATCHES.labels("too_large").inc()
        raise

    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return _reject("invalid_json", [_body_error("(body)", _json_error_message(body, exc))])
    if not isinstance(doc, dict) or "events" not in doc:
        return _reject(
            "invalid_body",
            [_body_error("(body)", 'the body must be a JSON object {"events": [...]}')],
        )
    extra = sorted(set(doc) - {"events"})
    if extra:
        return _reject(
            "invalid_body",
            [_body_error(f, "unknown field (the body has only 'events')") for f in extra],
        )
    events = doc["events"]
    if not isinstance(events, list):
        return _reject(
            "invalid_body", [_body_error("events", "must be a JSON array of event objects")]
        )
    if not events:
        return _reject(
            "empty_batch", [_body_error("events", "empty batch; send at least one event")]
        )
    limit = settings.max_batch_events
    if len(events) > limit:
        return _reject(
            "too_many_events",
            [
                _body_error(
                    "events", f"{len(events)} events in one batch; the limit is {limit}, split it"
                )
            ],
            n_events=len(events),
        )

    records = [
        (ev.get("request_id") if isinstance(ev, dict) else None, orjson.dumps(ev)) for ev in events
    ]
    oversized = _oversized(records, settings.max_event_bytes)
    if oversized:
        return _reject("event_too_large", oversized, n_events=len(events), code=413)

    _parsed, errors = validate_batch(events)
    if errors:
        return _reject("invalid_event", [e.model_dump() for e in errors], n_events=len(events))
    duplicates = _duplicate_key_errors(body, doc, events)
    if duplicates:
        return _reject("invalid_event", duplicates, n_events=len(events))
    # validate_batch rewrote each `ts` to its canonical form: what goes to Kafka is the normalised event.
    # `max_event_bytes` applies to the event as sent; the canonical `ts` is at most 10 bytes longer,
    # well inside the 47 KB between the limit and the topic's record limit (docs/API.md, "Limits")
    records = [(ev["request_id"], orjson.dumps(ev)) for ev in events]

    producer: EventProducer = request.app.state.event_producer
    start = time.perf_counter()
    try:
        await producer.produce(settings.topic("interactions"), records)
    except RecordRejected as exc:
        log.warning("Kafka refused records of a batch of %d events: %s", len(events), exc)
        return _reject(
            "event_too_large" if exc.too_large else "record_rejected",
            [{"index": i, "field": "(event)", "message": m} for i, m in exc.errors],
            n_events=len(events),
            code=413 if exc.too_large else 422,
        )
    except KafkaUnavailable as exc:
        log.warning("503 for a batch of %d events: %s", len(events), exc)
        BATCHES.labels("unavailable").inc()
        EVENTS_REJECTED.labels("unavailable").inc(len(events))
        return JSONResponse(
            {"detail": f"{exc}; retry with the same event_ids"},
            status_code=503,
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    PRODUCE_SECONDS.observe(time.perf_counter() - start)
    BATCHES.labels("accepted").inc()
    EVENTS_ACCEPTED.inc(len(events))
    return Response(
        orjson.dumps({"accepted": len(events)}), status_code=202, media_type="application/json"
    )


def publish_event_schemas(app: FastAPI) -> None:
    """Put the event schemas into the app's OpenAPI document as the request body of POST /v1/events.

    The route reads its body by hand (size caps, orjson, `validate_batch`), so FastAPI cannot see
    it; the schema published here is the same pydantic union `validate_batch` applies, one
    component per event type (`Generation`, `Accept`, ...) under a discriminator on `type`.
    Clients check themselves against it (clients/typescript's schema test)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build()
        events = TypeAdapter(list[Event]).json_schema(ref_template="#/components/schemas/{model}")
        defs = events.pop("$defs")
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        clash = sorted(set(defs) & set(schemas))
        assert not clash, f"event schema names clash with other OpenAPI components: {clash}"
        schemas.update(defs)
        limit = app.state.settings.max_batch_events
        events.update(minItems=1, maxItems=limit)
        doc["paths"]["/v1/events"]["post"]["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "properties": {"events": events},
                        "required": ["events"],
                        "additionalProperties": False,
                    }
                }
            },
        }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def install(app: FastAPI) -> None:
    """Wire the ingest route's state: the shared producer (lifespan-managed) and the rate limiter,
    and publish the event schemas in the OpenAPI document."""
    settings = app.state.settings
    publish_event_schemas(app)
    app.state.rate_limiter = TokenBucketLimiter(
        settings.rate_limit_per_s, settings.rate_limit_burst
    )
    app.state.event_producer = EventProducer(settings)

    async def _start(app: FastAPI) -> None:
        if app.state.event_producer.closed:  # the app is being started again (tests)
            app.state.event_producer = EventProducer(app.state.settings)
        # connect in the background: start-up does not wait for Kafka, requests answer 503 until it is up
        app.state.event_producer_connect = asyncio.create_task(app.state.event_producer.connect())

    async def _stop(app: FastAPI) -> None:
        connecting = getattr(app.state, "event_producer_connect", None)
        if connecting is not None:
            connecting.cancel()
        await app.state.event_producer.aclose()

    app.state.startup_hooks.append(_start)
    app.state.shutdown_hooks.append(_stop)
