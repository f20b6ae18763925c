"""POST /v1/hooks/mlflow: the MLflow webhook receiver (HMAC, no API key).

Checked in this order, each before anything more is read or done:

1. the delivery headers (app/registry/webhooks.py `check_headers`): present, a sane delivery
   id, a finite unix-seconds timestamp inside the replay window -> 401 with the reason;
2. the size: `Content-Length` over `webhook_max_body_bytes` -> 413 before reading; a chunked or
   lying body is read with the same cap;
3. the signature over the raw body (FLYWHEEL_WEBHOOK_SECRET) -> 401;
4. the payload: strict JSON (no NaN/Infinity, no lone surrogates, at most 16 levels deep) of
   MLflow's shape `{entity, action, timestamp, data: {...}}` -> 422 naming the field;
5. the delivery id (`DeliveryDedupe`): a repeat of a delivery carried out answers 200
   `duplicate` and does nothing; one being carried out right now, or a full dedupe, answers 503
   with Retry-After (MLflow retries).

An alias event for our model then runs one alias reconciliation (app/registry/reconcile.py):
MLflow's current aliases are compared with Flywheel's acknowledged copy and each difference
becomes an `alias_changed` event (source `mlflow-ui`) on `flywheel.deployments`, which the
controller carries out. Using MLflow's current state rather than the payload makes out-of-order
or lost deliveries harmless. If MLflow or Kafka is unavailable the answer is 503, so MLflow
retries the same delivery. A delivery is remembered as delivered only once it was carried out:
every failure (4xx before the dedupe, an exception or a cancellation after it) leaves it unseen.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.api.deps import SettingsDep
from app.api.jsonbody import JsonBodyError, parse_json
from app.httplimits import read_capped
from app.registry.webhooks import (
    DeliveryDedupe,
    Seen,
    WebhookRejected,
    check_headers,
    check_signature,
)

log = logging.getLogger(__name__)
router = APIRouter(tags=["hooks"])
DELIVERIES = Counter(
    "flywheel_webhook_deliveries_total", "MLflow webhook deliveries by outcome", ["outcome"]
)
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

        from app.contracts.deployments import DeploymentLog
        from app.registry.operator import get_command_settings

        cs = get_command_settings()
        res = {
            "client": MlflowClient(
                tracking_uri=app.state.settings.mlflow_uri,
                registry_uri=app.state.settings.mlflow_uri,
            ),
            "log": DeploymentLog(app.state.settings),
            "dedupe": DeliveryDedupe(
                cs.webhook_window,
                skew_s=app.state.settings.webhook_clock_skew,
                max_ids=app.state.settings.webhook_dedupe_max_ids,
            ),
        }
        app.state.controller_hooks = res

        async def _close(app: FastAPI) -> None:
            res["log"].close()

        app.state.shutdown_hooks.append(_close)
    return res


def publish_dict(dlog, ev: dict[str, Any]) -> None:
    from app.contracts.deployments import DeploymentEvent

    dlog.publish(DeploymentEvent.model_validate(ev))


class WebhookPayload(BaseModel):
    """MLflow's delivery body (mlflow/webhooks/delivery.py); `data` is checked further per entity."""

    model_config = ConfigDict(extra="allow")

    entity: str = Field(max_length=128)
    action: str = Field(max_length=128)
    timestamp: str | None = Field(None, max_length=64)
    data: dict[str, Any] = Field(default_factory=dict)


class AliasData(BaseModel):
    """`data` of a model_version_alias event."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(max_length=512)
    alias: str | None = Field(None, max_length=256)


def _invalid(exc: ValidationError, prefix: tuple[str, ...] = ()) -> RequestValidationError:
    return RequestValidationError(
        [
            {"loc": ["body", *prefix, *e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False)
        ]
    )  # without the input: it may not encode


def _rejected(exc: WebhookRejected) -> HTTPException:
    DELIVERIES.labels("rejected").inc()
    log.warning("rejected MLflow webhook delivery: %s", exc)
    return HTTPException(exc.status, str(exc))


def _payload(body: bytes, model_name: str) -> tuple[WebhookPayload, AliasData | None]:
    """The validated payload, and its alias data when it is an alias event of `model_name`."""
    try:
        payload = WebhookPayload.model_validate(parse_json(body, max_depth=16))
    except JsonBodyError as exc:
        raise RequestValidationError(exc.detail()) from None
    except ValidationError as exc:
        raise _invalid(exc) from None
    if payload.entity != "model_version_alias":
        return payload, None
    try:
        data = AliasData.model_validate(payload.data)
    except ValidationError as exc:
        raise _invalid(exc, ("data",)) from None
    return payload, data if data.name == model_name else None


@router.post("/v1/hooks/mlflow", summary="MLflow webhook receiver (HMAC-signed)")
async def mlflow_hook(request: Request, settings: SettingsDep) -> dict[str, Any]:
    from app.registry.operator import get_command_settings

    window = get_command_settings().webhook_window
    try:
        delivery = check_headers(dict(request.headers), window)
    except WebhookRejected as exc:
        raise _rejected(exc) from None
    try:
        limit = settings.webhook_max_body_bytes
        body = await read_capped(
            request,
            limit,
            f"webhook body over {limit} bytes (MLflow's alias deliveries are a few hundred)",
        )
    except HTTPException:
        DELIVERIES.labels("too_large").inc()
        raise
    try:
        check_signature(settings.effective_webhook_secret, delivery, body)
    except WebhookRejected as exc:
        raise _rejected(exc) from None
    try:
        payload, alias = _payload(body, settings.model_name)
    except RequestValidationError:
        DELIVERIES.labels("invalid").inc()
        raise
    delivery_id = delivery.delivery_id
    try:
        res = await run_in_threadpool(_resources, request.app)
    except Exception as exc:  # MLflow client or deployment log not available yet: MLflow retries
        DELIVERIES.labels("error").inc()
        log.exception("webhook receiver could not start its MLflow client / deployment log")
        raise HTTPException(
            503,
            f"the receiver is not ready ({type(exc).__name__}); retry",
            headers={"Retry-After": "2"},
        ) from None
    dedupe: DeliveryDedupe = res["dedupe"]
    seen = dedupe.begin(delivery_id, delivery.ts)
    if seen is Seen.DUPLICATE:
        DELIVERIES.labels("duplicate").inc()
        return {"status": "duplicate", "delivery_id": delivery_id}
    if seen is not Seen.NEW:
        DELIVERIES.labels("busy").inc()
        retry = 2 if seen is Seen.IN_PROGRESS else int(dedupe.retry_after_s())
        why = (
            "this delivery is being carried out now"
            if seen is Seen.IN_PROGRESS
            else f"{len(dedupe)} recent deliveries are remembered, the limit; retry"
        )
        raise HTTPException(503, why, headers={"Retry-After": str(retry)})
    try:
        result = await _carry_out(res, settings, delivery_id, payload, alias)
    except BaseException:
        dedupe.forget(delivery_id)  # not delivered: MLflow retries with the same id
        raise
    dedupe.done(delivery_id)
    return result


async def _carry_out(
    res: dict[str, Any],
    settings,
    delivery_id: str,
    payload: WebhookPayload,
    alias: AliasData | None,
) -> dict[str, Any]:
    if alias is None:
        DELIVERIES.labels("ignored").inc()
        return {
            "status": "ignored",
            "delivery_id": delivery_id,
            "reason": f"not an alias event of {settings.model_name}",
        }
    from app.registry.reconcile import reconcile_once

    log.info(
        "webhook delivery %s: %s.%s %s", delivery_id, payload.entity, payload.action, payload.data
    )
    try:
        events = await run_in_threadpool(
            reconcile_once,
            res["client"],
            settings.model_name,
            lambda ev: publish_dict(res["log"], ev),
            "webhook",
            {"delivery_id": delivery_id},
        )
    except Exception as exc:
        DELIVERIES.labels("error").inc()
        log.exception("webhook delivery %s could not be carried out", delivery_id)
        raise HTTPException(
            503,
            f"could not reconcile aliases now ({type(exc).__name__}); retry",
            headers={"Retry-After": "2"},
        ) from None
    DELIVERIES.labels("applied" if events else "no_change").inc()
    return {"status": "ok", "delivery_id": delivery_id, "events": [e["event_id"] for e in events]}
