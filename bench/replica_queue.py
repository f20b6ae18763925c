"""How long a one-token request waits behind a burst of maximal requests on one replica.

    .venv/bin/python -m bench.replica_queue                       # tiny policy, 16 maximal requests, 3 rounds
    .venv/bin/python -m bench.replica_queue --policy default      # the built-in policy (context 256)
    .venv/bin/python -m bench.replica_queue --kafka 127.0.0.1:9092 --maximal 16 --rounds 3

Set-up (all real, all local): an embedded Kafka broker (unless `--kafka`), one replica (uvicorn in
its own process, no sync agent) serving a freshly initialised policy from its verified cache,
with the serving limits of `ReplicaConfig` (settings the code under test does not have are left
out, so the same script measures older code). A round: `--maximal` clients each send a maximal
request (`n = max_n`, `max_tokens` = the model's context - 1) at once; 0.3 s later (the first is
generating, the others are queued or refused) a one-token request is sent and timed. Printed per
round: the one-token request's latency and status, the maximal requests' statuses (200 or 503)
and their slowest latency, and the replica's queue-wait histogram when it has one. For reference,
one maximal request alone and one one-token request alone are timed first.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import REPO

TINY = {
    "type": "moe-byte",
    "d_model": 16,
    "n_layers": 1,
    "n_heads": 2,
    "d_ff": 16,
    "n_experts": 2,
    "top_k": 1,
    "max_context": 64,
}


@contextlib.contextmanager
def kafka_settings(bootstrap: str | None, work: Path) -> Iterator[Any]:
    """Settings on the given Kafka broker, or on one started here (stopped on exit)."""
    from app.infra.broker import LocalKafka, ensure_topics
    from app.settings import Settings
    from tests.conftest import free_port

    broker = None
    try:
        if bootstrap is None:
            broker = LocalKafka(
                home=work / "kafka", port=free_port(), controller_port=free_port(), heap="512m"
            )
            print("starting Kafka…", flush=True)
            broker.start(timeout=180)
            bootstrap = broker.bootstrap
        settings = Settings(
            data_dir=work / "data",
            kafka_bootstrap=bootstrap,
            topic_namespace=f"benchq{uuid.uuid4().hex[:8]}",
        )
        ensure_topics(settings)
        yield settings
    finally:
        if broker is not None:
            broker.stop()


def serve_child(spec_json: str) -> None:
    """The replica process: seed its cache with a fresh policy, then serve with uvicorn until killed."""
    import json

    import uvicorn

    from app.replica.config import ReplicaConfig
    from app.replica.server import create_app
    from app.replica.weights import WeightCache, load_verified
    from app.settings import Settings
    from kernels.delta.hashing import checkpoint_sha256
    from policy import build_policy

    spec = json.loads(spec_json)
    policy_cfg, cache_dir = spec["policy"], Path(spec["cache_dir"])
    state = build_policy(policy_cfg).serving_state_dict()
    cache = WeightCache(cache_dir)
    cache.put(load_verified("1", state, policy_cfg, checkpoint_sha256(state)))
    cache.set_serving(cache.restore())
    settings = Settings(**spec["settings"])
    cfg = ReplicaConfig(id="bench-queue", cache_dir=cache_dir, port=spec["port"], **spec["limits"])
    uvicorn.run(
        create_app(settings, cfg, start_sync=False),
        host="127.0.0.1",
        port=spec["port"],
        log_level="warning",
        access_log=False,
    )


@contextlib.contextmanager
def replica_process(settings: Any, policy_cfg: dict, work: Path, limits: dict) -> Iterator[str]:
    """A replica in its own process (its generation thread must not share this process's GIL with
    the benchmark's client threads); yields its URL once it is ready."""
    import json
    import os
    import subprocess

    import httpx

    from app.replica.config import ReplicaConfig
    from tests.conftest import free_port

    known = {k: v for k, v in limits.items() if k in ReplicaConfig.model_fields}
    print(
        f"replica limits: {known} (ignored, unknown to this code: {sorted(set(limits) - set(known)) or 'none'})"
    )
    port = free_port()
    spec = {
        "policy": policy_cfg,
        "cache_dir": str(work / "cache"),
        "port": port,
        "limits": known,
        "settings": {
            "data_dir": str(work / "data"),
            "kafka_bootstrap": settings.kafka_bootstrap,
            "topic_namespace": settings.topic_namespace,
        },
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.replica_queue", "--serve-child", json.dumps(spec)],
        cwd=REPO,
        env=os.environ.copy(),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the replica process exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the replica did not become ready within 120 s"
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def post(url: str, body: dict) -> tuple[int, float]:
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/complete", json=body, timeout=600)
    return r.status_code, time.perf_counter() - t0


def one_round(url: str, maximal: dict, one_token: dict, k: int) -> dict:
    results: list[tuple[int, float]] = []
    lock = threading.Lock()

    def go() -> None:
        got = post(url, maximal)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=go, daemon=True) for _ in range(k)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    status, seconds = post(url, one_token)
    for t in threads:
        t.join(900)
    ok = [s for c, s in results if c == 200]
    return {
        "one_token_s": seconds,
        "one_token_status": status,
        "maximal_ok": len(ok),
        "maximal_refused": sum(1 for c, _ in results if c == 503),
        "maximal_other": sum(1 for c, _ in results if c not in (200, 503)),
        "maximal_slowest_s": max(ok) if ok else None,
        "refused_slowest_s": max((s for c, s in results if c == 503), default=None),
    }


def queue_wait(url: str) -> str:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [
        ln
        for ln in text.splitlines()
        if ln.startswith("flywheel_replica_queue_wait_seconds_")
        and ("_sum" in ln or "_count" in ln)
    ]
    return "; ".join(lines) or "(no queue metrics in this code)"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policy", choices=("tiny", "default"), default="tiny")
    ap.add_argument("--maximal", type=int, default=16, help="maximal requests per burst")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--kafka", default=None, help="bootstrap of a running broker (default: start one)"
    )
    ap.add_argument("--max-n", type=int, default=8)
    ap.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="FLYWHEEL_REPLICA_MAX_QUEUED (default: the setting's)",
    )
    ap.add_argument(
        "--max-queued-cost", type=int, default=None, help="FLYWHEEL_REPLICA_MAX_QUEUED_COST"
    )
    ap.add_argument("--serve-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_child is not None:
        serve_child(args.serve_child)
        return

    import logging

    logging.basicConfig(level=logging.WARNING)
    import app.replica.server as server_module

    print(f"code under test: {Path(server_module.__file__).resolve().parents[2]}")
    policy_cfg = TINY if args.policy == "tiny" else {"type": "moe-byte"}
    ctx = policy_cfg.get("max_context", 256)
    limits: dict[str, Any] = {"max_n": args.max_n, "max_tokens": 256}
    if args.max_queued is not None:
        limits["max_queued"] = args.max_queued
    if args.max_queued_cost is not None:
        limits["max_queued_cost"] = args.max_queued_cost
    maximal = {
        "session_id": "bench",
        "prompt": "def f(x):",
        "max_tokens": min(256, ctx - 1),
        "n": args.max_n,
        "temperature": 1.0,
    }
    one_token = {"session_id": "bench", "prompt": "def f(x):", "max_tokens": 1, "n": 1}

    with (
        tempfile.TemporaryDirectory(prefix="flywheel-bench-queue-") as tmp,
        kafka_settings(args.kafka, Path(tmp)) as settings,
    ):
        with replica_process(settings, policy_cfg, Path(tmp), limits) as url:
            for _ in range(2):  # warm-up: topic metadata, producer connection, first model call
                post(url, one_token)
            alone_max = [post(url, maximal)[1] for _ in range(2)]
            alone_one = [post(url, one_token)[1] for _ in range(3)]
            print(
                f"policy {args.policy}: maximal request (n={args.max_n}, max_tokens={maximal['max_tokens']}) alone "
                f"{statistics.median(alone_max):.3f} s; one-token request alone {statistics.median(alone_one):.3f} s"
            )
            rounds = []
            for i in range(args.rounds):
                r = one_round(url, maximal, one_token, args.maximal)
                rounds.append(r)
                print(
                    f"round {i + 1}: one-token request {r['one_token_s']:.3f} s (HTTP {r['one_token_status']}); "
                    f"{args.maximal} maximal: {r['maximal_ok']} answered 200 (slowest "
                    f"{r['maximal_slowest_s'] or 0:.2f} s), {r['maximal_refused']} refused with 503 (slowest "
                    f"refusal {r['refused_slowest_s'] or 0:.3f} s), {r['maximal_other']} other",
                    flush=True,
                )
            waits = [r["one_token_s"] for r in rounds]
            print(
                f"one-token request behind {args.maximal} maximal ones: median {statistics.median(waits):.3f} s "
                f"(min {min(waits):.3f}, max {max(waits):.3f}) over {len(waits)} rounds"
            )
            print(f"queue wait metric: {queue_wait(url)}")


if __name__ == "__main__":
    main()
