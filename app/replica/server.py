"""The replica's HTTP app: `POST /v1/complete`, `/v1/status`, `/healthz`, `/readyz`, `/metrics`.

    flywheel replica --host 0.0.0.0 --port 8100 --replica-id replica-1

`POST /v1/complete` `{session_id, prompt, max_tokens, temperature, n}` picks the champion or the
candidate by a stable hash of `session_id` (routing.py), samples `n` completions in one batch on
a single-thread executor (the event loop never blocks; one model call at a time per replica),
writes one `generation` event per completion to `<ns>.interactions` (prompt/completion tokens,
behaviour log-probs, MoE routes, temperature, group_id, latency, tokenizer, model_version), and
answers only after Kafka acknowledged them all (503 + Retry-After otherwise):

    {"request_id": "...", "model_version": "3",
     "completions": [{"request_id": "...", "text": "...", "finish_reason": "stop"|"length", "tokens": 17}]}

For n == 1 the completion's request_id is the top-level one; for n > 1 each completion has its
own and their events share `group_id` = the top-level request_id. `tokens` is the number of
completion tokens. Prompts longer than the model's context keep their end (like an editor's
context window); the event records the tokens the model actually saw.

The request picks its `LoadedVersion` from one snapshot of the weight store and keeps it until
it has answered, so a sync that swaps versions meanwhile never affects it (weights.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from app.replica import metrics as m
from app.replica.config import ReplicaConfig
from app.replica.routing import pick_slot
from app.replica.weights import LoadedVersion, WeightCache, WeightStore
from app.settings import Settings

log = logging.getLogger(__name__)


class CompleteRequest(BaseModel):
    """Body of POST /v1/complete (limits beyond these come from ReplicaConfig, checked in the route)."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1, max_length=128, description="Editor session; picks champion vs candidate.")
    prompt: str = Field(description="Text to complete.")
    max_tokens: int = Field(64, ge=1, description="Most completion tokens per candidate.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0 = greedy.")
    n: int = Field(1, ge=1, description="Candidates for this context (n > 1 share a group_id).")


def _error(field: str, msg: str, status: int = 422) -> JSONResponse:
    return JSONResponse({"detail": [{"loc": ["body", field], "msg": msg, "type": "value_error"}]}, status_code=status)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Replica:
    """Everything one replica process holds: config, weights, cache, event producer, sync agent."""

    def __init__(self, settings: Settings, cfg: ReplicaConfig, start_sync: bool = True):
        import torch

        from app.api.producer import EventProducer

        self.settings, self.cfg = settings, cfg
        self.id = cfg.id
        torch.set_num_threads(cfg.torch_threads)
        self.cache = WeightCache(cfg.resolved_cache_dir(settings.data_dir))
        self.store = WeightStore()
        self.producer = EventProducer(settings)
        self.topic = settings.topic("interactions")
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"generate-{cfg.id}")
        self.start_sync = start_sync
        self.agent = None

    def restore(self) -> None:
        """Serve the last verified versions from the local cache (before any sync)."""
        serving = self.cache.restore()
        self.store.swap(champion=serving.champion, candidate=serving.candidate, traffic_pct=serving.traffic_pct)
        m.observe_serving(self.id, serving.versions(), serving.traffic_pct)
        if serving.champion is not None:
            log.info("replica %s serving from its cache: %s", self.id, serving.versions())

    async def start(self) -> None:
        await asyncio.to_thread(self.restore)
        await self.producer.connect()
        if self.start_sync:
            from app.replica.sync import SyncAgent

            self.agent = SyncAgent(self.settings, self.cfg, self.store, self.cache)
            self.agent.start()

    async def stop(self) -> None:
        if self.agent is not None:
            await asyncio.to_thread(self.agent.stop)
        await self.producer.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # --- generation -----------------------------------------------------------------------------------
    def _generate(self, lv: LoadedVersion, req: CompleteRequest, max_tokens: int) -> tuple[list[int], list[Any], float]:
        """Runs on the generation thread: (prompt tokens seen, samples, model seconds)."""
        policy = lv.policy
        tok = policy.tokenizer
        prompt = tok.encode(req.prompt)
        ctx = int(lv.config.get("max_context") or 0)
        if ctx:
            keep = ctx - 1 - max_tokens
            prompt = prompt[-keep:] if keep > 0 else []
        t0 = time.perf_counter()
        samples = policy.generate([prompt] * req.n, max_tokens=max_tokens, temperature=req.temperature,
                                  seed=secrets.randbits(62))
        return prompt, samples, time.perf_counter() - t0

    def generation_event(self, *, request_id: str, req: CompleteRequest, lv: LoadedVersion, prompt: list[int],
                         sample: Any, group_id: str | None, latency_ms: float) -> dict[str, Any]:
        from app.events import encode_routes, parse_event

        event: dict[str, Any] = {
            "event_id": f"gen-{request_id}", "type": "generation", "request_id": request_id,
            "session_id": req.session_id, "ts": _now(), "model_version": lv.version,
            "prompt_tokens": list(prompt), "completion_tokens": list(sample.tokens),
            "logprobs": [float(x) for x in sample.logprobs], "temperature": float(req.temperature),
            "latency_ms": round(latency_ms, 3), "tokenizer": lv.policy.tokenizer.name,
        }
        if sample.routes is not None:
            event["routes"], event["route_shape"] = encode_routes(sample.routes)
        if group_id is not None:
            event["group_id"] = group_id
        parse_event(event)  # the replica's own output must satisfy the ingest contract
        return event  # (route_shape is a tuple here, a JSON array on the wire)


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

    @app.post("/v1/complete")
    async def complete(req: CompleteRequest) -> Response:
        from app.api.producer import KafkaUnavailable
        from app.kafka_io import dumps

        t_start = time.perf_counter()
        if req.n > cfg.max_n:
            m.REQUESTS.labels(cfg.id, "none", "invalid").inc()
            return _error("n", f"n is {req.n}; this replica serves at most {cfg.max_n} candidates per request")
        if req.max_tokens > cfg.max_tokens:
            m.REQUESTS.labels(cfg.id, "none", "invalid").inc()
            return _error("max_tokens", f"max_tokens is {req.max_tokens}; this replica allows at most {cfg.max_tokens}")
        if len(req.prompt) > cfg.max_prompt_chars:
            m.REQUESTS.labels(cfg.id, "none", "invalid").inc()
            return _error("prompt", f"prompt has {len(req.prompt)} characters; at most {cfg.max_prompt_chars} are accepted")
        serving = replica.store.snapshot()  # one consistent snapshot for the whole request
        if serving.champion is None:
            m.REQUESTS.labels(cfg.id, "none", "not_ready").inc()
            return JSONResponse({"detail": "no verified weights loaded yet; retry shortly"}, status_code=503,
                                headers={"Retry-After": "2"})
        slot = pick_slot(req.session_id, serving.traffic_pct, serving.candidate is not None)
        lv = serving.candidate if slot == "candidate" else serving.champion
        assert lv is not None
        ctx = int(lv.config.get("max_context") or 0)
        if ctx and req.max_tokens > ctx - 1:
            m.REQUESTS.labels(cfg.id, slot, "invalid").inc()
            return _error("max_tokens", f"max_tokens is {req.max_tokens}; the model's context holds {ctx} tokens "
                                        f"including bos, so at most {ctx - 1}")
        loop = asyncio.get_running_loop()
        prompt, samples, gen_s = await loop.run_in_executor(replica.pool, replica._generate, lv, req, req.max_tokens)
        m.GENERATION_SECONDS.labels(cfg.id).observe(gen_s)
        top_id = uuid.uuid4().hex
        ids = [top_id] if req.n == 1 else [uuid.uuid4().hex for _ in range(req.n)]
        group_id = None if req.n == 1 else top_id
        latency_ms = (time.perf_counter() - t_start) * 1000.0
        events = [replica.generation_event(request_id=rid, req=req, lv=lv, prompt=prompt, sample=s,
                                           group_id=group_id, latency_ms=latency_ms) for rid, s in zip(ids, samples)]
        try:
            await replica.producer.produce(replica.topic, [(e["request_id"], dumps(e)) for e in events])
        except KafkaUnavailable as exc:
            m.REQUESTS.labels(cfg.id, slot, "unavailable").inc()
            log.warning("generation events not acknowledged: %s", exc)
            return JSONResponse({"detail": f"could not record the generation: {exc}"}, status_code=503,
                                headers={"Retry-After": str(exc.retry_after_s)})
        m.REQUESTS.labels(cfg.id, slot, "ok").inc()
        m.REQUEST_SECONDS.labels(cfg.id).observe(time.perf_counter() - t_start)
        m.TOKENS.labels(cfg.id, lv.version, "prompt").inc(len(prompt) * req.n)
        m.TOKENS.labels(cfg.id, lv.version, "completion").inc(sum(len(s.tokens) for s in samples))
        eos = lv.policy.tokenizer.eos_id
        completions = [{"request_id": rid, "text": s.text, "tokens": len(s.tokens),
                        "finish_reason": "stop" if s.tokens and s.tokens[-1] == eos else "length"}
                       for rid, s in zip(ids, samples)]
        return JSONResponse({"request_id": top_id, "model_version": lv.version, "slot": slot,
                             "completions": completions})

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        serving = replica.store.snapshot()
        agent = replica.agent
        return {"replica_id": cfg.id, **serving.versions(), "traffic_pct": serving.traffic_pct,
                "desired": agent.desired() if agent else None, "last_sync": agent.last_result if agent else None,
                "syncing": agent.in_progress if agent else None}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        from app.infra.wait import waiting

        serving = replica.store.snapshot()
        body = {"ready": serving.champion is not None, **serving.versions()}
        if pending := waiting():  # what it waits for (broker, a champion in the log), app/infra/wait.py
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
    uvicorn.run(create_app(settings, cfg), host=cfg.host, port=cfg.port, log_level=log_level, access_log=False,
                timeout_graceful_shutdown=10)

