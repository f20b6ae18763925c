"""Fixtures of the replica integration tests: real replicas (uvicorn on free ports) on the session's
real Kafka broker and MLflow server, tiny policies, and readers of the topics they write."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.replica.config import ReplicaConfig
from app.settings import Settings
from tests.unit.replica.conftest import TINY, tiny_state
from tests.waiting import poll


def read_topic(
    settings: Settings,
    name: str,
    want: int,
    timeout_s: float = 30.0,
    where: Callable[[dict], bool] = lambda _e: True,
) -> list[dict[str, Any]]:
    """Every JSON record of `<ns>.<name>` from the beginning until `want` match `where`."""
    from kafka import TopicPartition

    from app.infra.kafka import make_consumer

    consumer = make_consumer(settings, group_id=None)
    try:
        topic = settings.topic(name)
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                out.extend(e for e in (json.loads(r.value) for r in records) if where(e))
            if len(out) >= want:
                break
        return out
    finally:
        consumer.close()


@pytest.fixture()
def replica_factory(make_settings, tmp_path) -> Iterator[Callable[..., Any]]:
    """Start a replica app (real uvicorn in a thread); every one started is stopped after the test."""
    from app.api.server import ServerThread
    from app.replica.server import create_app

    started: list[ServerThread] = []

    def _start(settings: Settings | None = None, start_sync: bool = True, **cfg: Any):
        settings = settings or make_settings()
        cfg.setdefault("cache_dir", tmp_path / f"cache-{cfg.get('id', 'replica-1')}")
        config = ReplicaConfig(**cfg)
        server = ServerThread(create_app(settings, config, start_sync=start_sync)).start()
        started.append(server)
        server.settings, server.config, server.replica = (
            settings,
            config,
            server.server.config.app.state.replica,
        )
        return server

    yield _start
    for s in started:
        s.stop()


@pytest.fixture()
def seeded_replica(replica_factory, make_settings, tmp_path) -> Callable[..., Any]:
    """Start a replica (no sync agent) that serves tiny version 7 from its verified cache at once;
    keyword arguments are ReplicaConfig fields. `max_context` (a power of two) widens the tiny
    model's context of 64 tokens, e.g. for prompts that carry tool definitions and results."""
    from app.replica.weights import WeightCache, load_verified
    from kernels.delta.hashing import checkpoint_sha256

    def _start(max_context: int | None = None, **cfg: Any):
        model_cfg, state = tiny_state(7, max_context)
        cache_dir = tmp_path / f"seeded-{cfg.get('id', 'replica-1')}"
        cache = WeightCache(cache_dir)
        cache.put(load_verified("7", state, model_cfg, checkpoint_sha256(state)))
        cache.set_serving(cache.restore())
        return replica_factory(make_settings(), start_sync=False, cache_dir=cache_dir, **cfg)

    return _start


def metric(srv, name: str, **labels: str) -> float:
    """The sum of the samples of the replica's /metrics that match, read over HTTP (0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


class HeldThread:
    """Holds a replica's generation thread with a test-controlled call in its own GenerationQueue,
    so requests sent meanwhile queue deterministically (the queue sees the thread as busy)."""

    def __init__(self, srv) -> None:
        import asyncio
        import threading

        self.started, self.release = threading.Event(), threading.Event()
        replica = srv.replica
        self.future = asyncio.run_coroutine_threadsafe(
            replica.queue.run(1, self._hold), replica.loop
        )
        assert self.started.wait(30), "the held call never started"

    def _hold(self) -> None:
        self.started.set()
        assert self.release.wait(120), "the held generation thread was never released"

    def __enter__(self) -> HeldThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self.future.result(30)


# a 'training step' (nudge `frac` of every float tensor's elements); one implementation for all tests
from tests.integration.rollout.stack import nudged as perturb  # noqa: E402 (re-exported)


class Registered:
    """Versions registered in the real MLflow server the way the trainer ships them: the pyfunc
    model (trainer.registry.Registry.upload_ship) plus the sync artifacts of app.contracts.artifacts in
    `ships/<ship_id>/delta/`. Version numbers are MLflow's (1, 2, ...)."""

    def __init__(self, uri: str, model: str, config: dict, anchor_every: int):
        from trainer.registry import Registry

        self.reg = Registry(uri, model, experiment=f"replica-tests-{model}")
        self.reg.ensure_model()
        self.run_id = self.reg.start_run()
        self.config, self.anchor_every = config, anchor_every
        self.states: dict[str, dict] = {}
        self.manifests: dict[str, Any] = {}
        self.sources: dict[str, str] = {}

    def add(self, state: dict) -> str:
        import tempfile
        import uuid

        from app.contracts.artifacts import publish_version

        version = str(len(self.states) + 1)
        parent = str(len(self.states)) if self.states else None
        with tempfile.TemporaryDirectory() as tmp:
            manifest = publish_version(
                tmp,
                version,
                state,
                self.states.get(parent),
                parent,
                self.manifests.get(parent),
                anchor_every=self.anchor_every,
            )
            ship = f"ship-{uuid.uuid4().hex[:8]}"
            source = self.reg.upload_ship(
                self.run_id,
                ship,
                state,
                self.config,
                {"name": "byte-v1", "vocab_size": 259, "eos_id": 257},
                [],
                {"delta": Path(tmp)},
            )
        got = self.reg.create_version(
            source, self.run_id, ship, {"parent_version": parent or "none"}
        )
        assert str(got) == version, f"MLflow gave version {got}, expected {version}"
        self.states[version], self.manifests[version], self.sources[version] = (
            state,
            manifest,
            source,
        )
        return version

    def artifact_file(self, artifacts_root: Path, version: str, filename: str) -> Path:
        """The file on the MLflow server's local artifact store (for corruption tests)."""
        rel = self.sources[version].split("mlflow-artifacts:/", 1)[1].rsplit("/model", 1)[0]
        path = artifacts_root / rel / "delta" / filename
        assert path.exists(), f"{path} not found"
        return path


def publish_deployment(settings: Settings, type_: str, version: str, **kw: Any) -> None:
    from app.contracts.deployments import DeploymentEvent, DeploymentLog

    with DeploymentLog(settings) as log:
        log.publish(
            DeploymentEvent(
                type=type_,
                model=settings.model_name,
                version=version,
                source="controller",
                actor="test",
                **kw,
            )
        )


def status(srv) -> dict:
    import httpx

    return httpx.get(f"{srv.url}/v1/status", timeout=10).json()


def serving_equals(srv, slot: str, state: dict) -> bool:
    """Whether the replica's `slot` (champion/candidate) serves exactly `state`, bit for bit."""
    import torch

    got = getattr(srv.replica.store.snapshot(), slot).policy.serving_state_dict()
    return set(got) == set(state) and all(
        torch.equal(got[k].view(torch.int16), state[k].view(torch.int16)) for k in state
    )


def register_chain(reg: Registered, n_versions: int, seed: int) -> list[dict]:
    """Register versions 1..n: a tiny policy, then each one a perturbation of the previous (seeds
    seed, seed+1, ...); returns their states in version order."""
    states = [tiny_state(0)[1]]
    for i in range(n_versions - 1):
        states.append(perturb(states[-1], seed + i))
    for st in states:
        reg.add(st)
    return states


def ship_two_versions(make_settings, mlflow_server, tmp_path: Path) -> Settings:
    """A real trainer (tiny policy) on a fresh model ships v1 (its base) and v2 (after one batch of
    4 rollouts) the way `flywheel trainer` does; returns the settings it ran with."""
    import uuid

    from tests.integration.trainer.conftest import TINY_POLICY, drain, produce, rollout_records
    from trainer.config import TrainerConfig
    from trainer.loop import Trainer

    settings = make_settings(
        mlflow_uri=mlflow_server.uri,
        model_name=f"policy-{uuid.uuid4().hex[:8]}",
        ship_interval=3600,
    )
    trainer = Trainer(
        settings,
        TrainerConfig(
            state_dir=tmp_path / "trainer-state",
            policy=TINY_POLICY,
            pretrain_steps=0,
            batch_size=4,
            max_wait_s=0.5,
            lr=1e-3,
            metrics_port=0,
            checkpoint_every=1,
            consumer_group=f"trainer-{uuid.uuid4().hex[:6]}",
            experiment=f"exp-{uuid.uuid4().hex[:6]}",
        ),
    )
    try:
        produce(settings, rollout_records(trainer.policy, 1, 4, lambda text: 0.75, group_size=2))
        drain(trainer, 4)
        assert trainer.maybe_ship(force=True) == 2
    finally:
        trainer.close()
    return settings


def wait_for(pred: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    return poll(pred, timeout_s, what)


@pytest.fixture()
def registered(mlflow_server, make_settings):
    """(settings on the real broker + MLflow with a fresh model name, factory of Registered)."""
    import uuid

    settings = make_settings(
        mlflow_uri=mlflow_server.uri, model_name=f"policy-{uuid.uuid4().hex[:8]}"
    )

    def _make(anchor_every: int = 8, seed: int = 0) -> Registered:
        return Registered(
            mlflow_server.uri, settings.model_name, {**TINY, "init_seed": seed}, anchor_every
        )

    return settings, _make
