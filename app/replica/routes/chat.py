"""POST /v1/chat/completions: OpenAI's chat completions API (`messages` through the served
version's chat template to a `chat.completion`; `logprobs: true` for the sampled tokens'
log-probs; `stream: true` for `chat.completion.chunk` server-sent events). A model without a chat
template answers 400 naming `messages`: it serves POST /v1/completions only.

The serving path and its rules: app/replica/openai/ (serve.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.replica.openai.serve import serve
from app.replica.routes.deps import OpenStreamsDep, ReplicaDep

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(
    request: Request, replica: ReplicaDep, streams: OpenStreamsDep
) -> Response:
    return await serve(request, replica, streams, "chat")
