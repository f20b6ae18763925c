"""The Flywheel HTTP API: ingest, status, admin verbs, MLflow webhook receiver, health.

`create_app(settings)` builds the app; `flywheel api --host --port` serves it with uvicorn.
Routers live one per resource in `app/api/routes/`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app.api.ratelimit import TokenBucketLimiter
from app.settings import Settings, get_settings


class KeyCache:
    """Bearer token -> key row, so the hot ingest path skips a database round trip per request.

    Used from the event loop only (no locks). Three kinds of entry, each bounded:

    - valid keys: trusted for `ttl_s` counted from the *start* of the lookup that found them, so a
      key revoked at time t is refused by every request that reaches the check after t + ttl_s
      (a lookup that began before t cannot keep it alive longer). Past that the entry is stale:
      the next request looks the key up again, and the entry stays `known` for `known_s` (a
      throttled client address may still present a known key, see app/api/deps.py);
    - refused tokens (unknown or revoked): remembered for `negative_ttl_s` with their reason, so
      repeating one costs no lookup (revocation never reverts, and an unknown token is a guess);
    - lookups in flight: one per token; concurrent requests for the same token share it (joining
      only a lookup younger than `ttl_s`, which keeps the bound above).

    Each cache holds at most `max_entries`; the oldest entry is evicted first. Tokens are at most
    55 characters (app/db/keys.py KEY_PATTERN; the caller refuses any other shape first).
    """

    def __init__(
        self,
        ttl_s: float = 1.0,
        negative_ttl_s: float = 30.0,
        known_s: float = 600.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        assert ttl_s >= 0 and negative_ttl_s >= 0 and max_entries >= 1, (
            f"{ttl_s=} {negative_ttl_s=} {max_entries=}"
        )
        self.ttl_s, self.negative_ttl_s, self.known_s = ttl_s, negative_ttl_s, max(known_s, ttl_s)
        self.max_entries, self._clock = max_entries, clock
        self._valid: OrderedDict[str, tuple[Any, float, float]] = (
            OrderedDict()
        )  # token -> (row, fresh until, known until)
        self._refused: OrderedDict[str, tuple[str, float]] = (
            OrderedDict()
        )  # token -> (reason, until)
        self._inflight: dict[str, tuple[float, asyncio.Task]] = {}  # token -> (started, lookup)

    def get(self, token: str) -> Any:
        """The row of a valid key whose entry is fresh, else None (hot path: one dict lookup)."""
        hit = self._valid.get(token)
        if hit is None or hit[1] <= self._clock():
            return None
        return hit[0]

    def known(self, token: str) -> bool:
        """Whether `token` authenticated within the last `known_s` seconds (fresh or stale)."""
        hit = self._valid.get(token)
        return hit is not None and hit[2] > self._clock()

    def refusal(self, token: str) -> str | None:
        """The reason ("unknown" or "revoked") `token` was refused within `negative_ttl_s`, else None."""
        hit = self._refused.get(token)
        if hit is None or hit[1] <= self._clock():
            return None
        return hit[0]

    async def resolve(
        self, token: str, lookup: Callable[[str], Awaitable[Any]]
    ) -> tuple[Any, str | None]:
        """(row, None) for an active key, (None, "unknown" | "revoked") otherwise, caching the answer.

        `lookup(token)` returns the key's row (revoked or not) or None; it runs at most once per
        token at a time. Its exceptions (database down) reach every request that waits on it.
        """
        now = self._clock()
        flight = self._inflight.get(token)
        if flight is None or now - flight[0] >= self.ttl_s:
            task = asyncio.ensure_future(self._lookup(token, lookup, now))
            task.add_done_callback(
                lambda t: t.cancelled() or t.exception()
            )  # retrieved even if every waiter left
            flight = self._inflight[token] = (now, task)
        return await asyncio.shield(flight[1])

    async def _lookup(
        self, token: str, lookup: Callable[[str], Awaitable[Any]], started: float
    ) -> tuple[Any, str | None]:
        try:
            row = await lookup(token)
        finally:
            if self._inflight.get(token, (None,))[0] == started:
                del self._inflight[token]
        if row is None or row.revoked_at is not None:
            reason = "unknown" if row is None else "revoked"
            self._valid.pop(token, None)
            self._put(self._refused, token, (reason, self._clock() + self.negative_ttl_s))
            return None, reason
        self._put(self._valid, token, (row, started + self.ttl_s, started + self.known_s))
        return row, None

    def _put(self, cache: OrderedDict, token: str, value: tuple) -> None:
        cache.pop(token, None)
        cache[token] = value
        while len(cache) > self.max_entries:
            cache.popitem(last=False)

    def __len__(self) -> int:
        return len(self._valid) + len(self._refused)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    startup_hooks: list = []
    shutdown_hooks: list = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for hook in startup_hooks:
            await hook(app)
        try:
            yield
        finally:
            for hook in reversed(shutdown_hooks):
                await hook(app)

    app = FastAPI(
        title="Flywheel",
        version="0.1.0",
        lifespan=lifespan,
        description="Ingest editor feedback, read deployment status, operate rollouts.",
    )
    app.state.settings = settings
    app.state.key_cache = KeyCache(
        settings.key_cache_ttl,
        settings.key_negative_cache_ttl,
        settings.auth_known_key_window,
        settings.key_cache_max_entries,
    )
    app.state.auth_throttle = TokenBucketLimiter(
        settings.auth_failure_rate_per_s,
        settings.auth_failure_burst,
        max_keys=settings.auth_max_clients,
    )
    app.state.startup_hooks = startup_hooks
    app.state.shutdown_hooks = shutdown_hooks

    # --- routers (one per resource; each issue adds its own line) ---------------------------
    from app.api import metrics
    from app.api.routes import events, health

    metrics.install(app)  # HTTP request counters by route/status
    app.include_router(health.router)  # /healthz /readyz /metrics
    app.include_router(events.router)  # POST /v1/events
    events.install(app)  # shared Kafka producer (lifespan hooks) + per-key rate limiter
    from app.api.routes import status as status_routes

    app.include_router(
        status_routes.router
    )  # GET /v1/deployments, /v1/deployments/history, /v1/models/{version}
    from app.api.routes import sessions as session_routes

    app.include_router(session_routes.router)  # GET /v1/sessions/{session_id}
    from app.api.routes import admin, hooks

    app.include_router(admin.router)  # POST /v1/deployments/{promote,abort,rollback,pause,resume}
    app.include_router(hooks.router)  # POST /v1/hooks/mlflow
    hooks.install(app)  # warm the receiver's MLflow client and deployment log at start-up
    # ------------------------------------------------------------------------------------------
    from app.httplimits import BodyLimitMiddleware, body_limits

    # added last = outermost: body limits and timeouts hold before any route (or auth) runs
    app.add_middleware(
        BodyLimitMiddleware,
        limits=body_limits(
            settings,
            {
                "/v1/events": settings.max_body_bytes,
                "/v1/deployments/": settings.admin_max_body_bytes,
                "/v1/hooks/mlflow": settings.webhook_max_body_bytes,
            },
        ),
    )
    return app
