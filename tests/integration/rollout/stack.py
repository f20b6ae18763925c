"""The whole rollout stack on real parts, in one process: what the rollout tests and
`bench/rollback.py` run against.

    stack = RolloutStack(settings, ControllerSettings(...), workdir).start()
    v1 = stack.versions.add(tiny_policy_state(seed=0))     # registered like the trainer ships it
    stack.wait_serving("1")                                 # both replicas answer with v1
    stack.complete(0, CANARY_SESSION)["model_version"]
    stack.status()["champion"], stack.history(type="promoted")
    stack.stop()

Parts (all real; nothing mocked):
- the Kafka broker and the MLflow server are given (the session fixtures, or the bench's own);
- the API app (`app.api.main.create_app`) on a real uvicorn port: MLflow webhook receiver,
  status API, operator verbs; a SQLite app database migrated to head, with read/admin keys;
- the projector (`app.projector.projector.follow`) in a thread, feeding the status API;
- the controller loop (`app.controller.controller.Controller`) in a thread, with the real
  offline gate (`GateRunner`: weights downloaded from MLflow, finite/weight-change/KL/
  regression/behaviour checks) at a reduced sample size so a gate takes seconds on a shared CPU;
- N replicas (`app.replica.server.create_app`), each on its own uvicorn port with its own
  verified weight cache, following the deployment log and fetching versions from MLflow.

Versions are tiny byte-level MoE policies registered with the trainer's code: the pyfunc
model (`trainer.registry.Registry.upload_ship` + `create_version`) and the delta/manifest
sync artifacts (`app.contracts.artifacts.publish_version`), then announced with `version_registered`.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.settings import Settings
from tests.waiting import poll

# d_model 16: gates, syncs and /v1/complete stay cheap; context 256 leaves room for the gate's
# sampled completions (48 tokens) after the regression prompts.
TINY_POLICY = {
    "type": "moe-byte",
    "d_model": 16,
    "n_layers": 1,
    "n_heads": 2,
    "d_ff": 16,
    "n_experts": 2,
    "top_k": 1,
    "max_context": 256,
}


def session_in_bucket(lo: int, hi: int) -> str:
    """A session id whose routing bucket (basis points, app/replica/routing.py) lies in [lo, hi)."""
    from app.replica.routing import session_bucket

    i = 0
    while not lo <= session_bucket(f"session-{i}") < hi:
        i += 1
    return f"session-{i}"


CANARY_SESSION = session_in_bucket(0, 500)  # served by the candidate at every canary step (>= 5 %)
CHAMPION_SESSION = session_in_bucket(
    5000, 10_000
)  # served by the champion until promotion (steps < 100 %)


def tiny_policy_state(seed: int = 0) -> dict[str, Any]:
    """bf16 serving weights of a freshly initialised tiny policy."""
    from policy import build_policy

    return build_policy({**TINY_POLICY, "init_seed": seed}).serving_state_dict()


def nudged(
    state: dict[str, Any], seed: int, frac: float = 0.05, scale: float = 0.05
) -> dict[str, Any]:
    """A 'training step': `frac` of each float tensor's elements moved by N(0, scale) (stays in bf16)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        if not t.is_floating_point():
            out[k] = t
            continue
        mask = torch.rand(t.shape, generator=g) < frac
        out[k] = torch.where(
            mask, t.float() + torch.randn(t.shape, generator=g) * scale, t.float()
        ).to(t.dtype)
    return out


def with_nan(state: dict[str, Any]) -> dict[str, Any]:
    """A diverged checkpoint: every float tensor's first element is NaN."""
    out = {k: v.clone() for k, v in state.items()}
    for t in out.values():
        if t.is_floating_point():
            t.view(-1)[0] = float("nan")
    return out


def blown_up(state: dict[str, Any], factor: float = 40.0) -> dict[str, Any]:
    """A corrupted checkpoint: finite, but every weight scaled far beyond a training step's change."""
    return {
        k: (v.float() * factor).to(v.dtype) if v.is_floating_point() else v
        for k, v in state.items()
    }


class Versions:
    """Registers versions the way `trainer/shipping.py` ships them and announces each one."""

    def __init__(self, settings: Settings, anchor_every: int = 4):
        from policy import build_policy
        from trainer.registry import Registry

        self.settings = settings
        self.reg = Registry(
            settings.mlflow_uri, settings.model_name, experiment=f"rollout-{settings.model_name}"
        )
        self.reg.ensure_model()
        self.run_id = self.reg.start_run()
        self.anchor_every = anchor_every
        tok = build_policy(TINY_POLICY).tokenizer
        self.tokenizer = {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}
        self.states: dict[str, dict] = {}
        self.manifests: dict[str, Any] = {}
        self.ships: dict[str, str] = {}
        self.parents: dict[str, str | None] = {}
        self.kinds: dict[str, str] = {}

    def add(self, state: dict[str, Any], parent: str | None = None, kind: str = "trained") -> str:
        """Upload + register `state` (delta from `parent`), publish `version_registered`; returns the version."""
        version = self.upload(state, parent, kind)
        self.announce(version)
        return version

    def upload(
        self, state: dict[str, Any], parent: str | None = None, kind: str = "trained"
    ) -> str:
        """Artifacts up and the version created in MLflow (the controller does not know it yet)."""
        from app.contracts.artifacts import publish_version

        predicted = str(max((int(v) for v in self.states), default=0) + 1)
        ship = f"ship-{uuid.uuid4().hex[:10]}"
        with tempfile.TemporaryDirectory(prefix="flywheel-rollout-ship-") as tmp:
            manifest = publish_version(
                tmp,
                predicted,
                state,
                self.states.get(parent) if parent else None,
                parent,
                self.manifests.get(parent) if parent else None,
                anchor_every=self.anchor_every,
            )
            source = self.reg.upload_ship(
                self.run_id, ship, state, {**TINY_POLICY}, self.tokenizer, [], {"delta": Path(tmp)}
            )
        version = str(
            self.reg.create_version(
                source,
                self.run_id,
                ship,
                {
                    "kind": kind,
                    "parent_version": parent or "none",
                    "rollouts_consumed": "0",
                    "reward_spec": "v1",
                },
            )
        )
        assert version == predicted, (
            f"MLflow gave version {version}, the delta was written for {predicted}"
        )
        self.states[version], self.manifests[version] = state, manifest
        self.ships[version], self.parents[version], self.kinds[version] = ship, parent, kind
        return version

    def announce(self, version: str) -> None:
        """Publish `version_registered` for an uploaded version (what the trainer does right after registering)."""
        from app.contracts.deployments import DeploymentEvent, DeploymentLog

        with DeploymentLog(self.settings) as dlog:
            dlog.publish(
                DeploymentEvent(
                    event_id=f"vr-{self.ships[version]}",
                    type="version_registered",
                    model=self.settings.model_name,
                    version=version,
                    from_version=self.parents[version],
                    source="trainer",
                    actor="flywheel-trainer",
                    reason=f"{self.kinds[version]} version (test)",
                    details={
                        "run_id": self.run_id,
                        "ship_id": self.ships[version],
                        "rollouts_consumed": 0,
                        "reward_spec": "v1",
                    },
                )
            )


class MetricsFeed:
    """Publishes `flywheel.version-metrics` buckets the way streams/ does (one record per version per bucket)."""

    def __init__(self, settings: Settings):
        from app.infra.kafka import make_producer

        self.producer = make_producer(settings)
        self.topic = settings.topic("version-metrics")

    def bucket(
        self, version: str, n: int, mean: float, sd: float = 0.5, at: float | None = None
    ) -> None:
        """One bucket of `n` rewards with this mean and sd, starting `at` (default: now)."""
        from app.infra.kafka import dumps

        start = time.time() if at is None else at
        sums = {"n": float(n), "reward_sum": n * mean, "reward_sumsq": n * (sd * sd + mean * mean)}
        rec = {
            "bucket_id": f"{version}/{start!r}/1.0",
            "model_version": version,
            "bucket_start": start,
            "bucket_seconds": 1.0,
            "reward_spec": "v1",
            "partitions": [0],
            "sums": sums,
            "n": n,
            "reward_mean": mean,
            "reward_variance": sd * sd,
        }
        self.producer.send(self.topic, key=version.encode(), value=dumps(rec))
        self.producer.flush()

    def pair(
        self, candidate: str, champion: str, cand_mean: float, champ_mean: float, n: int = 100
    ) -> None:
        self.bucket(candidate, n, cand_mean)
        self.bucket(champion, n, champ_mean)

    def close(self) -> None:
        self.producer.close()


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    return poll(pred, timeout, what, every)


@dataclass
class RolloutStack:
    settings: Settings
    cs: Any  # ControllerSettings
    workdir: Path
    n_replicas: int = 2
    gate_samples: int = (
        8  # prompts the gate samples from both policies (default 32; the CPU is shared)
    )
    api: Any = None
    replicas: list[Any] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)
    versions: Versions | None = None
    feed: MetricsFeed | None = None
    controller: Any = None
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60))
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _webhook_id: str | None = None

    @property
    def model(self) -> str:
        return self.settings.model_name

    @property
    def client(self):
        return self.versions.reg.client

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> RolloutStack:
        from app.api.main import create_app
        from app.api.server import ServerThread
        from app.controller.controller import Controller
        from app.controller.gate import GateConfig
        from app.controller.gate_io import GateRunner
        from app.db.keys import create_key
        from app.db.migrate import upgrade
        from app.db.session import session_scope
        from app.projector.projector import follow

        s = self.settings
        upgrade(s.db_url)
        with session_scope(s.db_url) as session:
            for scope in ("read", "admin"):
                self.keys[scope], _ = create_key(session, [scope], name=f"rollout-test-{scope}")
        self.versions = Versions(s)
        self.feed = MetricsFeed(s)
        self.api = ServerThread(create_app(s)).start()
        self._thread(
            follow, s, None, self._stop, f"projector-{uuid.uuid4().hex[:8]}", 0.5, name="projector"
        )
        self.cs = self.cs.model_copy(update={"webhook_url": f"{self.api.url}/v1/hooks/mlflow"})
        runner = GateRunner(
            s,
            self.client,
            GateConfig(sample_prompts=self.gate_samples, max_tokens=24),
            self.cs.gate_rollouts,
        )
        self.controller = Controller(s, self.cs, self.client, gate=runner.run)
        ready = threading.Event()
        self._thread(self.controller.run, self._stop, ready.set, name="controller")
        assert ready.wait(120), (
            "the controller did not catch up with the deployment log within 120s"
        )
        if self.cs.webhooks_enabled:
            self._webhook_id = next(
                w.webhook_id
                for w in self.client.list_webhooks(max_results=100)
                if w.name == f"flywheel-{self.model}"
            )
        for i in range(self.n_replicas):
            self.replicas.append(self._start_replica(f"replica-{i + 1}"))
        return self

    def _thread(self, target: Callable[..., Any], *args: Any, name: str) -> None:
        th = threading.Thread(target=target, args=args, name=f"{name}-{self.model}", daemon=True)
        th.start()
        self._threads.append(th)

    def _start_replica(self, replica_id: str):
        from app.api.server import ServerThread
        from app.replica.config import ReplicaConfig
        from app.replica.server import create_app
        from tests.conftest import free_port

        port = free_port()
        cfg = ReplicaConfig(
            id=replica_id,
            port=port,
            cache_dir=self.workdir / f"cache-{replica_id}",
            heartbeat_interval=2.0,
            poll_interval=0.2,
            retry_interval=2.0,
            max_tokens=16,
            torch_threads=1,
        )
        srv = ServerThread(create_app(self.settings, cfg), port=port)
        srv.replica_config = cfg
        return srv.start()

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        self._stop.set()
        for th in self._threads:
            th.join(60)
        if self.api is not None:
            self.api.stop()
        if (
            self._webhook_id is not None
        ):  # MLflow webhooks are server-wide: leave none pointing at a dead port
            self.client.delete_webhook(self._webhook_id)
        if self.feed is not None:
            self.feed.close()
        self.http.close()
        alive = [th.name for th in self._threads if th.is_alive()]
        assert not alive, f"threads still running after stop: {alive}"

    # --- replicas ---------------------------------------------------------------------------------
    def complete(
        self, replica: int, session_id: str, prompt: str = "def add(a, b):\n"
    ) -> dict[str, Any]:
        r = self.http.post(
            f"{self.replicas[replica].url}/v1/complete",
            json={"session_id": session_id, "prompt": prompt, "max_tokens": 4, "temperature": 1.0},
        )
        assert r.status_code == 200, f"replica {replica} answered {r.status_code}: {r.text}"
        return r.json()

    def replica_status(self, replica: int) -> dict[str, Any]:
        return self.http.get(f"{self.replicas[replica].url}/v1/status").json()

    def serving(self) -> list[tuple[str | None, str | None, float]]:
        """(champion, candidate, traffic %) each replica serves now."""
        out = []
        for i in range(len(self.replicas)):
            st = self.replica_status(i)
            out.append((st["champion"], st["candidate"], float(st["traffic_pct"])))
        return out

    def wait_serving(
        self,
        champion: str,
        candidate: str | None = None,
        traffic: float | None = None,
        timeout: float = 120.0,
        every: float = 0.1,
    ) -> float:
        """Wait until every replica serves exactly that; returns the seconds it took."""
        t0 = time.monotonic()

        def ok() -> bool:
            return all(
                c == champion and k == candidate and (traffic is None or t == traffic)
                for c, k, t in self.serving()
            )

        wait_for(
            ok,
            timeout,
            f"replicas to serve champion {champion}, candidate {candidate} ({traffic}%); "
            f"now {self.serving()}",
            every=every,
        )
        return time.monotonic() - t0

    # --- status API, operator verbs ------------------------------------------------------------------
    def _get(self, path: str, **params: Any) -> dict[str, Any]:
        r = self.http.get(
            f"{self.api.url}{path}",
            params=params,
            headers={"Authorization": f"Bearer {self.keys['read']}"},
        )
        assert r.status_code == 200, f"GET {path} -> {r.status_code}: {r.text}"
        return r.json()

    def status(self) -> dict[str, Any]:
        """This model's entry of GET /v1/deployments ({} before the first projected event)."""
        return next(
            (
                m
                for m in self._get("/v1/deployments", model=self.model)["models"]
                if m["model"] == self.model
            ),
            {},
        )

    def history(self, **params: Any) -> list[dict[str, Any]]:
        """GET /v1/deployments/history (newest first), every page."""
        out, cursor = [], None
        while True:
            page = self._get(
                "/v1/deployments/history",
                model=self.model,
                limit=500,
                **({"cursor": cursor} if cursor else {}),
                **params,
            )
            out.extend(page["events"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def model_version(self, version: str) -> dict[str, Any]:
        return self._get(f"/v1/models/{version}", model=self.model)

    def verb(self, verb: str, **body: Any) -> httpx.Response:
        return self.http.post(
            f"{self.api.url}/v1/deployments/{verb}",
            json=body,
            headers={"Authorization": f"Bearer {self.keys['admin']}"},
        )

    def aliases(self) -> dict[str, str]:
        return dict(self.client.get_registered_model(self.model).aliases or {})

    def log_events(self, type_: str | None = None) -> list[dict[str, Any]]:
        """Every event on the deployment topic (oldest first), optionally of one type."""
        from app.contracts.deployments import DeploymentLog

        with DeploymentLog(self.settings) as dlog:
            evs = [le.event.model_dump(mode="json") for le in dlog.read(stall_timeout_s=30)]
        return [e for e in evs if type_ is None or e["type"] == type_]

    # --- common steps ---------------------------------------------------------------------------------
    def bootstrap_champion(self, seed: int = 0, timeout: float = 240.0) -> str:
        """Register the base version; the gate passes it and, with no champion yet, it is promoted and served."""
        v = self.versions.add(tiny_policy_state(seed), kind="base")
        self.wait_serving(v, None, timeout=timeout)
        return v
