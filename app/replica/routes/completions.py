"""POST /v1/completions: OpenAI's completions API (`prompt`, one string, to a `text_completion`;
`logprobs: 0` for the sampled tokens' log-probs; `stream: true` for server-sent events).

    client = openai.OpenAI(base_url="http://replica:8100/v1", api_key="<FLYWHEEL_REPLICA_API_KEY or any>")
    client.completions.create(model="flywheel-policy", prompt="def f(", max_tokens=32, user="session-1")

The serving path and its rules: app/replica/openai/ (serve.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.replica.openai.serve import serve
from app.replica.routes.deps import OpenStreamsDep, ReplicaDep

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, replica: ReplicaDep, streams: OpenStreamsDep) -> Response:
    return await serve(request, replica, streams, "completions")
