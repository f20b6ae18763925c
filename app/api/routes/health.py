"""GET /healthz, /readyz and /metrics (no auth; docs/DESIGN.md §HTTP APIs).

- `/healthz`: liveness. 200 while the process serves requests; checks nothing else.
- `/readyz`: readiness. 200 `{"ready": true, "checks": {...}}` when Kafka answers a metadata
  request and the app database answers `SELECT 1`, each within `READY_TIMEOUT_S`; otherwise
  503 with the failing check(s) named and their error. Checks run in threads with a bounded
  wait, and concurrent probes share one in-flight check, so a dead broker can neither hang
  the probe nor pile up threads. (The MLflow check joins when the registry role lands.)
  While `flywheel api` still waits to apply the migrations (`migrate_in_background`), the
  database check fails with what it waits for, and `waiting_for` lists every dependency this
  process waits for with the last reason (app/infra/wait.py).
- `/metrics`: Prometheus text format from the process-wide registry (app/api/metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])

READY_TIMEOUT_S = 2.0


def _check_kafka(settings: Settings, timeout_s: float) -> str:
    """One metadata round trip to the cluster on a fresh admin connection."""
    from kafka import KafkaAdminClient

    from app.infra import kafka_net

    kafka_net.install()

    ms = max(100, int(timeout_s * 1000))
    admin = KafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap.split(","),
        request_timeout_ms=ms,
        bootstrap_timeout_ms=ms,
        client_id="flywheel-readyz",
    )
    try:
        cluster = admin.describe_cluster()
        return f"{len(cluster.get('brokers', []))} broker(s)"
    finally:
        admin.close()


def _check_db(settings: Settings) -> str:
    import sqlalchemy as sa

    from app.db.session import get_engine

    with get_engine(settings.db_url).connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    return "ok"


async def _bounded(fn, *args, timeout_s: float) -> tuple[bool, str]:
    try:
        return True, await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout_s)
    except TimeoutError:
        return False, f"no answer within {timeout_s:g}s"
    except Exception as exc:  # report any failure of the dependency, that is the probe's job
        return False, f"{type(exc).__name__}: {exc}"


async def _migrations_pending() -> tuple[bool, str]:
    from app.infra.wait import waiting

    why = "; ".join(f"{what}: {reason}" for what, reason in waiting().items() if "database" in what)
    return False, f"migrations not applied yet (waiting for {why or 'the database'})"


async def _run_checks(
    settings: Settings, migrated: threading.Event | None = None
) -> dict[str, dict]:
    start = time.perf_counter()
    db_check = (
        _migrations_pending()
        if migrated is not None and not migrated.is_set()
        else _bounded(_check_db, settings, timeout_s=READY_TIMEOUT_S)
    )
    (k_ok, k_msg), (d_ok, d_msg) = await asyncio.gather(
        _bounded(_check_kafka, settings, READY_TIMEOUT_S, timeout_s=READY_TIMEOUT_S), db_check
    )
    log.debug("readiness checks took %.3fs", time.perf_counter() - start)
    return {"kafka": {"ok": k_ok, "detail": k_msg}, "database": {"ok": d_ok, "detail": d_msg}}


def migrate_in_background(app: FastAPI) -> None:
    """`flywheel api`'s pre-start step (`alembic upgrade head`) without holding the server back:
    at start-up a thread waits for the database (app/infra/wait.py: backoff, one log line),
    applies the migrations and sets `app.state.migrated`; until then /readyz answers 503 with
    the database check saying what it waits for. Shutdown ends the wait."""
    from app.db.migrate import upgrade
    from app.infra.wait import Stopped, database_ready, wait_for

    url = app.state.settings.db_url
    stop, migrated = threading.Event(), threading.Event()
    app.state.migrated = migrated

    def run() -> None:
        try:
            database_ready(url, stop)
            wait_for(
                "the database migrations (alembic upgrade head)", lambda: upgrade(url), stop=stop
            )
        except Stopped:
            return
        migrated.set()
        log.info("database migrations applied; the API is ready once Kafka answers too")

    async def _start(app: FastAPI) -> None:
        threading.Thread(target=run, name="api-migrate", daemon=True).start()

    async def _stop(app: FastAPI) -> None:
        stop.set()

    app.state.startup_hooks.append(_start)
    app.state.shutdown_hooks.append(_stop)


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: Kafka and the database reachable")
async def readyz(request: Request) -> JSONResponse:
    state = request.app.state
    task = getattr(state, "readyz_inflight", None)
    if task is None or task.done():  # share one in-flight check between concurrent probes
        task = state.readyz_inflight = asyncio.ensure_future(
            _run_checks(state.settings, getattr(state, "migrated", None))
        )
    checks = await asyncio.shield(task)
    failed = sorted(name for name, c in checks.items() if not c["ok"])
    body = {"ready": not failed, "checks": checks}
    if failed:
        body["failed"] = failed
    from app.infra.wait import waiting

    if pending := waiting():
        body["waiting_for"] = pending
    return JSONResponse(body, status_code=503 if failed else 200)


@router.get("/metrics", summary="Prometheus metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
