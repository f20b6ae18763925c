"""Time for 4 local replicas to serve a newly published version, against the floor.

    .venv/bin/python bench/sync_replicas.py            # 3 rounds, built-in policy (default size)
    .venv/bin/python bench/sync_replicas.py --quick    # 1 round
    .venv/bin/python bench/sync_replicas.py --kafka 127.0.0.1:9092 --mlflow http://127.0.0.1:5000  # reuse servers

Set-up (all real, all local): an embedded Kafka broker and an `mlflow server` (started here unless
given), version N registered the way the trainer ships it (pyfunc model + trainer.publish
delta/manifest artifacts), and 4 replicas' sync agents (app/replica/sync.py) running IN THIS
PROCESS, each with its own weight store, verified cache directory, MLflow client and Kafka
consumer (the HTTP front end is not involved in a sync, so it is left out). A round: publish
`promoted` for the next version on `flywheel.deployments`, then poll the 4 stores until every
one serves it; the time is from the publish call to the last swap.

The floor, measured side by side in the same run:
- payload: the bytes each replica must download (manifests + delta), times 4, over the
  loopback bandwidth measured by downloading a large artifact from the same MLflow server
  (best of 3);
- apply: reconstructing the version from the held one with `trainer.publish.apply_chain` on
  in-memory bytes (decode + every hash verified; best of 3), times ceil(4 / CPU cores) because
  4 CPU-bound applies cannot finish faster than that on this machine.
ratio = measured / floor; target <= 2 (issue 5). The successive checkpoints come from real
AdamW steps (lr 1e-5 after a short warm-up) of the built-in policy on next-byte prediction
of this repository's Python sources; `bench/delta.py` calls `run_sync_bench` with its own pair.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, short warm-up")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None, help="versions published one after the other (default 3, quick 1)")
    p.add_argument("--kafka", default=None, help="reuse this Kafka bootstrap instead of starting a broker")
    p.add_argument("--mlflow", default=None, help="reuse this MLflow server URI instead of starting one")
    return p.parse_args()


def trained_states(n: int, warmup: int, lr: float = 1e-5) -> tuple[dict, list[dict]]:
    """(policy config, n successive bf16 serving state dicts, one AdamW step apart)."""
    import torch

    from trainer.policy import build_policy

    policy = build_policy(None)
    policy.set_kernels("default")
    text = b"".join(p.read_bytes() for p in sorted((REPO / "app").rglob("*.py")))
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)

    def step() -> None:
        starts = torch.randint(0, len(text) - 129, (4,), generator=g).tolist()
        seqs = [list(text[s:s + 128]) for s in starts]
        lp = policy.logprobs([s[:1] for s in seqs], [s[1:] for s in seqs])
        opt.zero_grad()
        (-lp.mean()).backward()
        opt.step()

    for _ in range(warmup):
        step()
    for group in opt.param_groups:
        group["lr"] = lr
    states = [policy.serving_state_dict()]
    for _ in range(n - 1):
        step()
        states.append(policy.serving_state_dict())
    cfg = policy.config_dict()
    cfg["kernels"] = "invariant"  # replicas serve with the batch-invariant kernels
    return cfg, states


def _register(reg: Any, run_id: str, version: str, state: dict, parent: dict | None, cfg: dict, manifests: dict) -> None:
    from trainer.publish import publish_version

    pv = str(int(version) - 1) if parent is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        manifests[version] = publish_version(tmp, version, state, parent, pv, manifests.get(pv), anchor_every=8)
        ship = f"bench-{uuid.uuid4().hex[:8]}"
        source = reg.upload_ship(run_id, ship, state, cfg, {"name": "byte-v1", "vocab_size": 259, "eos_id": 257}, [],
                                 {"delta": Path(tmp)})
    got = reg.create_version(source, run_id, ship, {})
    assert str(got) == version, f"MLflow gave version {got}, expected {version}"


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


def _apply_time(fetcher: Any, version: str, held: tuple[str, dict]) -> tuple[float, int]:
    """Best-of-3 seconds of apply_chain on pre-fetched bytes, and the bytes one replica downloads."""
    from trainer.publish import apply_chain

    files: dict[tuple[str, str], bytes] = {}

    def record(v: str, name: str) -> bytes:
        files[(v, name)] = fetcher.fetch_file(v, name)
        return files[(v, name)]

    apply_chain(version, record, held=held)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        apply_chain(version, lambda v, n: files[(v, n)], held=held)
        best = min(best, time.perf_counter() - t0)
    return best, sum(len(b) for b in files.values())


def run_sync_bench(cfg: dict, states: list[dict], settings: Any, replicas: int = 4, console: Any = None) -> dict:
    """Register states[0..], sync `replicas` in-process agents through every version after the first.

    Returns per-round {version, seconds, floor, payload, apply, bandwidth, ratio} and the median.
    Needs a Settings with a reachable Kafka (topics created) and MLflow server.
    """
    from app.deployments.events import DeploymentEvent, DeploymentLog
    from app.replica.config import ReplicaConfig
    from app.replica.fetch import VersionFetcher
    from app.replica.sync import SyncAgent
    from app.replica.weights import WeightCache, WeightStore
    from trainer.registry import Registry

    reg = Registry(settings.mlflow_uri, settings.model_name, experiment=f"bench-{settings.model_name}")
    reg.ensure_model()
    run_id = reg.start_run()
    manifests: dict = {}
    for i, st in enumerate(states):
        _register(reg, run_id, str(i + 1), st, states[i - 1] if i else None, cfg, manifests)
    probe = VersionFetcher(settings)
    full = sum(t.numel() * t.element_size() for t in states[0].values())
    bandwidth = _loopback_bandwidth(reg, run_id, probe, max(16 << 20, 8 * full))
    dlog = DeploymentLog(settings)
    dlog.publish(DeploymentEvent(type="promoted", model=settings.model_name, version="1", source="controller",
                                 actor="bench", traffic_pct=100.0))
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-sync-"))
    agents = []
    for r in range(replicas):
        rc = ReplicaConfig(id=f"bench-{r}", cache_dir=tmp / f"r{r}", poll_interval=0.05, heartbeat_interval=3600,
                           torch_threads=1)
        agents.append(SyncAgent(settings, rc, WeightStore(), WeightCache(rc.cache_dir)))
    for a in agents:
        a.start()

    def all_serve(version: str, timeout_s: float = 300.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all((s := a.store.snapshot().champion) is not None and s.version == version for a in agents):
                return time.perf_counter()
            time.sleep(0.001)
        raise TimeoutError(f"not every replica serves v{version} after {timeout_s}s: "
                           f"{[a.store.snapshot().versions() for a in agents]}")

    all_serve("1")
    rounds = []
    cores = os.cpu_count() or 1
    try:
        for i in range(1, len(states)):
            version = str(i + 1)
            apply_s, per_replica = _apply_time(probe, version, (str(i), states[i - 1]))
            t0 = time.perf_counter()
            dlog.publish(DeploymentEvent(type="promoted", model=settings.model_name, version=version,
                                         source="controller", actor="bench", traffic_pct=100.0))
            seconds = all_serve(version) - t0
            payload = replicas * per_replica
            floor = payload / bandwidth + apply_s * math.ceil(replicas / cores)
            rounds.append(dict(version=version, seconds=seconds, payload=payload, per_replica=per_replica,
                               apply=apply_s, bandwidth=bandwidth, floor=floor, ratio=seconds / floor,
                               full=full, paths=[a.last_result.get("path") for a in agents]))
            if console is not None:
                console.print(f"v{version}: {seconds * 1000:.0f} ms for {replicas} replicas, floor "
                              f"{floor * 1000:.1f} ms -> {seconds / floor:.2f}x")
    finally:
        for a in agents:
            a.stop()
        dlog.close()
        probe.close()
    med = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]
    return {"rounds": rounds, "median": med, "cores": cores}


def print_report(result: dict, console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"sync of {len(result['median']['paths'])} replicas vs the floor ({result['cores']} CPU cores)")
    for col in ("version", "full bf16 KB", "payload/replica KB", "loopback MB/s", "apply ms", "floor ms",
                "measured ms", "ratio", "paths"):
        t.add_column(col, justify="right")
    for r in result["rounds"]:
        t.add_row(r["version"], f"{r['full'] / 1024:.0f}", f"{r['per_replica'] / 1024:.1f}",
                  f"{r['bandwidth'] / 1e6:.0f}", f"{r['apply'] * 1000:.1f}", f"{r['floor'] * 1000:.1f}",
                  f"{r['seconds'] * 1000:.1f}", f"{r['ratio']:.2f}x", ",".join(sorted(set(map(str, r["paths"])))))
    console.print(t)
    med = result["median"]["ratio"]
    console.print(f"sync time / floor (median): {med:.2f}x — target <= 2x: {'MET' if med <= 2 else 'MISSED'}")


@contextlib.contextmanager
def local_stack(kafka: str | None = None, mlflow_uri: str | None = None, console: Any = None) -> Iterator[Any]:
    """Settings on a Kafka broker and an MLflow server: the given ones, or ones started here."""
    import signal
    import subprocess

    from app.infra.kafka import LocalKafka, ensure_topics
    from app.infra.mlflow_server import mlflow_env, mlflow_server_argv, wait_healthy
    from app.settings import Settings
    from tests.conftest import free_port

    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-"))
    broker = mlflow = None
    try:
        if kafka is None:
            broker = LocalKafka(home=work / "kafka", port=free_port(), controller_port=free_port(), heap="512m")
            if console is not None:
                console.print("starting Kafka…")
            broker.start(timeout=180)
            kafka = broker.bootstrap
        if mlflow_uri is None:
            port = free_port()
            mlflow_uri = f"http://127.0.0.1:{port}"
            mlflow = subprocess.Popen(mlflow_server_argv(work / "mlflow", "127.0.0.1", port), env=mlflow_env(),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            if console is not None:
                console.print("starting MLflow…")
            wait_healthy(mlflow_uri, proc=mlflow)
        settings = Settings(data_dir=work / "data", kafka_bootstrap=kafka, mlflow_uri=mlflow_uri,
                            topic_namespace=f"bench{uuid.uuid4().hex[:8]}", model_name=f"bench-{uuid.uuid4().hex[:6]}")
        ensure_topics(settings)
        yield settings
    finally:
        if mlflow is not None:
            os.killpg(mlflow.pid, signal.SIGTERM)
            try:
                mlflow.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(mlflow.pid, signal.SIGKILL)
        if broker is not None:
            broker.stop()


def bench_pair(cfg: dict, states: list[dict], console: Any, replicas: int = 4) -> dict:
    """Start a local stack, sync `replicas` replicas through `states`, print the report (bench/delta.py)."""
    import logging

    logging.getLogger("mlflow").setLevel(logging.ERROR)
    with local_stack(console=console) as settings:
        result = run_sync_bench(cfg, states, settings, replicas=replicas, console=console)
    print_report(result, console)
    return result


def main() -> None:
    args = parse_args()
    import logging

    from rich.console import Console

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    console = Console(width=140)
    rounds = args.rounds or (1 if args.quick else 3)
    with local_stack(args.kafka, args.mlflow, console) as settings:
        console.print("training successive checkpoints…")
        cfg, states = trained_states(rounds + 1, warmup=5 if args.quick else 20)
        result = run_sync_bench(cfg, states, settings, replicas=args.replicas, console=console)
    print_report(result, console)


if __name__ == "__main__":
    main()
