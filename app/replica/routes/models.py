"""GET /v1/models and GET /v1/models/{model}: the one model this replica serves
(`FLYWHEEL_MODEL_NAME`), as OpenAI's model list and model object. The serving key is checked
like on the completion routes (401 `invalid_api_key`); another model name is 404
`model_not_found`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.replica import metrics as m
from app.replica.openai.errors import OpenAIError
from app.replica.openai.plan import check_auth, check_model
from app.replica.replica import Replica
from app.replica.routes.deps import ReplicaDep

router = APIRouter()


def _model_card(replica: Replica) -> dict[str, Any]:
    return {
        "id": replica.settings.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "flywheel",
    }


@router.get("/v1/models")
async def models(request: Request, replica: ReplicaDep) -> Response:
    try:
        check_auth(request, replica)
    except OpenAIError as exc:
        m.count_openai(replica.id, "models", exc.outcome)
        return exc.response()
    m.count_openai(replica.id, "models", "ok")
    return JSONResponse({"object": "list", "data": [_model_card(replica)]})


@router.get("/v1/models/{model:path}")
async def model(request: Request, replica: ReplicaDep, model: str) -> Response:
    try:
        check_auth(request, replica)
        check_model(replica, model)
    except OpenAIError as exc:
        m.count_openai(replica.id, "models", exc.outcome)
        return exc.response()
    m.count_openai(replica.id, "models", "ok")
    return JSONResponse(_model_card(replica))
