"""The real API (create_app) on real uvicorn on loopback, for the hostile-input tests, and raw-socket helpers.

api = start_api(make_settings, http_head_timeout=1.0)   # keys created, server started
...
api.server.stop()
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from app.settings import Settings


@dataclass
class RunningApi:
    url: str
    host: str
    port: int
    settings: Settings
    keys: dict[str, str]  # scope -> token (ingest, read, admin)
    server: Any  # app.api.server.ServerThread

    def auth(self, scope: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[scope]}"}


def start_api(make_settings, **overrides: Any) -> RunningApi:
    from app.api.main import create_app
    from app.api.server import ServerThread
    from app.db.keys import create_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    settings = make_settings(**overrides)
    upgrade(settings.db_url)
    with session_scope(settings.db_url) as session:
        keys = {
            scope: create_key(session, [scope], name=f"hostile-{scope}")[0]
            for scope in ("ingest", "read", "admin")
        }
    server = ServerThread(create_app(settings)).start()
    return RunningApi(server.url, server.host, server.port, settings, keys, server)


def connect(api: RunningApi, timeout_s: float = 30.0) -> socket.socket:
    s = socket.create_connection((api.host, api.port), timeout=timeout_s)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_until_closed(s: socket.socket, timeout_s: float = 30.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    t0 = time.monotonic()
    s.settimeout(timeout_s)
    chunks = []
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks), time.monotonic() - t0


def status_of(raw: bytes) -> int | None:
    if not raw.startswith(b"HTTP/1.1 "):
        return None
    return int(raw[9:12])


def head(method: str, path: str, headers: dict[str, str] | None = None) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
