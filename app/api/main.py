"""The Flywheel HTTP API: ingest, status, admin verbs, MLflow webhook receiver, health.

`create_app(settings)` builds the app; `flywheel api --host --port` serves it with uvicorn.
Routers live one per resource in `app/api/routes/`.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app.settings import Settings, get_settings


class KeyCache:
    """token -> ApiKey for a few seconds, so hot ingest paths skip a DB round trip per request."""

    def __init__(self, ttl_s: float = 10.0):
        self.ttl_s, self._d = ttl_s, {}

    def get(self, token: str) -> Any:
        hit = self._d.get(token)
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    def put(self, token: str, row: Any) -> None:
        if len(self._d) > 10_000:
            self._d.clear()
        self._d[token] = (row, time.monotonic() + self.ttl_s)


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

    app = FastAPI(title="Flywheel", version="0.1.0", lifespan=lifespan,
                  description="Ingest editor feedback, read deployment status, operate rollouts.")
    app.state.settings = settings
    app.state.key_cache = KeyCache()
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
    app.include_router(status_routes.router)  # GET /v1/deployments, /v1/deployments/history, /v1/models/{version}
    from app.api.routes import admin, hooks

    app.include_router(admin.router)  # POST /v1/deployments/{promote,abort,rollback,pause,resume}
    app.include_router(hooks.router)  # POST /v1/hooks/mlflow
    hooks.install(app)  # warm the receiver's MLflow client and deployment log at start-up
    # ------------------------------------------------------------------------------------------
    from app.httplimits import BodyLimitMiddleware, body_limits

    # added last = outermost: body limits and timeouts hold before any route (or auth) runs
    app.add_middleware(BodyLimitMiddleware, limits=body_limits(settings, {
        "/v1/events": settings.max_body_bytes, "/v1/deployments/": settings.admin_max_body_bytes,
        "/v1/hooks/mlflow": settings.webhook_max_body_bytes}))
    return app
