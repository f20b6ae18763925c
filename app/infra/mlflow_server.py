"""The embedded MLflow tracking + registry server used by `flywheel run` (and the tests).

SQLite backend store and a local artifact root in `<data_dir>/mlflow/`, UI on the port of
FLYWHEEL_MLFLOW_URI (default 5000). Webhooks are allowed over plain http to private IPs
(the controller listens on loopback), which MLflow refuses by default. MLflow's job runner is
off (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`): Flywheel runs no MLflow jobs, and the runner is
seven more Python processes (~250 MB each) that open the same SQLite store as the server.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

# MLflow caches its webhook list for 60 s by default: a webhook the controller registers after the
# first alias event would go unheard for a minute (the poller still catches it). Its delivery pool
# (10 threads, 30 s timeout, 3 retries) lets a few hung receivers delay every other delivery by
# minutes; Flywheel's receiver answers in milliseconds, so a short timeout and a wider pool keep one
# dead endpoint from starving the live ones (the poller still covers whatever is lost).
SERVER_ENV = {
    "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
    "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
    "MLFLOW_WEBHOOK_CACHE_TTL": "2",
    "MLFLOW_WEBHOOK_REQUEST_TIMEOUT": "10",
    "MLFLOW_WEBHOOK_DELIVERY_MAX_WORKERS": "32",
    # MLflow >= 3.5 starts a job runner (a huey consumer per job kind, 7 processes) beside every
    # server unless told not to; Flywheel uses none of its jobs (GenAI judges, trace rollups)
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}


def mlflow_server_argv(root: Path, host: str, port: int, workers: int = 1) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{(root / 'mlflow.db').resolve()}",
        "--artifacts-destination",
        str((root / "artifacts").resolve()),
        "--workers",
        str(workers),
    ]


def host_port(uri: str) -> tuple[str, int]:
    u = urlparse(uri)
    return u.hostname or "127.0.0.1", u.port or 5000


def mlflow_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **SERVER_ENV, **(extra or {})}


def start_server(
    root: Path, host: str, port: int, extra_env: dict[str, str] | None = None, log: Any = None
) -> subprocess.Popen:
    """`mlflow server` as a child in its own session (tests, benchmarks; `flywheel run` supervises its
    own); output to `log` (a binary file) or discarded. Pair with `wait_healthy` and `stop_server`."""
    out = log if log is not None else subprocess.DEVNULL
    return subprocess.Popen(
        mlflow_server_argv(root, host, port),
        env=mlflow_env(extra_env),
        stdout=out,
        stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server's process group (its uvicorn workers too), SIGKILL what is left after
    `timeout` (app/infra/procs.py)."""
    from app.infra.procs import stop_groups

    stop_groups([proc], timeout)


def wait_healthy(uri: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}")
        try:
            if httpx.get(f"{uri.rstrip('/')}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {uri} not healthy after {timeout:.0f}s")
