"""POST /v1/deployments/{promote,abort,rollback,pause,resume}: the operator verbs (scope admin).

Each verb is checked against the current deployment state, folded from `flywheel.deployments`
(the source of truth, read to its end so there is no projection lag), and becomes one or
more deployment events with source `api`, the caller's key name (or key prefix) as actor and
the given reason (app/registry/operator.py `operator_command`, the canary settings
`FLYWHEEL_CONTROLLER_*`). The controller carries them out (MLflow aliases, traffic). Answers:
202 with the published events; 409 when the verb does not apply now (e.g. promote with no
canary running); 422 for a bad target (rollback to a version that is not one of the last N
known-good ones); 503 when Kafka is unavailable.

The key is checked before the body is read (401/403 never cost a body read), the body is
capped at `admin_max_body_bytes` (413, app/httplimits.py) and parsed here as strict JSON
(app/api/jsonbody.py): NaN/Infinity, out-of-range numbers, lone surrogates and deep nesting
are 422 naming the field, like any other invalid field. An empty body means all defaults.

    curl -X POST -H "Authorization: Bearer $ADMIN_KEY" -d '{"reason": "bad outputs", "version": "6"}' \
         http://127.0.0.1:8000/v1/deployments/rollback
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

from app.api.deps import SettingsDep, require_scope
from app.api.jsonbody import JsonBodyError, parse_json
from app.db.models import ApiKey

log = logging.getLogger(__name__)
router = APIRouter(tags=["admin"])
Verb = Literal["promote", "abort", "rollback", "pause", "resume"]


class VerbRequest(BaseModel):
    model_config = {"extra": "forbid"}

    reason: str = Field(
        "", max_length=4096, description="Why; recorded in the event and the history."
    )
    model: str | None = Field(
        None, max_length=128, description="Registered model (default: FLYWHEEL_MODEL_NAME)."
    )
    version: str | None = Field(
        None,
        max_length=32,
        description="rollback: the target version (default: the newest known-good).",
    )
    skip_remaining: bool = Field(
        False,
        description="promote: skip the remaining canary steps and make the candidate champion now.",
    )

    @field_validator("reason", "model", "version")
    @classmethod
    def _no_control_characters(cls, v: str | None, info: ValidationInfo) -> str | None:
        # these strings travel in deployment events to SQL projections (PostgreSQL refuses NUL)
        allowed = "\t\n\r" if info.field_name == "reason" else ""
        for i, ch in enumerate(v or ""):
            if (ch < " " and ch not in allowed) or ch == "\x7f":
                raise ValueError(
                    f"control character U+{ord(ch):04X} at position {i} is not allowed"
                )
        return v


def _carry_out(settings, verb: str, body: VerbRequest, actor: str) -> list[dict[str, Any]]:
    from app.contracts.deployment_state import replay
    from app.contracts.deployments import DeploymentEvent, DeploymentLog
    from app.registry.operator import get_command_settings, operator_command

    model = body.model or settings.model_name
    with DeploymentLog(settings) as dlog:
        state = replay(model, (le.event for le in dlog.read(stall_timeout_s=10)))
        decisions = operator_command(
            state,
            verb,
            get_command_settings().canary(),
            actor=actor,
            reason=body.reason,
            version=body.version,
            skip_remaining=body.skip_remaining,
        )
        events = [d.to_event(model) for d in decisions]
        for ev in events:
            dlog.publish(DeploymentEvent.model_validate(ev))
    log.info("operator %s by %s on %s: %s", verb, actor, model, [e["type"] for e in events])
    return events


async def read_verb_request(request: Request) -> VerbRequest:
    """The body as a VerbRequest (read after authentication); RequestValidationError (422) naming the field."""
    raw = await request.body()
    if not raw.strip():
        return VerbRequest()
    try:
        doc = parse_json(raw, max_depth=8)
    except JsonBodyError as exc:
        raise RequestValidationError(exc.detail()) from None
    try:
        return VerbRequest.model_validate(doc)
    except ValidationError as exc:  # without the offending input: it may not even be encodable
        raise RequestValidationError(
            [
                {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]}
                for e in exc.errors(include_url=False)
            ]
        ) from None


def _verb_route(verb: str):
    async def handler(
        request: Request,
        settings: SettingsDep,
        key: Annotated[ApiKey, Depends(require_scope("admin"))],
    ) -> dict[str, Any]:
        # no body parameter: FastAPI would read and validate a declared body before running the auth dependency
        from kafka.errors import KafkaError

        from app.registry.operator import CommandRejected

        body = await read_verb_request(request)
        actor = key.name or f"key:{key.prefix}"
        try:
            events = await run_in_threadpool(_carry_out, settings, verb, body, actor)
        except CommandRejected as exc:
            raise HTTPException(exc.status, str(exc)) from None
        except (KafkaError, TimeoutError) as exc:
            raise HTTPException(
                503,
                f"the deployment log is unavailable ({type(exc).__name__}); retry",
                headers={"Retry-After": "2"},
            ) from None
        return {"verb": verb, "actor": actor, "events": events}

    handler.__name__ = f"deployments_{verb}"
    return handler


for _verb in ("promote", "abort", "rollback", "pause", "resume"):
    router.add_api_route(
        f"/v1/deployments/{_verb}",
        _verb_route(_verb),
        methods=["POST"],
        status_code=202,
        summary=f"Operator verb: {_verb}",
        openapi_extra={
            "requestBody": {
                "required": False,
                "content": {"application/json": {"schema": VerbRequest.model_json_schema()}},
            }
        },
    )
