"""POST /v1/hooks/mlflow: the MLflow webhook receiver (HMAC, no API key).

A delivery is accepted when its signature matches FLYWHEEL_WEBHOOK_SECRET (401 otherwise),
its timestamp is inside the replay window (401) and its delivery id is new (a repeat answers
200 `duplicate` and does nothing). An alias event for our model then runs one alias
reconciliation (app/controller/reconciler.py): MLflow's current aliases are compared with
Flywheel's acknowledged copy and each difference becomes an `alias_changed` event (source
`mlflow-ui`) on `flywheel.deployments`, which the controller carries out. Using MLflow's
current state rather than the payload makes out-of-order or lost deliveries harmless.
If MLflow or Kafka is unavailable the answer is 503, so MLflow retries the same delivery.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from prometheus_client import Counter

from app.api.deps import SettingsDep
from app.controller.webhooks import DeliveryDedupe, WebhookRejected, verify

log = logging.getLogger(__name__)
router = APIRouter(tags=["hooks"])
DELIVERIES = Counter("flywheel_webhook_deliveries_total", "MLflow webhook deliveries by outcome", ["outcome"])
_init_lock = threading.Lock()


def install(app: FastAPI) -> None:
    """Warm the receiver up in the background at start-up (importing mlflow takes seconds)."""

    async def _warm(app: FastAPI) -> None:
        app.state.controller_hooks_warmup = asyncio.create_task(asyncio.to_thread(_resources, app))

    app.state.startup_hooks.append(_warm)


def _resources(app: FastAPI) -> dict[str, Any]:
    with _init_lock:
        return _resources_locked(app)


def _resources_locked(app: FastAPI) -> dict[str, Any]:
    res = getattr(app.state, "controller_hooks", None)
    if res is None:
        from mlflow import MlflowClient

        from app.controller.config import get_controller_settings
        from app.deployments.events import DeploymentLog

        cs = get_controller_settings()
        res = {"client": MlflowClient(tracking_uri=app.state.settings.mlflow_uri, registry_uri=app.state.settings.mlflow_uri),
               "log": DeploymentLog(app.state.settings), "dedupe": DeliveryDedupe(cs.webhook_window),
               "window": cs.webhook_window}
        app.state.controller_hooks = res

        async def _close(app: FastAPI) -> None:
            res["log"].close()

        app.state.shutdown_hooks.append(_close)
    return res


def publish_dict(dlog, ev: dict[str, Any]) -> None:  # noqa: ANN001 (DeploymentLog)
    from app.deployments.events import DeploymentEvent

    dlog.publish(DeploymentEvent.model_validate(ev))


@router.post("/v1/hooks/mlflow", summary="MLflow webhook receiver (HMAC-signed)")
async def mlflow_hook(request: Request, settings: SettingsDep) -> dict[str, Any]:
    body = await request.body()
    res = await run_in_threadpool(_resources, request.app)
    try:
        delivery_id = verify(settings.effective_webhook_secret, dict(request.headers), body, res["window"])
    except WebhookRejected as exc:
        DELIVERIES.labels("rejected").inc()
        log.warning("rejected MLflow webhook delivery: %s", exc)
        raise HTTPException(exc.status, str(exc)) from None
    if not res["dedupe"].first_time(delivery_id):
        DELIVERIES.labels("duplicate").inc()
        return {"status": "duplicate", "delivery_id": delivery_id}
    try:
        payload = json.loads(body)
        entity, data = payload.get("entity"), payload.get("data") or {}
    except (ValueError, AttributeError):
        res["dedupe"].forget(delivery_id)
        raise HTTPException(422, "body is not an MLflow webhook payload ({entity, action, timestamp, data})") from None
    if entity != "model_version_alias" or data.get("name") != settings.model_name:
        DELIVERIES.labels("ignored").inc()
        return {"status": "ignored", "delivery_id": delivery_id, "reason": f"not an alias event of {settings.model_name}"}
    from app.controller.reconciler import reconcile_once

    log.info("webhook delivery %s: %s.%s %s", delivery_id, entity, payload.get("action"), data)
    try:
        events = await run_in_threadpool(reconcile_once, res["client"], settings.model_name,
                                         lambda ev: publish_dict(res["log"], ev), "webhook", {"delivery_id": delivery_id})
    except Exception as exc:
        res["dedupe"].forget(delivery_id)  # MLflow retries with the same id
        DELIVERIES.labels("error").inc()
        log.exception("webhook delivery %s could not be carried out", delivery_id)
        raise HTTPException(503, f"could not reconcile aliases now ({type(exc).__name__}); retry",
                            headers={"Retry-After": "2"}) from None
    DELIVERIES.labels("applied" if events else "no_change").inc()
    return {"status": "ok", "delivery_id": delivery_id, "events": [e["event_id"] for e in events]}
