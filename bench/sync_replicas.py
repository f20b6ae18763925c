"""Time for 4 local replicas to serve a newly published version, against the floor.

    .venv/bin/python -m bench.sync_replicas            # 3 rounds (+1 warm-up round), built-in policy
    .venv/bin/python -m bench.sync_replicas --quick    # 1 round (+1 warm-up), short training warm-up
    .venv/bin/python -m bench.sync_replicas --model hf-dense   # a 63.6M-parameter Qwen2 (bench/hf_models.py)
    .venv/bin/python -m bench.sync_replicas --in-process   # the 4 agents as threads of this process
    .venv/bin/python -m bench.sync_replicas --kafka 127.0.0.1:9092 --mlflow http://127.0.0.1:5000  # reuse servers

Set-up (all real, all local): an embedded Kafka broker and an `mlflow server` (started here unless
given), version N registered the way the trainer ships it (pyfunc model + app.contracts.artifacts
delta/manifest artifacts), and 4 replicas' sync agents (app/replica/sync.py), each with its own
weight store, verified cache directory, MLflow client and Kafka consumer (the HTTP front end is
not involved in a sync, so it is left out). Every version is registered in MLflow before the
rounds. A round: the trainer's announcement of the next version (its delta pushed to
`<ns>.deltas` when `--push`, app/contracts/pushed.py; then `version_registered` with the artifact
hints), then `promoted` on `flywheel.deployments`, then wait until every replica serves it. With
`--announce early` (default) the announcement goes out 0.5 s before the promotion, outside the
measured time, as in production, where the gate runs between the two: a replica has the pushed
delta when the promotion arrives. With `--announce in-round` it goes out inside the measured time,
right before the promotion (ship-to-serve: three acknowledged publishes in a row). The time is
from just before the first publish call of the round to the last replica's swap.

Replicas run as 4 SEPARATE PROCESSES (default), as real replicas do: each child process runs
one SyncAgent and reports every swap (wall-clock `time.time()` taken right after the atomic
swap, the same clock on one host) on its stdout. Earlier versions of this benchmark ran the 4
agents as threads of the benchmark process, so their Python work (HTTP parsing, decode
bookkeeping, policy copies) was serialised by ONE interpreter lock — a cost no deployment of
replicas has, which inflated the measured time (`--in-process` keeps that mode for comparison).
The child processes still share this machine's CPU cores with each other, the Kafka broker and
the MLflow server, which the floor accounts for (4 applies' CPU over the cores).

The floor, measured side by side in the same run:
- payload: the bytes each replica must receive in the measured time (the delta alone when the
  deployment log carries the artifact hints of app/contracts/hints.py, the default, downloaded or
  pushed in-round; manifest + delta + config for a version announced without them; nothing for a
  delta pushed before the round), times 4, over the
  loopback bandwidth measured by downloading a large artifact from the same MLflow server
  (best of 3);
- apply: what 4 verified reconstructions of the version from the held one, on in-memory bytes,
  need at the least on this machine: max(the fastest one alone, 4 x the least CPU time one needs /
  CPU cores). Measured, best of 3 each, on `app.contracts.artifacts.apply_chain` and the replica's one-delta
  path (file SHA-256 + `decode_delta_verified` with every tensor hash checked) at the codec's
  default threads and at 1 thread (the replicas' default); CPU time is the process's, all threads.
  The report also prints the ratio against a looser floor, the fastest wall time x ceil(4 /
  cores), which is lower than the real bound when a multi-threaded apply is the fastest (it
  counts the apply's second core as free).
ratio = measured / floor; target <= 2. The floor leaves out everything else a sync
needs (the Kafka event's delivery, the MLflow look-up of the new version, HTTP round trips,
loading the new version into the replica's policy and checking it, the swap): those are what the
ratio measures.
The successive checkpoints come from real steps of the trainer's optimizer (AdamW with
trainer.config.TrainerConfig's betas, weight decay, clipping and default lr, after a short
warm-up at 1e-3) of the built-in policy on next-byte prediction of Python's standard-library
sources, trained by bench/delta.py's Trainer; `bench/delta.py` calls `run_sync_bench` with its own
chain.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, short warm-up")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="versions published one after the other (default 3, quick 1)",
    )
    p.add_argument(
        "--kafka", default=None, help="reuse this Kafka bootstrap instead of starting a broker"
    )
    p.add_argument(
        "--mlflow", default=None, help="reuse this MLflow server URI instead of starting one"
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the replicas' sync agents as threads of this process (shares one GIL; for comparison)",
    )
    p.add_argument(
        "--hints",
        choices=("on", "off", "alternate"),
        default="on",
        help="version_registered with details.artifacts (on, as the trainer does), without (off: replicas "
        "ask MLflow and read the manifest), or alternate (even versions with, odd without: both "
        "measured side by side in one run)",
    )
    p.add_argument(
        "--push",
        choices=("on", "off", "alternate"),
        default="on",
        help="push each delta to <ns>.deltas before announcing it, as the trainer does (on; replicas "
        "then download nothing), not (off: replicas download it from MLflow), or alternate (even "
        "versions pushed, odd not: both measured side by side in one run)",
    )
    p.add_argument(
        "--announce",
        choices=("early", "in-round"),
        default="early",
        help="when the trainer's announcement of a version (its pushed delta and version_registered) is "
        "published: early (0.5 s before its promotion, outside the measured time: in production the "
        "gate runs in between) or in-round (right before the promotion, inside the measured time: "
        "ship-to-serve, three acknowledged publishes in a row)",
    )
    p.add_argument(
        "--warm-broker",
        type=int,
        default=3000,
        metavar="N",
        help="acknowledged produce -> consume round trips through a scratch topic before the rounds (the "
        "broker's JIT warm-up: a broker in production has long served traffic; a fresh JVM answers "
        "a produce in ~8 ms instead of ~2.5). 0: measure on the cold broker",
    )
    p.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        metavar="N",
        help="rounds run first and reported, but left out of the statistics (default 1: each replica "
        "process's first delta sync runs the codec's code paths for the first time)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate of the steps between versions (default: the trainer's default, TrainerConfig.lr)",
    )
    p.add_argument(
        "--policy",
        type=json.loads,
        default=None,
        help="""fields of the built-in policy's config to change, as JSON (a larger model: '{"d_model": 256}')""",
    )
    p.add_argument(
        "--model",
        choices=["policy", "hf-dense", "hf-moe"],
        default="policy",
        help="the built-in policy, or a 50-150M-parameter HF model of bench/hf_models.py",
    )
    p.add_argument(
        "--child", default=None, help=argparse.SUPPRESS
    )  # internal: run one replica agent (id)
    return p.parse_args()


def trained_states(
    n: int,
    warmup: int,
    lr: float | None = None,
    policy_config: dict | None = None,
    model: str = "policy",
) -> tuple[dict, list[dict]]:
    """(policy config, n successive bf16 serving state dicts, one AdamW step apart).

    bench/delta.py's Trainer (the built-in policy, next-byte NLL, the trainer's optimizer:
    trainer.config.TrainerConfig's AdamW betas, weight decay, gradient clipping) at `lr` (default:
    the trainer's default learning rate) after `warmup` steps at 1e-3, batch 4 x 128 bytes.
    `policy_config`: fields of the built-in policy's config to change (a larger model).
    `model` hf-dense / hf-moe: bench/hf_models.py's HFTrainer instead (already trained and cached:
    no warm-up; batch 4 x 64 tokens)."""
    if model != "policy":
        from bench.hf_models import HFTrainer

        tr, warmup = HFTrainer(model), 0
    else:
        from bench.training import Trainer

        tr = Trainer("policy", batch=4, seq=128, policy_config=policy_config)
        assert tr.kind.startswith("built-in policy"), (
            f"the sync benchmark needs the built-in policy, got {tr.kind}"
        )
    lr = tr.default_lr if lr is None else lr
    for _ in range(warmup):
        tr.step(1e-3)
    states = [tr.serving()]
    for _ in range(n - 1):
        tr.step(lr)
        states.append(tr.serving())
    return {
        **tr.model.config_dict(),
        "kernels": "invariant",
    }, states  # replicas serve with the batch-invariant kernels


def _register(
    reg: Any,
    run_id: str,
    version: str,
    state: dict,
    parent: dict | None,
    cfg: dict,
    manifests: dict,
    hints: bool,
) -> tuple[Any, Any]:
    """Register `version` in MLflow as the trainer does (artifacts, then the model version) and
    return what the trainer then announces: its `version_registered` event (with the artifact hints
    of app/contracts/hints.py unless `hints` is False) and its delta (an app.contracts.pushed.PushedDelta,
    None for the anchor)."""
    from app.contracts.artifacts import publish_version
    from app.contracts.deployments import DeploymentEvent
    from app.contracts.hints import artifact_hints
    from app.contracts.pushed import PushedDelta

    pv = str(int(version) - 1) if parent is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        manifests[version] = m = publish_version(
            tmp, version, state, parent, pv, manifests.get(pv), anchor_every=8
        )
        delta = (
            PushedDelta(
                reg.name,
                version,
                m.parent_version,
                m.delta.file,
                m.delta.sha256,
                (Path(tmp) / m.delta.file).read_bytes(),
            )
            if m.delta
            else None
        )
        ship = f"bench-{uuid.uuid4().hex[:8]}"
        source = reg.upload_ship(
            run_id,
            ship,
            state,
            cfg,
            {"name": "byte-v1", "vocab_size": 259, "eos_id": 257},
            [],
            {"delta": Path(tmp)},
        )
    got = reg.create_version(source, run_id, ship, {})
    assert str(got) == version, f"MLflow gave version {got}, expected {version}"
    details: dict[str, Any] = {
        "run_id": run_id,
        "ship_id": ship,
        "rollouts_consumed": 0,
        "reward_spec": "v1",
    }
    if hints:  # what trainer/shipping.py publishes
        details["artifacts"] = artifact_hints(
            source,
            cfg,
            m.checkpoint_sha256,
            m.parent_version,
            m.delta.model_dump() if m.delta else None,
        )
    return DeploymentEvent(
        event_id=f"vr-{ship}",
        type="version_registered",
        model=reg.name,
        version=version,
        from_version=pv,
        source="trainer",
        actor="bench",
        details=details,
    ), delta


def _announce(settings: Any, dlog: Any, producer: Any, event: Any, delta: Any) -> None:
    """What trainer/shipping.py does after registering: push `delta` to `<ns>.deltas` unless it is
    None (app/contracts/pushed.py; on `producer`, kept open like `dlog`'s), then publish
    `version_registered`."""
    from app.contracts.pushed import publish_delta

    if delta is not None:
        assert publish_delta(settings, delta, producer)
    dlog.publish(event)


def warm_broker(settings: Any, n: int, console: Any = None) -> None:
    """`n` acknowledged small produces to a scratch topic while a consumer reads them (the produce,
    fetch and delayed-fetch paths of the broker get JIT-compiled); prints the median ack time of
    the last 200 every 1000."""
    import threading

    from kafka import KafkaAdminClient, TopicPartition
    from kafka.admin import NewTopic

    from app.infra.kafka import make_consumer, make_producer

    if n <= 0:
        return
    topic = f"{settings.topic_namespace}.bench-warmup"
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    consumer = make_consumer(settings, group_id=None)
    consumer.assign([TopicPartition(topic, 0)])
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            consumer.poll(timeout_ms=50)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    producer = make_producer(settings, profile="immediate")
    acks = []
    try:
        for i in range(n):
            t = time.perf_counter()
            producer.send(topic, key="warm", value=b"x" * 300).get(10)
            acks.append(time.perf_counter() - t)
            if console is not None and (i + 1) % 1000 == 0:
                console.print(
                    f"warming the broker: {i + 1}/{n} round trips, median ack of the last 200 "
                    f"{_median(acks[-200:]) * 1000:.1f} ms"
                )
    finally:
        stop.set()
        reader.join(5)
        producer.close()
        consumer.close()


def _loopback_bandwidth(reg: Any, run_id: str, fetcher: Any, size: int) -> float:
    """Bytes/s of one plain artifact download from the same MLflow server (best of 3)."""
    with tempfile.TemporaryDirectory() as tmp:
        blob = Path(tmp) / "blob.bin"
        blob.write_bytes(os.urandom(size))
        reg.client.log_artifact(run_id, str(blob), "bandwidth")
    uri = f"{reg.client.get_run(run_id).info.artifact_uri}/bandwidth/blob.bin"
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        data = fetcher._get(uri)
        best = min(best, time.perf_counter() - t0)
        assert len(data) == size
    return size / best


def _hinted(mode: str, version: str) -> bool:
    """Whether `version` is announced with artifact hints (`--hints`), or its delta pushed (`--push`)."""
    return mode == "on" or (mode == "alternate" and int(version) % 2 == 0)


def _apply_time(
    fetcher: Any, version: str, held: tuple[str, dict], hints: bool
) -> tuple[float, int, dict]:
    """Best-of-3 seconds of the fastest verified reconstruction on pre-fetched bytes, the bytes
    one replica downloads (the delta alone with artifact hints, else manifest + delta + config)
    and both timings (apply_chain, one delta)."""
    import hashlib

    from app.contracts.artifacts import apply_chain
    from kernels.delta import hash_state_dict
    from kernels.delta.codec import decode_delta_verified
    from kernels.delta.manifest import Manifest

    files: dict[tuple[str, str], bytes] = {}

    def record(v: str, name: str) -> bytes:
        files[(v, name)] = fetcher._get(f"{fetcher._root(v)}/{fetcher.artifacts_dir}/{name}")
        return files[(v, name)]

    apply_chain(version, record, held=held)
    manifest_bytes = files[(version, "manifest.json")]
    m = Manifest.model_validate_json(manifest_bytes)
    delta = files[(version, m.delta.file)]
    held_sha = hash_state_dict(held[1], 2)[1]  # the replica knows it already (verified at load)

    def one_delta(threads: int | None) -> None:
        mm = Manifest.model_validate_json(manifest_bytes)
        assert hashlib.sha256(delta).hexdigest() == mm.delta.sha256
        _, digests, sha = decode_delta_verified(
            held[1], delta, threads=threads, base_checkpoint_sha256=held_sha
        )
        assert digests == {t.name: t.sha256 for t in mm.tensors} and sha == mm.checkpoint_sha256

    best = {"apply_chain": math.inf, "one_delta": math.inf, "cpu": math.inf}
    for _ in range(3):
        c0, t0 = time.process_time(), time.perf_counter()
        apply_chain(version, lambda v, n: files[(v, n)], held=held)
        c1, t1 = time.process_time(), time.perf_counter()
        one_delta(None)  # the codec's default threads
        c2, t2 = time.process_time(), time.perf_counter()
        one_delta(1)  # the replica's default (ReplicaConfig.decode_threads)
        c3, t3 = time.process_time(), time.perf_counter()
        best["apply_chain"] = min(best["apply_chain"], t1 - t0)
        best["one_delta"] = min(best["one_delta"], t2 - t1, t3 - t2)
        best["cpu"] = min(
            best["cpu"], c1 - c0, c2 - c1, c3 - c2
        )  # CPU time of the process, all threads
    config = fetcher._get(f"{fetcher._root(version)}/model/artifacts/config.json")
    return (
        min(best["apply_chain"], best["one_delta"]),
        len(delta) if hints else len(manifest_bytes) + len(delta) + len(config),
        best,
    )


class _ThreadReplicas:
    """`n` sync agents as threads of this process (one GIL; the old harness, for comparison)."""

    def __init__(self, settings: Any, n: int, tmp: Path):
        from app.replica.config import ReplicaConfig
        from app.replica.sync import SyncAgent
        from app.replica.weights import WeightCache, WeightStore

        self.agents = []
        for r in range(n):
            rc = ReplicaConfig(
                id=f"bench-{r}",
                cache_dir=tmp / f"r{r}",
                poll_interval=0.05,
                heartbeat_interval=3600,
                torch_threads=1,
            )
            self.agents.append(SyncAgent(settings, rc, WeightStore(), WeightCache(rc.cache_dir)))
        for a in self.agents:
            a.start()

    def wait_all(self, version: str, timeout_s: float = 300.0) -> tuple[float, list[dict]]:
        """time.time() at which the last replica served `version`, and each one's sync report."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(
                (s := a.store.snapshot().champion) is not None and s.version == version
                for a in self.agents
            ):
                return time.time(), [dict(a.last_result or {}) for a in self.agents]
            time.sleep(0.001)
        raise TimeoutError(
            f"not every replica serves v{version} after {timeout_s}s: "
            f"{[a.store.snapshot().versions() for a in self.agents]}"
        )

    def close(self) -> None:
        for a in self.agents:
            a.stop()


class _ProcessReplicas:
    """`n` sync agents, one per child process (`--child`), reporting swaps on their stdout."""

    def __init__(self, settings: Any, n: int, tmp: Path):
        import json
        import queue
        import subprocess
        import threading

        env = {
            **os.environ,
            "FLYWHEEL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "FLYWHEEL_MLFLOW_URI": settings.mlflow_uri,
            "FLYWHEEL_MODEL_NAME": settings.model_name,
            "FLYWHEEL_TOPIC_NAMESPACE": settings.topic_namespace,
            "FLYWHEEL_DATA_DIR": str(tmp),
        }
        self.swaps: queue.Queue = queue.Queue()
        self.procs = []
        for r in range(n):
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.sync_replicas", "--child", f"bench-{r}"],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self.procs.append(proc)

            def pump(p: subprocess.Popen = proc) -> None:
                for line in p.stdout:
                    if line.startswith("{"):
                        msg = json.loads(line)
                        (self.applies if "applied" in msg else self.swaps).put(msg)

            threading.Thread(target=pump, daemon=True).start()
        self.applies: queue.Queue = queue.Queue()
        self.serving: dict[str, dict] = {}

    def concurrent_apply(self, files: Path, timeout_s: float = 120.0) -> float:
        """Seconds for all replicas to apply the same verified delta AT ONCE, each to the weights it
        serves, from pre-fetched bytes in `files` (manifest.json + delta.fwd): the apply part of the
        floor measured on this machine as loaded now, instead of extrapolated from one apply."""
        for p in self.procs:
            p.stdin.write(f"prep {files}\n")
            p.stdin.flush()
        ready = [self.applies.get(timeout=timeout_s) for _ in self.procs]
        assert all(r["applied"] == "ready" for r in ready), ready
        t0 = time.time()
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        done = [self.applies.get(timeout=timeout_s) for _ in self.procs]
        return max(d["end"] for d in done) - t0

    def wait_all(self, version: str, timeout_s: float = 300.0) -> tuple[float, list[dict]]:
        import queue

        deadline = time.monotonic() + timeout_s
        while not (
            len(self.serving) == len(self.procs)
            and all(r["champion"] == version for r in self.serving.values())
        ):
            dead = [p.returncode for p in self.procs if p.poll() is not None]
            assert not dead, f"a replica process exited ({dead}); see its stderr above"
            try:
                rep = self.swaps.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"not every replica serves v{version} after {timeout_s}s: {self.serving}"
                    )
                continue
            self.serving[rep["replica"]] = rep
        return max(r["t"] for r in self.serving.values()), [
            {
                **r["result"],
                "swapped_at": r["t"],
                "folded_at": r.get("folded_at"),
                "build_cpu_ms": r.get("build_cpu_ms"),
            }
            for r in self.serving.values()
        ]

    def close(self) -> None:
        from app.infra.procs import stop_groups

        stop_groups(self.procs, timeout_s=30)


def child(replica_id: str) -> None:
    """One replica's sync agent (a child process of the benchmark); prints a JSON line per swap."""
    import json
    import logging
    import signal
    import threading

    import torch

    from app.replica.config import ReplicaConfig
    from app.replica.sync import SyncAgent
    from app.replica.weights import WeightCache, WeightStore
    from app.settings import Settings

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    settings = Settings()
    rc = ReplicaConfig(
        id=replica_id,
        cache_dir=settings.data_dir / replica_id,
        poll_interval=0.05,
        heartbeat_interval=3600,
        torch_threads=1,
    )
    torch.set_num_threads(rc.torch_threads)  # what `flywheel replica` does (app/replica/replica.py)
    agent: SyncAgent | None = None

    class ReportingStore(WeightStore):
        def swap(self, **changes: Any) -> Any:
            after = super().swap(**changes)
            t = time.time()  # right after the atomic swap: from now on requests get the new version
            result = dict(agent.last_result or {}) if agent is not None else {}
            print(
                json.dumps(
                    {
                        "replica": replica_id,
                        "t": t,
                        "folded_at": folded["t"],
                        "build_cpu_ms": cpu["ms"],
                        **after.versions(),
                        "result": result,
                    }
                ),
                flush=True,
            )
            return after

    agent = SyncAgent(settings, rc, ReportingStore(), WeightCache(rc.cache_dir))
    folded = {"t": None}
    fold = agent._fold

    def timed_fold(
        batch: dict,
    ) -> None:  # when the deployment event reached this replica (for the stages)
        if batch:
            folded["t"] = time.time()
        fold(batch)

    agent._fold = timed_fold
    build = agent._build
    cpu = {"ms": None}

    def timed_build(
        *a: Any, **kw: Any
    ) -> Any:  # this process's CPU time during the build (all threads)
        c0 = time.process_time()
        try:
            return build(*a, **kw)
        finally:
            cpu["ms"] = (time.process_time() - c0) * 1000

    agent._build = timed_build
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())

    def commands() -> None:  # the concurrent-apply reference (_ProcessReplicas.concurrent_apply)
        import hashlib

        from kernels.delta.codec import decode_delta_verified
        from kernels.delta.manifest import Manifest

        prepared = None
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "prep":
                files = Path(arg)
                prepared = (
                    (files / "manifest.json").read_bytes(),
                    (files / "delta.fwd").read_bytes(),
                    agent.store.snapshot().champion,
                )
                print(json.dumps({"applied": "ready"}), flush=True)
            elif cmd == "go" and prepared is not None:
                t0 = time.time()
                manifest_bytes, blob, held = prepared
                m = Manifest.model_validate_json(manifest_bytes)
                assert hashlib.sha256(blob).hexdigest() == m.delta.sha256
                _, digests, sha = decode_delta_verified(
                    held.state, blob, threads=rc.decode_threads, base_checkpoint_sha256=held.sha256
                )
                assert (
                    digests == {t.name: t.sha256 for t in m.tensors} and sha == m.checkpoint_sha256
                )
                print(json.dumps({"applied": time.time() - t0, "end": time.time()}), flush=True)

    threading.Thread(target=commands, daemon=True).start()
    agent.start()
    done.wait()
    agent.stop()


def _write_files(fetcher: Any, version: str, parent: str, out: Path) -> None:
    """The target's manifest and its delta from `parent`, for the concurrent-apply reference."""
    from kernels.delta.manifest import delta_file

    root = f"{fetcher._root(version)}/{fetcher.artifacts_dir}"
    (out / "manifest.json").write_bytes(fetcher._get(f"{root}/manifest.json"))
    (out / "delta.fwd").write_bytes(fetcher._get(f"{root}/{delta_file(parent)}"))


def _stages(result: dict, t0: float) -> dict[str, float]:
    """A replica's sync stages (ms); `event` = from the publish call to the start of its sync
    (Kafka delivery + folding the log), `kafka` = from the publish call to the poll that returned
    the event, `swap` = from the end of the build to the swap."""
    st = dict(result.get("stages_ms", {}))
    if "swapped_at" in result and "seconds" in result:
        st["event"] = (result["swapped_at"] - result["seconds"] - t0) * 1000
        if result.get("folded_at"):
            st["kafka"] = (result["folded_at"] - t0) * 1000
        if result.get("build_cpu_ms") is not None:
            st["build_cpu"] = result["build_cpu_ms"]
        st["to_swap"] = (result["seconds"] * 1000) - st.get("total", 0.0) - st.get("load", 0.0)
    return st


@dataclass(frozen=True)
class SyncOptions:
    """How `run_sync_bench` syncs the replicas (the CLI's flags of the same names)."""

    replicas: int = 4
    in_process: bool = False  # the agents as threads of this process instead of child processes
    hints: str = "on"  # version_registered with artifact hints: on, off or alternate
    push: str = "on"  # deltas pushed to <ns>.deltas: on, off or alternate
    announce: str = "early"  # announcement before the measured time (early) or in it (in-round)
    warm: int = 3000  # broker warm-up round trips first (`warm_broker`)
    # the first rounds are measured and reported like the others but left out of the statistics
    # (each replica process's first delta sync imports and first-runs the codec's code paths: a
    # one-time cost of a process, not of a sync)
    warmup_rounds: int = 1


@dataclass
class _Publisher:
    """The trainer's and the controller's side of a round: versions announced and promoted."""

    settings: Any
    dlog: Any  # app.contracts.deployments.DeploymentLog
    pusher: Any  # the producer deltas are pushed with

    def announce(self, event: Any, delta: Any) -> None:
        _announce(self.settings, self.dlog, self.pusher, event, delta)

    def promote(self, version: str) -> None:
        from app.contracts.deployments import DeploymentEvent

        self.dlog.publish(
            DeploymentEvent(
                type="promoted",
                model=self.settings.model_name,
                version=version,
                source="controller",
                actor="bench",
                traffic_pct=100.0,
            )
        )


@dataclass
class _SyncRun:
    """What every round of `run_sync_bench` shares."""

    opts: SyncOptions
    pub: _Publisher
    probe: Any  # app.replica.fetch.VersionFetcher: the floor's downloads
    fleet: _ThreadReplicas | _ProcessReplicas
    tmp: Path
    bandwidth: float  # loopback bytes/s
    full: int  # bytes of a full bf16 checkpoint
    cores: int
    console: Any


@dataclass(frozen=True)
class _ApplyFloor:
    """A round's apply measured before it (`_apply_time`), and the concurrent-apply reference."""

    seconds: float  # the fastest verified reconstruction, one replica alone
    per_replica: int  # bytes one replica receives
    applies: dict  # best timings: apply_chain, one_delta, cpu
    concurrent: float | None  # the replica processes applying the same delta at once


@dataclass(frozen=True)
class _Timed:
    """A round as measured: from just before its first publish call to the last replica's swap."""

    t0: float  # time.time() before the first publish call
    seconds: float
    acked_ms: float  # the promotion's publish, until acknowledged
    results: list[dict]  # each replica's sync report


def _measure_apply(run: _SyncRun, i: int, held: dict) -> _ApplyFloor:
    """The apply of version i + 1 on the held version i (state `held`), before its round."""
    version = str(i + 1)
    apply_s, per_replica, applies = _apply_time(
        run.probe, version, (str(i), held), _hinted(run.opts.hints, version)
    )
    concurrent = None
    if isinstance(run.fleet, _ProcessReplicas):
        files = run.tmp / f"files-v{version}"
        files.mkdir()
        _write_files(run.probe, version, str(i), files)
        concurrent = run.fleet.concurrent_apply(files)
    return _ApplyFloor(apply_s, per_replica, applies, concurrent)


def _publish_and_wait(run: _SyncRun, version: str, event: Any, delta: Any) -> _Timed:
    """Announce `version` (`event`, then its pushed `delta` unless None) and promote it; wait until
    every replica serves it."""
    # early: the trainer announced it before; the gate ran; now it is promoted
    if run.opts.announce == "early":
        run.pub.announce(event, delta)
    time.sleep(0.5)  # let the replicas' post-swap work of the previous round settle
    t0 = time.time()
    # in-round: ship-to-serve, announced and promoted at once, all measured
    if run.opts.announce == "in-round":
        run.pub.announce(event, delta)
    t1 = time.time()
    run.pub.promote(version)
    acked = (time.time() - t1) * 1000
    t_last, results = run.fleet.wait_all(version)
    return _Timed(t0, t_last - t0, acked, results)


def _round_result(run: _SyncRun, i: int, apply: _ApplyFloor, timed: _Timed) -> dict:
    """Round i (version i + 1) against its floor."""
    version, replicas, seconds = str(i + 1), run.opts.replicas, timed.seconds
    pushed = _hinted(run.opts.push, version)
    # a delta pushed before the round reached the replicas outside the measured time: its
    # bytes are not counted in the floor either (the stricter comparison)
    payload = 0 if (pushed and run.opts.announce == "early") else replicas * apply.per_replica
    # 4 applies on `cores` cores finish no sooner than one apply alone (its fastest wall time,
    # at any thread count) nor sooner than their CPU work spread over every core: 4 x the
    # least CPU time one apply needs / cores. `ratio_old` is against the looser floor, the
    # fastest wall time x ceil(4 / cores), which understates the floor whenever a
    # multi-threaded apply is the fastest (it counts its extra cores as free).
    apply_floor = max(apply.seconds, replicas * apply.applies["cpu"] / run.cores)
    floor = payload / run.bandwidth + apply_floor
    floor_old = payload / run.bandwidth + apply.seconds * math.ceil(replicas / run.cores)
    floor_c = payload / run.bandwidth + apply.concurrent if apply.concurrent is not None else None
    return {
        "version": version,
        "seconds": seconds,
        "payload": payload,
        "per_replica": apply.per_replica,
        "apply": apply.seconds,
        "applies": apply.applies,
        "bandwidth": run.bandwidth,
        "floor": floor,
        "ratio": seconds / floor,
        "apply_floor": apply_floor,
        "ratio_old": seconds / floor_old,
        "full": run.full,
        "paths": [r.get("path") for r in timed.results],
        "concurrent": apply.concurrent,
        "floor_c": floor_c,
        "ratio_c": seconds / floor_c if floor_c else None,
        "stages": [{**_stages(r, timed.t0), "publish_ack": timed.acked_ms} for r in timed.results],
        "hints": _hinted(run.opts.hints, version),
        "pushed": pushed,
        "chains": [r.get("chain") for r in timed.results],
        "warmup": i <= run.opts.warmup_rounds,
    }


def _sync_round(run: _SyncRun, i: int, held: dict, announcement: tuple[Any, Any]) -> dict:
    """Publish version i + 1 (held: version i's state) and time the replicas' sync to it."""
    version = str(i + 1)
    apply = _measure_apply(run, i, held)
    event, delta = announcement
    timed = _publish_and_wait(
        run, version, event, delta if _hinted(run.opts.push, version) else None
    )
    result = _round_result(run, i, apply, timed)
    if run.console is not None:
        run.console.print(
            f"v{version}: {result['seconds'] * 1000:.0f} ms for {run.opts.replicas} replicas, floor "
            f"{result['floor'] * 1000:.1f} ms -> {result['ratio']:.2f}x"
            + (" (warm-up round, not counted)" if result["warmup"] else "")
        )
    return result


def run_sync_bench(
    cfg: dict,
    states: list[dict],
    settings: Any,
    opts: SyncOptions | None = None,
    console: Any = None,
) -> dict:
    """Register states[0..], sync `opts.replicas` agents (separate processes unless
    `opts.in_process`) through every version after the first.

    Returns per-round {version, seconds, floor, payload, apply, bandwidth, ratio} and the median.
    Needs a Settings with a reachable Kafka (topics created) and MLflow server.
    """
    from app.contracts.deployments import DeploymentLog
    from app.infra.kafka import make_producer
    from app.replica.fetch import VersionFetcher
    from trainer.registry import Registry

    opts = opts or SyncOptions()
    assert len(states) > opts.warmup_rounds + 1, (
        f"{len(states)} versions leave no measured round after {opts.warmup_rounds} warm-up"
    )
    if opts.warm:
        warm_broker(settings, opts.warm, console)
    reg = Registry(
        settings.mlflow_uri, settings.model_name, experiment=f"bench-{settings.model_name}"
    )
    reg.ensure_model()
    run_id = reg.start_run()
    pub = _Publisher(
        settings, DeploymentLog(settings), make_producer(settings, profile="immediate")
    )
    manifests: dict = {}
    announcements = [
        _register(
            reg,
            run_id,
            str(i + 1),
            st,
            states[i - 1] if i else None,
            cfg,
            manifests,
            _hinted(opts.hints, str(i + 1)),
        )
        for i, st in enumerate(states)
    ]
    pub.announce(announcements[0][0], None)  # v1: the anchor
    probe = VersionFetcher(settings)
    full = sum(t.numel() * t.element_size() for t in states[0].values())
    bandwidth = _loopback_bandwidth(reg, run_id, probe, max(16 << 20, 8 * full))
    pub.promote("1")
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-sync-"))
    fleet = (_ThreadReplicas if opts.in_process else _ProcessReplicas)(settings, opts.replicas, tmp)
    run = _SyncRun(opts, pub, probe, fleet, tmp, bandwidth, full, os.cpu_count() or 1, console)
    rounds = []
    try:
        fleet.wait_all("1")
        for i in range(1, len(states)):
            rounds.append(_sync_round(run, i, states[i - 1], announcements[i]))
    finally:
        fleet.close()
        pub.dlog.close()
        pub.pusher.close()
        probe.close()
    warmups, rounds = [r for r in rounds if r["warmup"]], [r for r in rounds if not r["warmup"]]
    med = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]
    return {
        "rounds": rounds,
        "warmup_rounds": warmups,
        "median": med,
        "cores": run.cores,
        "mode": "threads" if opts.in_process else "processes",
        "hints": opts.hints,
        "push": opts.push,
        "announce": opts.announce,
    }


def _median(xs: list[float]) -> float:
    """The upper median (the value the run reports as its median round)."""
    return sorted(xs)[len(xs) // 2]


def _stage_medians(rounds: list[dict]) -> str:
    """'stage median, …' (ms) over every replica of `rounds`."""
    stages: dict[str, list[float]] = {}
    for r in rounds:
        for st in r["stages"]:
            for k, v in st.items():
                stages.setdefault(k, []).append(v)
    return ", ".join(f"{k} {_median(v):.1f}" for k, v in stages.items())


def print_report(result: dict, console: Any) -> None:
    from rich.table import Table

    t = Table(
        title=f"sync of {len(result['median']['paths'])} replicas ({result['mode']}, artifact hints "
        f"{result.get('hints', 'on')}, pushed deltas {result.get('push', 'off')}, announced "
        f"{result.get('announce', 'early')}) vs the floor "
        f"({result['cores']} CPU cores)"
    )
    for col in (
        "version",
        "hints",
        "push",
        "full bf16 KB",
        "payload/replica KB",
        "loopback MB/s",
        "apply ms (chain / 1 delta)",
        "apply CPU ms",
        "apply floor ms",
        "floor ms",
        "measured ms",
        "ratio",
        "paths",
    ):
        t.add_column(col, justify="right")
    for r in result["rounds"]:
        a = r["applies"]
        used = sum(
            any(str(c).startswith("kafka:") for c in (ch or [])) for ch in r.get("chains", [])
        )
        t.add_row(
            r["version"],
            "on" if r.get("hints", True) else "off",
            f"{used}/{len(r['paths'])} used" if r.get("pushed") else "off",
            f"{r['full'] / 1024:.0f}",
            f"{r['per_replica'] / 1024:.1f}",
            f"{r['bandwidth'] / 1e6:.0f}",
            f"{r['apply'] * 1000:.1f} ({a['apply_chain'] * 1000:.1f} / {a['one_delta'] * 1000:.1f})",
            f"{a['cpu'] * 1000:.1f}",
            f"{r['apply_floor'] * 1000:.1f}",
            f"{r['floor'] * 1000:.1f}",
            f"{r['seconds'] * 1000:.1f}",
            f"{r['ratio']:.2f}x",
            ",".join(sorted(set(map(str, r["paths"])))),
        )
    console.print(t)
    stages = _stage_medians(result["rounds"])
    if stages:
        console.print("per-replica sync stages, median ms: " + stages)
    conc = [r["ratio_c"] for r in result["rounds"] if r.get("ratio_c")]
    if conc:
        console.print(
            "reference (not the target's floor): the 4 replica processes applying the same delta at once, "
            "measured just before each round: "
            + ", ".join(
                f"v{r['version']} {r['concurrent'] * 1000:.0f} ms (measured / (payload + that) = "
                f"{r['ratio_c']:.2f}x)"
                for r in result["rounds"]
            )
            + f"; median {_median(conc):.2f}x"
        )
    for key, what in (("hints", "hints"), ("push", "pushed")):
        if result.get(key) != "alternate":
            continue
        for on in (True, False):
            mode = [r for r in result["rounds"] if r.get(what, True) == on]
            rs = sorted(r["ratio"] for r in mode)
            if rs:
                console.print(
                    f"rounds with {key} {'on ' if on else 'off'}: median {_median(rs):.2f}x "
                    f"(min {rs[0]:.2f}x, max {rs[-1]:.2f}x over {len(rs)}; measured median "
                    f"{_median([r['seconds'] for r in mode]) * 1000:.0f} ms); stage medians ms: "
                    + _stage_medians(mode)
                )
    console.print(
        f"with the looser floor (fastest apply wall time x ceil(replicas / cores), "
        f"which counts a multi-threaded apply's extra cores as free): median "
        f"{_median([r['ratio_old'] for r in result['rounds']]):.2f}x"
    )
    for r in result.get("warmup_rounds", []):
        console.print(
            f"warm-up round (not counted): v{r['version']} {r['seconds'] * 1000:.0f} ms, "
            f"{r['ratio']:.2f}x the floor"
        )
    ratios = sorted(r["ratio"] for r in result["rounds"])
    med = result["median"]["ratio"]
    console.print(
        f"sync time / floor: median {med:.2f}x (min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x over "
        f"{len(ratios)} rounds) — target <= 2x: {'MET' if med <= 2 else 'MISSED'}"
    )


@contextlib.contextmanager
def local_stack(
    kafka: str | None = None, mlflow_uri: str | None = None, console: Any = None
) -> Iterator[Any]:
    """Settings on a Kafka broker and an MLflow server: the given ones, or ones started here."""
    from app.infra.broker import ensure_topics
    from app.settings import Settings
    from bench.common import local_services

    with local_services(kafka, mlflow_uri, console) as (bootstrap, uri, work):
        settings = Settings(
            data_dir=work / "data",
            kafka_bootstrap=bootstrap,
            mlflow_uri=uri,
            topic_namespace=f"bench{uuid.uuid4().hex[:8]}",
            model_name=f"bench-{uuid.uuid4().hex[:6]}",
        )
        ensure_topics(settings)
        yield settings


def bench_pair(cfg: dict, states: list[dict], console: Any, replicas: int = 4) -> dict:
    """Start a local stack, sync `replicas` replica processes through `states`, print the report
    (bench/delta.py)."""
    import logging

    logging.getLogger("mlflow").setLevel(logging.ERROR)
    with local_stack(console=console) as settings:
        result = run_sync_bench(
            cfg, states, settings, SyncOptions(replicas=replicas), console=console
        )
    print_report(result, console)
    return result


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args.child)
    import logging

    from rich.console import Console

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    console = Console(width=140)
    rounds = (args.rounds or (1 if args.quick else 3)) + args.warmup_rounds
    with local_stack(args.kafka, args.mlflow, console) as settings:
        console.print("training successive checkpoints…")
        cfg, states = trained_states(
            rounds + 1,
            warmup=5 if args.quick else 20,
            lr=args.lr,
            policy_config=args.policy,
            model=args.model,
        )
        opts = SyncOptions(
            replicas=args.replicas,
            in_process=args.in_process,
            hints=args.hints,
            push=args.push,
            announce=args.announce,
            warm=args.warm_broker,
            warmup_rounds=args.warmup_rounds,
        )
        result = run_sync_bench(cfg, states, settings, opts, console=console)
    print_report(result, console)


if __name__ == "__main__":
    main()
