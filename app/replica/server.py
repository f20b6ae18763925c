"""The replica's HTTP app: `create_app` builds the `Replica` (app/replica/replica.py), its
lifespan, and includes the route modules of app/replica/routes/ (`POST /v1/complete`, the
OpenAI-compatible `/v1/completions`, `/v1/chat/completions`, `/v1/models`, and `/healthz`,
`/readyz`, `/metrics`, `/v1/status`); `serve` runs it with uvicorn.

    flywheel replica --host 0.0.0.0 --port 8100 --replica-id replica-1
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.httplimits import BodyLimitMiddleware, body_limits, uvicorn_config
from app.replica.config import ReplicaConfig
from app.replica.openai.stream import OpenStreams
from app.replica.replica import Replica
from app.replica.routes import chat, complete, completions, health, models
from app.settings import Settings


def create_app(settings: Settings, cfg: ReplicaConfig, start_sync: bool = True) -> FastAPI:
    replica = Replica(settings, cfg, start_sync=start_sync)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await replica.start()
        try:
            yield
        finally:
            await replica.stop()

    app = FastAPI(title=f"Flywheel replica {cfg.id}", version="0.1.0", lifespan=lifespan)
    app.state.replica = replica  # app/replica/routes/deps.py
    app.state.streams = OpenStreams(cfg.id, cfg.max_open_streams)
    app.add_middleware(
        BodyLimitMiddleware, limits=body_limits(settings)
    )  # app/httplimits.py: body size, timeouts
    for routes in (complete, completions, chat, models, health):
        app.include_router(routes.router)
    return app


def serve(settings: Settings, cfg: ReplicaConfig, log_level: str = "info") -> None:
    """Run one replica with uvicorn until interrupted."""
    import uvicorn

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    config = uvicorn_config(
        create_app(settings, cfg),
        settings,
        host=cfg.host,
        port=cfg.port,
        log_level=log_level,
        timeout_graceful_shutdown=10,
    )  # connection limits: app/httplimits.py
    uvicorn.Server(config).run()
