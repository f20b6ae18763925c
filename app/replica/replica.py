"""One replica process's state: its config, the weight store and cache, the generation queue, the
event producer and the sync agent, and the generation path both APIs share (prompt encoding,
sampling on the generation threads, one `generation` event per completion, acknowledged by Kafka
before the answer). app/replica/server.py serves it over HTTP (the routes: app/replica/routes/).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from fastapi import Request

from app.replica import metrics as m
from app.replica.admission import GenerationQueue
from app.replica.config import ReplicaConfig
from app.replica.weights import LoadedVersion, WeightCache, WeightStore
from app.settings import Settings

log = logging.getLogger(__name__)


class ContextOverflow(ValueError):
    """A prompt that must not be cut (a chat with tools) is longer than the context allows."""


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class Replica:
    """Everything one replica process holds: config, weights, cache, event producer, sync agent."""

    def __init__(self, settings: Settings, cfg: ReplicaConfig, start_sync: bool = True):
        import torch

        from app.infra.event_producer import EventProducer

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
    def encode_prompt(
        lv: LoadedVersion, text: str, max_tokens: int, truncate: bool = True
    ) -> list[int]:
        """The prompt tokens the model will see (the end of the prompt when it is longer than the
        context; with `truncate` False, a ContextOverflow instead).

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
        if ctx and not truncate and len(prompt) > ctx - 1 - max_tokens:
            raise ContextOverflow(
                f"the prompt is {len(prompt)} tokens; with max_tokens {max_tokens} the model's "
                f"context of {ctx} (bos included) holds at most {max(0, ctx - 1 - max_tokens)}"
            )
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
        top_logprobs: int = 0,
        constraint: Any = None,
    ) -> tuple[list[Any], float]:
        """Runs on the generation thread: (samples, model seconds). `on_step`, `top_logprobs`,
        `constraint` (a compiled grammar, started per generation): policy/base.py
        `Policy.generate`."""
        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {"top_logprobs": top_logprobs} if top_logprobs else {}
        if constraint is not None:
            kwargs["constraint"] = constraint.start(n)
        samples = lv.policy.generate(
            [prompt] * n,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=secrets.randbits(62) if seed is None else seed,
            on_step=on_step,
            **kwargs,
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
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The `generation` event of one completion, checked against the ingest contract; `extra`:
        a chat turn's fields (turn, tools, calls: app/replica/openai/generation.py)."""
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
        event.update(extra or {})
        parse_event(event)  # the replica's own output must satisfy the ingest contract
        return event  # (route_shape is a tuple here, a JSON array on the wire)

    async def record(self, events: list[dict[str, Any]]) -> None:
        """Send generation events to `<ns>.interactions` and wait for Kafka's ack
        (RecordRejected / KafkaUnavailable from app/infra/event_producer.py otherwise)."""
        from app.infra.kafka import dumps

        await self.producer.produce(self.topic, [(e["request_id"], dumps(e)) for e in events])

    def spawn(self, coro: Any) -> asyncio.Task:
        """Run `coro` as a task the replica owns (it outlives the request that started it, e.g. a
        stream whose client went away still records what was generated); stop() waits for them."""
        task = asyncio.get_running_loop().create_task(coro)
        self.jobs.add(task)
        task.add_done_callback(self.jobs.discard)
        return task
