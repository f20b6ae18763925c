"""The replica's health and status routes, open without the serving key:

- `GET /healthz`: the process answers.
- `GET /readyz`: 200 once a verified champion is loaded, 503 before; the served versions, and
  `waiting_for` while the process waits for something (a broker, a champion in the log:
  app/infra/wait.py).
- `GET /metrics`: Prometheus metrics (app/replica/metrics.py).
- `GET /v1/status`: the served versions and traffic split, the sync agent's desired state and
  last result, and the engine's status.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.replica.routes.deps import ReplicaDep

router = APIRouter()


@router.get("/v1/status")
async def status(replica: ReplicaDep) -> dict[str, Any]:
    serving = replica.store.snapshot()
    agent = replica.agent
    return {
        "replica_id": replica.cfg.id,
        **serving.versions(),
        "traffic_pct": serving.traffic_pct,
        "desired": agent.desired() if agent else None,
        "last_sync": agent.last_result if agent else None,
        "syncing": agent.in_progress if agent else None,
        "engine": replica.engine.status(),
    }


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(replica: ReplicaDep) -> Response:
    from app.infra.wait import waiting

    serving = replica.store.snapshot()
    body = {"ready": serving.champion is not None, **serving.versions()}
    if pending := waiting():  # what it waits for (broker, a champion in the log), app/infra/wait.py
        body["waiting_for"] = pending
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
