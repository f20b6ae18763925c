"""Prometheus metrics of the HTTP API, and the ASGI middleware that counts HTTP requests.

Served at `GET /metrics` (app/api/routes/health.py) from the process-wide default registry,
so other roles running in the same process (`flywheel run`) appear on the same page.

| metric | labels | what |
|---|---|---|
| `flywheel_api_events_accepted_total` | — | events acknowledged by Kafka and answered 202 |
| `flywheel_api_events_rejected_total` | reason | events in batches answered 4xx/503 (where the count is known) |
| `flywheel_api_batches_total` | outcome | POST /v1/events outcomes: accepted, invalid_json, invalid_body, empty_batch, too_many_events, invalid_event, too_large (body), event_too_large, record_rejected, unsupported_encoding, unavailable |
| `flywheel_api_produce_seconds` | — | produce + acknowledgement time of one accepted batch |
| `flywheel_api_rate_limited_total` | — | requests answered 429 |
| `flywheel_api_auth_failures_total` | reason | failed authentications: missing, scheme, malformed, unknown, revoked |
| `flywheel_api_auth_throttled_total` | — | requests answered 429 because their client address is over its failed-authentication budget |
| `flywheel_api_key_lookups_total` | — | database lookups of API keys (key cache misses) |
| `flywheel_api_http_requests_total` | method, route, status | every HTTP request, by route template |
| `flywheel_api_http_request_seconds` | method, route | request duration |
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

EVENTS_ACCEPTED = Counter(
    "flywheel_api_events_accepted_total", "Events acknowledged by Kafka and answered 202."
)
EVENTS_REJECTED = Counter(
    "flywheel_api_events_rejected_total", "Events in rejected batches, by reason.", ["reason"]
)
BATCHES = Counter("flywheel_api_batches_total", "POST /v1/events batches by outcome.", ["outcome"])
PRODUCE_SECONDS = Histogram(
    "flywheel_api_produce_seconds",
    "Time from the first send to the last broker acknowledgement of a batch.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
RATE_LIMITED = Counter(
    "flywheel_api_rate_limited_total", "Requests answered 429 by the per-key rate limit."
)
AUTH_FAILURES = Counter(
    "flywheel_api_auth_failures_total", "Failed authentications by reason.", ["reason"]
)
AUTH_THROTTLED = Counter(
    "flywheel_api_auth_throttled_total",
    "Requests answered 429 because their client address is over its failed-authentication budget.",
)
KEY_LOOKUPS = Counter(
    "flywheel_api_key_lookups_total", "Database lookups of API keys (key cache misses)."
)
HTTP_REQUESTS = Counter(
    "flywheel_api_http_requests_total",
    "HTTP requests by route template and status.",
    ["method", "route", "status"],
)
HTTP_SECONDS = Histogram(
    "flywheel_api_http_request_seconds",
    "HTTP request duration by route template.",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


class HttpMetricsMiddleware:
    """Pure ASGI middleware (no BaseHTTPMiddleware overhead): count requests by route template.

    The route template comes from `scope["route"]`, which Starlette's router sets once it
    matched; unmatched paths are counted as `(unmatched)` so scanners cannot blow up label
    cardinality.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status_code = 500

        async def send_wrapper(message):
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", None) or "(unmatched)"
            method = scope.get("method", "")
            HTTP_REQUESTS.labels(method, route, str(status_code)).inc()
            HTTP_SECONDS.labels(method, route).observe(time.perf_counter() - start)


def install(app) -> None:
    """Add the HTTP request metrics middleware to `app` (call before the app starts)."""
    app.add_middleware(HttpMetricsMiddleware)
