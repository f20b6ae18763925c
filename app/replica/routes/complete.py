"""POST /v1/complete: the replica's own completion API.

`POST /v1/complete` `{session_id, prompt, max_tokens, temperature, n}` picks the champion or the
candidate by a stable hash of `session_id` (app/replica/routing.py), samples `n` completions in
one batch on generation threads behind a bounded, cost-aware queue (app/replica/admission.py: the
event loop never blocks; one model call at a time with the built-in engine, several with vLLM; a
full queue answers 503 + Retry-After at once), writes one `generation` event per completion to
`<ns>.interactions` (prompt/completion tokens, behaviour log-probs, MoE routes, temperature,
group_id, latency, tokenizer, model_version, finish_reason, stream), and answers only after Kafka
acknowledged them all (503 + Retry-After otherwise):

    {"request_id": "...", "model_version": "3",
     "completions": [{"request_id": "...", "text": "...", "finish_reason": "stop"|"length", "tokens": 17}]}

For n == 1 the completion's request_id is the top-level one; for n > 1 each completion has its
own and their events share `group_id` = the top-level request_id. `tokens` is the number of
completion tokens. Prompts longer than the model's context keep their end (like an editor's
context window); the event records the tokens the model actually saw.

Input is validated before any model work and every refusal is a 422 naming the field: the body
is decoded with the standard JSON decoder (so NaN, Infinity, huge numbers and lone-surrogate
escapes reach the field validators), strings must be valid Unicode, `temperature` is 0 (greedy)
or at least `min_temperature`, and the prompt must encode with the served version's tokenizer
(app/replica/bodies.py). With `FLYWHEEL_REPLICA_API_KEY` set, the route checks
`Authorization: Bearer <key>` (constant time) before reading the body; health, readiness and
metrics stay open.

The request picks its `LoadedVersion` from one snapshot of the weight store and keeps it until
it has answered, so a sync that swaps versions meanwhile never affects it (app/replica/weights.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.replica import metrics as m
from app.replica.admission import ClientGone, QueueFull
from app.replica.bodies import (
    CompleteRequest,
    RequestInvalid,
    context_error,
    field_error,
    limit_error,
    parse_complete_request,
)
from app.replica.engines.base import EngineUnavailable
from app.replica.replica import Replica
from app.replica.routes.deps import ReplicaDep
from app.replica.routing import pick_slot
from app.replica.weights import Lease, LoadedVersion

log = logging.getLogger(__name__)
router = APIRouter()

_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": CompleteRequest.model_json_schema()}},
    }
}


@router.post("/v1/complete", openapi_extra=_BODY)
async def complete(request: Request, replica: ReplicaDep) -> Response:
    if not replica.authorized(request):  # before the body is read
        m.REQUESTS.labels(replica.id, "none", "unauthorized").inc()
        return JSONResponse(
            {"detail": "this replica needs a serving key: send Authorization: Bearer <key>"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    t_start = time.perf_counter()
    try:
        req = parse_complete_request(await request.body())
    except RequestInvalid as exc:
        m.REQUESTS.labels(replica.id, "none", "invalid").inc()
        return JSONResponse({"detail": exc.errors}, status_code=422)
    if (refused := _check_limits(replica, req)) is not None:
        return refused
    lease = None
    while lease is None:  # a swap between the snapshot and the lease: pick again
        serving = replica.store.snapshot()  # one consistent snapshot for the whole request
        if serving.champion is None:
            m.REQUESTS.labels(replica.id, "none", "not_ready").inc()
            return JSONResponse(
                {"detail": "no verified weights loaded yet; retry shortly"},
                status_code=503,
                headers={"Retry-After": "2"},
            )
        slot = pick_slot(req.session_id, serving.traffic_pct, serving.candidate is not None)
        lv = serving.candidate if slot == "candidate" else serving.champion
        assert lv is not None
        lease = replica.store.hold(lv)  # an in-place engine waits for it before replacing lv
    try:
        return await _answer(replica, req, slot, lv, lease, t_start, request)
    finally:
        lease.release()


def _invalid(replica: Replica, slot: str, field: str, msg: str) -> JSONResponse:
    m.REQUESTS.labels(replica.id, slot, "invalid").inc()
    return field_error(field, msg)


def _check_limits(replica: Replica, req: CompleteRequest) -> JSONResponse | None:
    """The replica's own bounds on an otherwise valid request (422 naming the field)."""
    refused = limit_error(
        replica.cfg,
        n=req.n,
        max_tokens=req.max_tokens,
        prompt_chars=len(req.prompt),
        temperature=req.temperature,
    )
    return None if refused is None else _invalid(replica, "none", *refused)


async def _answer(
    replica: Replica,
    req: CompleteRequest,
    slot: str,
    lv: LoadedVersion,
    lease: Lease,
    t_start: float,
    request: Request,
) -> Response:
    if (too_long := context_error(lv, req.max_tokens)) is not None:
        return _invalid(replica, slot, "max_tokens", too_long)
    try:
        prompt = replica.encode_prompt(lv, req.prompt, req.max_tokens)
    except ValueError as exc:
        return _invalid(replica, slot, "prompt", str(exc))
    generated = await _generate(replica, req, slot, lv, lease, prompt, request)
    if isinstance(generated, Response):
        return generated
    samples, gen_s = generated
    m.GENERATION_SECONDS.labels(replica.id).observe(gen_s)
    top_id = uuid.uuid4().hex
    ids = [top_id] if req.n == 1 else [uuid.uuid4().hex for _ in range(req.n)]
    group_id = None if req.n == 1 else top_id
    latency_ms = (time.perf_counter() - t_start) * 1000.0
    eos = lv.policy.tokenizer.eos_id
    reasons = ["stop" if s.tokens and s.tokens[-1] == eos else "length" for s in samples]
    events = [
        replica.generation_event(
            request_id=rid,
            session_id=req.session_id,
            temperature=req.temperature,
            lv=lv,
            prompt=prompt,
            sample=s,
            group_id=group_id,
            latency_ms=latency_ms,
            finish_reason=reason,
            stream=False,
        )
        for rid, s, reason in zip(ids, samples, reasons)
    ]
    if (refused := await _record(replica, slot, events)) is not None:
        return refused
    m.REQUESTS.labels(replica.id, slot, "ok").inc()
    m.REQUEST_SECONDS.labels(replica.id).observe(time.perf_counter() - t_start)
    m.TOKENS.labels(replica.id, lv.version, "prompt").inc(len(prompt) * req.n)
    m.TOKENS.labels(replica.id, lv.version, "completion").inc(sum(len(s.tokens) for s in samples))
    completions = [
        {"request_id": rid, "text": s.text, "tokens": len(s.tokens), "finish_reason": reason}
        for rid, s, reason in zip(ids, samples, reasons)
    ]
    return JSONResponse(
        {
            "request_id": top_id,
            "model_version": lv.version,
            "slot": slot,
            "completions": completions,
        }
    )


async def _generate(
    replica: Replica,
    req: CompleteRequest,
    slot: str,
    lv: LoadedVersion,
    lease: Lease,
    prompt: list[int],
    request: Request,
) -> tuple[list[Any], float] | Response:
    """(samples, model seconds) from the generation queue, or the answer when there are none."""
    from policy.base import SamplingError

    async def still_wanted() -> bool:
        return not await request.is_disconnected()

    assert replica.queue is not None, "the replica has not started"
    try:
        return await replica.queue.run(
            req.n * req.max_tokens,
            lease.run(replica._generate),  # holds lv until the generation returns
            lv,
            prompt,
            req.n,
            req.max_tokens,
            req.temperature,
            still_wanted=still_wanted,
        )
    except QueueFull as exc:
        m.REQUESTS.labels(replica.id, slot, "rejected").inc()
        return JSONResponse(
            {"detail": exc.detail},
            status_code=503,
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    except ClientGone:
        m.REQUESTS.labels(replica.id, slot, "disconnected").inc()
        return Response(status_code=499)  # nobody reads it; nothing was generated or logged
    except SamplingError as exc:
        return _invalid(replica, slot, "temperature", str(exc))
    except EngineUnavailable as exc:
        m.REQUESTS.labels(replica.id, slot, "unavailable").inc()
        log.warning("engine unavailable: %s", exc)
        return JSONResponse(
            {"detail": f"the engine cannot generate: {exc}"},
            status_code=503,
            headers={"Retry-After": "2"},
        )


async def _record(replica: Replica, slot: str, events: list[dict[str, Any]]) -> Response | None:
    """Send the events and wait for Kafka's ack; the answer when that failed (None: recorded)."""
    from app.infra.event_producer import KafkaUnavailable, RecordRejected

    try:
        await replica.record(events)
    except RecordRejected as exc:  # e.g. an event over the topic's record limit: nothing was sent
        m.REQUESTS.labels(replica.id, slot, "invalid").inc()
        log.warning("generation events refused before sending: %s", exc)
        return JSONResponse(
            {
                "detail": [
                    {
                        "loc": ["body", "max_tokens"],
                        "type": "value_error",
                        "msg": f"the generation could not be recorded ({exc}); ask for fewer "
                        "tokens or candidates, or send a shorter prompt",
                    }
                ]
            },
            status_code=413 if exc.too_large else 422,
        )
    except KafkaUnavailable as exc:
        m.REQUESTS.labels(replica.id, slot, "unavailable").inc()
        log.warning("generation events not acknowledged: %s", exc)
        return JSONResponse(
            {"detail": f"could not record the generation: {exc}"},
            status_code=503,
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    return None
