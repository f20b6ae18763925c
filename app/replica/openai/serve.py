"""The serving path POST /v1/completions and POST /v1/chat/completions share: plan the request
(plan.py), hold its version, then answer it as one JSON object (answer.py) or as a stream
(stream.py); any refusal on the way is OpenAI's error shape (errors.py), counted in
`flywheel_replica_openai_requests_total`.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from app.replica import metrics as m
from app.replica.openai.answer import answer
from app.replica.openai.errors import OpenAIError
from app.replica.openai.plan import plan
from app.replica.openai.stream import OpenStreams, stream
from app.replica.replica import Replica


async def serve(
    request: Request, replica: Replica, streams: OpenStreams, endpoint: str
) -> Response:
    """Answer one request to `endpoint` ("completions" | "chat")."""
    try:
        while True:
            p = await plan(request, replica, endpoint)
            # an in-place engine waits for the lease before replacing p.lv; None: a swap
            # took p.lv out after the plan's snapshot, so plan again on the new one
            if (lease := replica.store.hold(p.lv)) is not None:
                p.lease = lease
                break
    except OpenAIError as exc:
        m.count_openai(replica.id, endpoint, exc.outcome)
        return exc.response()
    try:
        if p.stream:
            return stream(replica, streams, p)  # its job releases the plan when it is over
        return await answer(request, replica, p)
    except OpenAIError as exc:
        p.release()
        m.count_openai(replica.id, endpoint, exc.outcome)
        return exc.response()
    except BaseException:
        p.release()
        raise
    finally:
        if not p.stream:
            p.release()
