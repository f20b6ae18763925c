"""GET /healthz, /readyz and /metrics (no auth; DESIGN.md "HTTP API").

- `/healthz`: liveness. 200 while the process serves requests; checks nothing else.
- `/readyz`: readiness. 200 `{"ready": true, "checks": {...}}` when Kafka answers a metadata
  request and the app database answers `SELECT 1`, each within `READY_TIMEOUT_S`; otherwise
  503 with the failing check(s) named and their error. Checks run in threads with a bounded
  wait, and concurrent probes share one in-flight check, so a dead broker can neither hang
  the probe nor pile up threads. (The MLflow check joins when the registry role lands.)
- `/metrics`: Prometheus text format from the process-wide registry (app/api/metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])

READY_TIMEOUT_S = 2.0


def _check_kafka(settings: Settings, timeout_s: float) -> str:
    """One metadata round trip to the cluster on a fresh admin connection."""
    from kafka import KafkaAdminClient

    ms = max(100, int(timeout_s * 1000))
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap.split(","), request_timeout_ms=ms,
                             bootstrap_timeout_ms=ms, client_id="flywheel-readyz")
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
    except (asyncio.TimeoutError, TimeoutError):
        return False, f"no answer within {timeout_s:g}s"
    except Exception as exc:  # report any failure of the dependency, that is the probe's job
        return False, f"{type(exc).__name__}: {exc}"


async def _run_checks(settings: Settings) -> dict[str, dict]:
    start = time.perf_counter()
    (k_ok, k_msg), (d_ok, d_msg) = await asyncio.gather(
        _bounded(_check_kafka, settings, READY_TIMEOUT_S, timeout_s=READY_TIMEOUT_S),
        _bounded(_check_db, settings, timeout_s=READY_TIMEOUT_S),
    )
    log.debug("readiness checks took %.3fs", time.perf_counter() - start)
    return {"kafka": {"ok": k_ok, "detail": k_msg}, "database": {"ok": d_ok, "detail": d_msg}}


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: Kafka and the database reachable")
async def readyz(request: Request) -> JSONResponse:
    state = request.app.state
    task = getattr(state, "readyz_inflight", None)
    if task is None or task.done():  # share one in-flight check between concurrent probes
        task = state.readyz_inflight = asyncio.ensure_future(_run_checks(state.settings))
    checks = await asyncio.shield(task)
    failed = sorted(name for name, c in checks.items() if not c["ok"])
    body = {"ready": not failed, "checks": checks}
    if failed:
        body["failed"] = failed
    return JSONResponse(body, status_code=503 if failed else 200)


@router.get("/metrics", summary="Prometheus metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
