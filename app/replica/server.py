"""The replica's HTTP app: `POST /v1/complete`, `/v1/status`, `/healthz`, `/readyz`, `/metrics`,
and the OpenAI-compatible `/v1/completions`, `/v1/chat/completions`, `/v1/models` (openai_api.py,
which shares this module's body parsing, limits, prompt encoding and generation events).

    flywheel replica --host 0.0.0.0 --port 8100 --replica-id replica-1

`POST /v1/complete` `{session_id, prompt, max_tokens, temperature, n}` picks the champion or the
candidate by a stable hash of `session_id` (routing.py), samples `n` completions in one batch on
generation threads behind a bounded, cost-aware queue (admission.py: the event loop never
blocks; one model call at a time with the built-in engine, several with vLLM; a full queue
answers 503 + Retry-After at once),
writes one `generation` event per completion to `<ns>.interactions` (prompt/completion tokens,
behaviour log-probs, MoE routes, temperature, group_id, latency, tokenizer, model_version,
finish_reason, stream), and
answers only after Kafka acknowledged them all (503 + Retry-After otherwise):

    {"request_id": "...", "model_version": "3",
     "completions": [{"request_id": "...", "text": "...", "finish_reason": "stop"|"length", "tokens": 17}]}

For n == 1 the completion's request_id is the top-level one; for n > 1 each completion has its
own and their events share `group_id` = the top-level request_id. `tokens` is the number of
completion tokens. Prompts longer than the model's context keep their end (like an editor's
context window); the event records the tokens the model actually saw.

Input is validated before any model work and every refusal is a 422 naming the field: the body
is decoded with the standard JSON decoder (so NaN, Infinity, huge numbers and lone-surrogate
escapes reach the field validators), strings must be valid Unicode, `temperature` is 0 (greedy)
or at least `min_temperature`, and the prompt must encode with the served version's tokenizer.
With `FLYWHEEL_REPLICA_API_KEY` set, the route checks `Authorization: Bearer <key>` (constant
time) before reading the body; health, readiness and metrics stay open.

The request picks its `LoadedVersion` from one snapshot of the weight store and keeps it until
it has answered, so a sync that swaps versions meanwhile never affects it (weights.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from app.contracts.events import Id
from app.httplimits import BodyLimitMiddleware, body_limits, uvicorn_config
from app.replica import metrics as m
from app.replica.admission import ClientGone, GenerationQueue, QueueFull
from app.replica.config import ReplicaConfig
from app.replica.routing import pick_slot
from app.replica.weights import Lease, LoadedVersion, WeightCache, WeightStore
from app.settings import Settings

log = logging.getLogger(__name__)
B = TypeVar("B", bound=BaseModel)


def _valid_unicode(v: str) -> str:
    """Refuse lone surrogates (JSON's `"\\ud800"` decodes to one): they cannot be encoded, tokenized or logged."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone surrogate (U+{ord(v[exc.start]):04X} at index {exc.start}), which is "
            f"not valid Unicode; send UTF-8 text"
        ) from None
    return v


Text = Annotated[str, Field(strict=True), AfterValidator(_valid_unicode)]


class CompleteRequest(BaseModel):
    """Body of POST /v1/complete (limits beyond these come from ReplicaConfig, checked in the route)."""

    model_config = ConfigDict(extra="forbid")

    session_id: Annotated[Id, Field(strict=True), AfterValidator(_valid_unicode)] = Field(
        description="Editor session; picks champion vs candidate."
    )
    prompt: Text = Field(description="Text to complete (may be empty).")
    max_tokens: int = Field(
        64, ge=1, strict=True, description="Most completion tokens per candidate."
    )
    temperature: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        allow_inf_nan=False,
        strict=True,
        description="0 = greedy; otherwise at least the replica's `min_temperature`.",
    )
    n: int = Field(
        1, ge=1, strict=True, description="Candidates for this context (n > 1 share a group_id)."
    )


class RequestInvalid(Exception):
    """A 422: `errors` in FastAPI's shape, `[{loc: ["body", field...], msg, type}]`."""

    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(errors)
        self.errors = errors


def _printable(v: Any, limit: int = 200) -> Any:
    """A loc item or message that is safe to send back (no lone surrogates, bounded length)."""
    if not isinstance(v, str):
        return v
    v = v.encode("utf-8", "backslashreplace").decode("utf-8")
    return v if len(v) <= limit else v[:limit] + "…"


def parse_complete_request(raw: bytes) -> CompleteRequest:
    """Decode and validate a /v1/complete body; RequestInvalid names the field (or `body`)."""
    return parse_body(raw, CompleteRequest)


def parse_body(raw: bytes, model: type[B]) -> B:
    """Decode and validate a JSON body into `model`; RequestInvalid names the field (or `body`).

    The standard JSON decoder reads the body first so that NaN, Infinity, huge numbers and
    lone-surrogate escapes reach the model's validators, which name the field they are in."""

    def body_error(msg: str, type_: str = "json_invalid") -> RequestInvalid:
        return RequestInvalid([{"loc": ["body"], "msg": msg, "type": type_}])

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise body_error(
            f"the body is not valid UTF-8 (byte {exc.start}: {exc.reason})", "utf8_invalid"
        ) from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise body_error("the body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers longer than Python's 4300-digit limit
        raise body_error(f"the body is not valid JSON: {_printable(str(exc))}") from None
    if isinstance(obj, dict):  # pydantic cannot name a key that is not valid Unicode: name it here
        for key in obj:
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestInvalid(
                    [
                        {
                            "loc": ["body", _printable(key)],
                            "msg": "field name contains a lone "
                            "surrogate, which is not valid Unicode",
                            "type": "string_unicode",
                        }
                    ]
                ) from None
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise RequestInvalid(
            [
                {
                    "loc": ["body", *map(_printable, e["loc"])],
                    "msg": _printable(e["msg"], 500),
                    "type": e["type"],
                }
                for e in exc.errors(include_url=False, include_context=False, include_input=False)
            ]
        ) from None


def _error(field: str, msg: str, status: int = 422) -> JSONResponse:
    return JSONResponse(
        {"detail": [{"loc": ["body", field], "msg": msg, "type": "value_error"}]},
        status_code=status,
    )


def limit_error(
    cfg: ReplicaConfig, *, n: int, max_tokens: int, prompt_chars: int, temperature: float
) -> tuple[str, str] | None:
    """The replica's own bounds on an otherwise valid request: (field, message) or None."""
    if n > cfg.max_n:
        return "n", f"n is {n}; this replica serves at most {cfg.max_n} candidates per request"
    if max_tokens > cfg.max_tokens:
        return (
            "max_tokens",
            f"max_tokens is {max_tokens}; this replica allows at most {cfg.max_tokens}",
        )
    if prompt_chars > cfg.max_prompt_chars:
        return (
            "prompt",
            f"prompt has {prompt_chars} characters; at most {cfg.max_prompt_chars} are accepted",
        )
    if 0.0 < temperature < cfg.min_temperature:
        return (
            "temperature",
            f"temperature {temperature!r} is below this replica's smallest non-zero temperature "
            f"{cfg.min_temperature}; send 0 for greedy",
        )
    return None


def context_error(lv: LoadedVersion, max_tokens: int) -> str | None:
    """Why `max_tokens` does not fit the served model's context (None when it does)."""
    ctx = int(lv.config.get("max_context") or 0)
    if ctx and max_tokens > ctx - 1:
        return (
            f"max_tokens is {max_tokens}; the model's context holds {ctx} tokens including bos, "
            f"so at most {ctx - 1}"
        )
    return None


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class Replica:
    """Everything one replica process holds: config, weights, cache, event producer, sync agent."""

    def __init__(self, settings: Settings, cfg: ReplicaConfig, start_sync: bool = True):
        import torch

        from app.contracts.event_producer import EventProducer

        self.settings, self.cfg = settings, cfg
        self.id = cfg.id
        torch.set_num_threads(cfg.torch_threads)
        self.cache = WeightCache(cfg.resolved_cache_dir(settings.data_dir))
        self.store = WeightStore()
        self.producer = EventProducer(settings)
        self.topic = settings.topic("interactions")
        self.queue: GenerationQueue | None = None  # made in start(), on the serving event loop
        self.loop: asyncio.AbstractEventLoop | None = None
        self.api_key = (
            cfg.api_key.get_secret_value().encode("ascii") if cfg.api_key is not None else None
        )
        self.start_sync = start_sync
        self.agent = None
        self.jobs: set[asyncio.Task] = set()  # see spawn()
        from app.replica.engines import make_engine

        self.engine = make_engine(settings, cfg)  # what generates: app/replica/engines/
        self.pool = ThreadPoolExecutor(  # one model call per slot (admission.py)
            max_workers=self.engine.slots, thread_name_prefix=f"generate-{cfg.id}"
        )
        self._boot: threading.Thread | None = None

    def restore(self) -> None:
        """Serve the last verified versions from the local cache (before any sync)."""
        serving = self.cache.restore(engine=self.engine if self.engine.in_place else None)
        self.store.swap(
            champion=serving.champion, candidate=serving.candidate, traffic_pct=serving.traffic_pct
        )
        m.observe_serving(self.id, serving.versions(), serving.traffic_pct)
        if serving.champion is not None:
            log.info("replica %s serving from its cache: %s", self.id, serving.versions())

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue = GenerationQueue(
            self.id,
            self.pool,
            max_queued=self.cfg.max_queued,
            max_queued_cost=self.cfg.max_queued_cost,
            slots=self.engine.slots,
        )
        if self.engine.in_place:  # engine servers take minutes to start: serve health meanwhile
            self._boot = threading.Thread(
                target=self._boot_engine, name=f"boot-{self.id}", daemon=True
            )
        else:
            await asyncio.to_thread(self.restore)
        await self.producer.connect()
        if self._boot is not None:
            self._boot.start()
        elif self.start_sync:
            self._start_agent()

    def _start_agent(self) -> None:
        from app.replica.sync import SyncAgent

        self.agent = SyncAgent(self.settings, self.cfg, self.store, self.cache, engine=self.engine)
        self.agent.start()

    def _boot_engine(self) -> None:
        """Restore the cached versions into the engine (it starts its servers), then sync."""
        try:
            self.restore()
        except Exception:
            log.exception("replica %s could not restore its cached versions", self.id)
        if self.start_sync:
            self._start_agent()

    async def stop(self) -> None:
        if self.jobs:  # streams finishing: let them record their events (bounded)
            await asyncio.wait(list(self.jobs), timeout=30)
        if self._boot is not None and self._boot.is_alive():
            await asyncio.to_thread(self._boot.join, 5)
        if self.agent is not None:
            await asyncio.to_thread(self.agent.stop)
        await self.producer.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.engine.close)

    # --- generation -----------------------------------------------------------------------------------
    def authorized(self, request: Request) -> bool:
        """True without a serving key; else whether `Authorization: Bearer <key>` matches (constant time)."""
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("latin-1"), self.api_key
        )

    @staticmethod
    def encode_prompt(lv: LoadedVersion, text: str, max_tokens: int) -> list[int]:
        """The prompt tokens the model will see (the end of the prompt when it is longer than the context).

        Raises ValueError when the version's tokenizer cannot encode the prompt."""
        tok = lv.policy.tokenizer
        try:
            prompt = tok.encode(text)
        except (ValueError, UnicodeError) as exc:
            raise ValueError(f"the tokenizer {tok.name} cannot encode the prompt: {exc}") from None
        bad = [t for t in prompt if not 0 <= t < tok.vocab_size]
        if bad:
            raise ValueError(
                f"the tokenizer {tok.name} produced ids outside its vocabulary: {bad[:5]}"
            )
        ctx = int(lv.config.get("max_context") or 0)
        if ctx:
            keep = ctx - 1 - max_tokens
            prompt = prompt[-keep:] if keep > 0 else []
        return prompt

    def _generate(
        self,
        lv: LoadedVersion,
        prompt: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        seed: int | None = None,
        on_step: Any = None,
    ) -> tuple[list[Any], float]:
        """Runs on the generation thread: (samples, model seconds). `on_step`: trainer/policy/base.py."""
        t0 = time.perf_counter()
        samples = lv.policy.generate(
            [prompt] * n,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=secrets.randbits(62) if seed is None else seed,
            on_step=on_step,
        )
        return samples, time.perf_counter() - t0

    def generation_event(
        self,
        *,
        request_id: str,
        session_id: str,
        temperature: float,
        lv: LoadedVersion,
        prompt: list[int],
        sample: Any,
        group_id: str | None,
        latency_ms: float,
        finish_reason: str,
        stream: bool,
    ) -> dict[str, Any]:
        """The `generation` event of one completion, checked against the ingest contract."""
        from app.contracts.events import encode_routes, parse_event

        event: dict[str, Any] = {
            "event_id": f"gen-{request_id}",
            "type": "generation",
            "request_id": request_id,
            "session_id": session_id,
            "ts": _now(),
            "model_version": lv.version,
            "prompt_tokens": list(prompt),
            "completion_tokens": list(sample.tokens),
            "logprobs": [float(x) for x in sample.logprobs],
            "temperature": float(temperature),
            "latency_ms": round(latency_ms, 3),
            "tokenizer": lv.policy.tokenizer.name,
            "finish_reason": finish_reason,
            "stream": stream,
        }
        if sample.routes is not None:
            event["routes"], event["route_shape"] = encode_routes(sample.routes)
        if group_id is not None:
            event["group_id"] = group_id
        parse_event(event)  # the replica's own output must satisfy the ingest contract
        return event  # (route_shape is a tuple here, a JSON array on the wire)

    async def record(self, events: list[dict[str, Any]]) -> None:
        """Send generation events to `<ns>.interactions` and wait for Kafka's ack
        (RecordRejected / KafkaUnavailable from app/contracts/event_producer.py otherwise)."""
        from app.contracts.kafka import dumps

        await self.producer.produce(self.topic, [(e["request_id"], dumps(e)) for e in events])

    def spawn(self, coro: Any) -> asyncio.Task:
        """Run `coro` as a task the replica owns (it outlives the request that started it, e.g. a
        stream whose client went away still records what was generated); stop() waits for them."""
        task = asyncio.get_running_loop().create_task(coro)
        self.jobs.add(task)
        task.add_done_callback(self.jobs.discard)
        return task


def create_app(settings: Settings, cfg: ReplicaConfig, start_sync: bool = True) -> FastAPI:
    replica = Replica(settings, cfg, start_sync=start_sync)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await replica.start()
        try:
            yield
        finally:
            await replica.stop()

    app = FastAPI(title=f"Flywheel replica {cfg.id}", version="0.1.0", lifespan=lifespan)
    app.state.replica = replica
    app.add_middleware(
        BodyLimitMiddleware, limits=body_limits(settings)
    )  # app/httplimits.py: body size, timeouts

    def invalid(slot: str, field: str, msg: str) -> JSONResponse:
        m.REQUESTS.labels(cfg.id, slot, "invalid").inc()
        return _error(field, msg)

    def check_limits(req: CompleteRequest) -> JSONResponse | None:
        """The replica's own bounds on an otherwise valid request (422 naming the field)."""
        refused = limit_error(
            cfg,
            n=req.n,
            max_tokens=req.max_tokens,
            prompt_chars=len(req.prompt),
            temperature=req.temperature,
        )
        return None if refused is None else invalid("none", *refused)

    @app.post(
        "/v1/complete",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": CompleteRequest.model_json_schema()}},
            }
        },
    )
    async def complete(request: Request) -> Response:
        if not replica.authorized(request):  # before the body is read
            m.REQUESTS.labels(cfg.id, "none", "unauthorized").inc()
            return JSONResponse(
                {"detail": "this replica needs a serving key: send Authorization: Bearer <key>"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        t_start = time.perf_counter()
        try:
            req = parse_complete_request(await request.body())
        except RequestInvalid as exc:
            m.REQUESTS.labels(cfg.id, "none", "invalid").inc()
            return JSONResponse({"detail": exc.errors}, status_code=422)
        if (refused := check_limits(req)) is not None:
            return refused
        lease = None
        while lease is None:  # a swap between the snapshot and the lease: pick again
            serving = replica.store.snapshot()  # one consistent snapshot for the whole request
            if serving.champion is None:
                m.REQUESTS.labels(cfg.id, "none", "not_ready").inc()
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
            return await answer(req, slot, lv, lease, t_start, request)
        finally:
            lease.release()

    async def answer(
        req: CompleteRequest,
        slot: str,
        lv: LoadedVersion,
        lease: Lease,
        t_start: float,
        request: Request,
    ) -> Response:
        from app.contracts.event_producer import KafkaUnavailable, RecordRejected
        from app.replica.engines.base import EngineUnavailable
        from trainer.policy.base import SamplingError

        if (too_long := context_error(lv, req.max_tokens)) is not None:
            return invalid(slot, "max_tokens", too_long)
        try:
            prompt = replica.encode_prompt(lv, req.prompt, req.max_tokens)
        except ValueError as exc:
            return invalid(slot, "prompt", str(exc))

        async def still_wanted() -> bool:
            return not await request.is_disconnected()

        assert replica.queue is not None, "the replica has not started"
        try:
            samples, gen_s = await replica.queue.run(
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
            m.REQUESTS.labels(cfg.id, slot, "rejected").inc()
            return JSONResponse(
                {"detail": exc.detail},
                status_code=503,
                headers={"Retry-After": str(exc.retry_after_s)},
            )
        except ClientGone:
            m.REQUESTS.labels(cfg.id, slot, "disconnected").inc()
            return Response(status_code=499)  # nobody reads it; nothing was generated or logged
        except SamplingError as exc:
            return invalid(slot, "temperature", str(exc))
        except EngineUnavailable as exc:
            m.REQUESTS.labels(cfg.id, slot, "unavailable").inc()
            log.warning("engine unavailable: %s", exc)
            return JSONResponse(
                {"detail": f"the engine cannot generate: {exc}"},
                status_code=503,
                headers={"Retry-After": "2"},
            )
        m.GENERATION_SECONDS.labels(cfg.id).observe(gen_s)
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
        try:
            await replica.record(events)
        except (
            RecordRejected
        ) as exc:  # e.g. an event over the topic's record limit: nothing was sent
            m.REQUESTS.labels(cfg.id, slot, "invalid").inc()
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
            m.REQUESTS.labels(cfg.id, slot, "unavailable").inc()
            log.warning("generation events not acknowledged: %s", exc)
            return JSONResponse(
                {"detail": f"could not record the generation: {exc}"},
                status_code=503,
                headers={"Retry-After": str(exc.retry_after_s)},
            )
        m.REQUESTS.labels(cfg.id, slot, "ok").inc()
        m.REQUEST_SECONDS.labels(cfg.id).observe(time.perf_counter() - t_start)
        m.TOKENS.labels(cfg.id, lv.version, "prompt").inc(len(prompt) * req.n)
        m.TOKENS.labels(cfg.id, lv.version, "completion").inc(sum(len(s.tokens) for s in samples))
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

    from app.replica.openai_api import router as openai_router

    app.include_router(openai_router(replica))  # /v1/completions, /v1/chat/completions, /v1/models

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        serving = replica.store.snapshot()
        agent = replica.agent
        return {
            "replica_id": cfg.id,
            **serving.versions(),
            "traffic_pct": serving.traffic_pct,
            "desired": agent.desired() if agent else None,
            "last_sync": agent.last_result if agent else None,
            "syncing": agent.in_progress if agent else None,
            "engine": replica.engine.status(),
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        from app.infra.wait import waiting

        serving = replica.store.snapshot()
        body = {"ready": serving.champion is not None, **serving.versions()}
        if (
            pending := waiting()
        ):  # what it waits for (broker, a champion in the log), app/infra/wait.py
            body["waiting_for"] = pending
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(settings: Settings, cfg: ReplicaConfig, log_level: str = "info") -> None:
    """Run one replica with uvicorn until interrupted."""
    import uvicorn

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    config = uvicorn_config(
        create_app(settings, cfg),
        settings,
        host=cfg.host,
        port=cfg.port,
        log_level=log_level,
        timeout_graceful_shutdown=10,
    )  # connection limits: app/httplimits.py
    uvicorn.Server(config).run()
