"""Serve the API with uvicorn: `flywheel api --host --port`, and a thread-hosted server for tests.

`serve(settings)` is the production path: uvicorn on one event loop with uvloop/httptools, under
the connection limits of app/httplimits.py (head/body/keep-alive timeouts, head size, connection
cap), serving at once; the database migrations (`alembic upgrade head`, the pre-start step) are
applied in the background as soon as the database answers, and /readyz says 503 until then.
Scale out with more processes behind a load balancer.

`ServerThread` runs the same app, under the same limits, on a free port inside the current
process (integration tests); it does NOT migrate — tests create their DB with `upgrade(url)`.

    with ServerThread(create_app(settings)) as srv:
        httpx.post(f"{srv.url}/v1/events", ...)
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from app.httplimits import uvicorn_config
from app.settings import Settings

log = logging.getLogger(__name__)


def serve(
    settings: Settings, host: str | None = None, port: int | None = None, log_level: str = "info"
) -> None:
    """Serve the API until interrupted; the migrations are applied once the database answers
    (in the background: /readyz says what is missing meanwhile, app/api/routes/health.py)."""
    from app.api.main import create_app
    from app.api.routes.health import migrate_in_background

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(settings)
    migrate_in_background(app)
    uvicorn.Server(
        uvicorn_config(
            app,
            settings,
            host=host or settings.api_host,
            port=port or settings.api_port,
            log_level=log_level,
            timeout_graceful_shutdown=10,
        )
    ).run()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A uvicorn server in a daemon thread, started and stopped as a context manager.

    Its limits come from `settings`, else from the app's own (`app.state.settings`), else the defaults.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_level: str = "warning",
        settings: Settings | None = None,
    ):
        self.host, self.port = host, port or _free_port()
        settings = settings or getattr(app.state, "settings", None) or Settings()
        config = uvicorn_config(
            app,
            settings,
            host=self.host,
            port=self.port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, name=f"uvicorn-{self.port}", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(
                    f"uvicorn on {self.url} exited during start-up; see the log above"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn on {self.url} did not start within {timeout_s}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"uvicorn on {self.url} did not stop within {timeout_s}s"

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
