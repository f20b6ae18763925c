"""Ingest benchmark: events/s and batch latency through `POST /v1/events` vs a raw producer.

Both sides run in the same run against the same real Kafka broker (started here on free
ports, in a temp dir), send the same ~1 KB events in 100-event batches over a few concurrent
connections/threads, and wait for the broker's acknowledgement of every batch:

- api: `flywheel api` in its own process (real uvicorn, migrations, auth, rate limiter,
  validation, acks=all idempotent producer); `--connections` client threads each keep one
  HTTP connection and post pre-encoded batch bodies.
- raw: the kafka-python producer every other role uses (`app.infra.kafka.make_producer`)
  in this process; `--connections` threads each `send()` a batch's 100 records and wait
  for their 100 acknowledgements. This is the floor the API's own work is measured against.

Prints events/s, MB/s, p50/p99 batch latency of each, and the ratio api/raw (target >= 0.5).
Rounds alternate raw and api to even out a shared machine's noise; the best round of each
side is compared.

    .venv/bin/python -m bench.ingest            # 40k events per side per round, 2 rounds
    .venv/bin/python -m bench.ingest --quick    # 5k events, 1 round (smoke)
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from app.infra.procs import stop_groups
from app.settings import Settings
from bench.common import REPO

BATCH = 100
warnings.filterwarnings(
    "ignore", category=DeprecationWarning
)  # kafka-python's key_serializer notice


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_events(n: int, seed: int = 0) -> list[dict]:
    """`n` generation events of about 1 KB of JSON each (64 prompt + 48 completion tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(
            {
                "event_id": uuid.UUID(int=rng.getrandbits(128), version=4).hex,
                "type": "generation",
                "request_id": f"req-{i}-{rng.getrandbits(32):08x}",
                "session_id": f"sess-{i % 97}",
                "ts": "2026-11-21T10:00:00.123Z",
                "model_version": "12",
                "prompt_tokens": [rng.randrange(256) for _ in range(64)],
                "completion_tokens": [rng.randrange(256) for _ in range(48)],
                "logprobs": [-round(rng.random() * 4, 4) for _ in range(48)],
                "temperature": 1.0,
                "tokenizer": "byte-v1",
                "latency_ms": round(rng.random() * 100, 2),
            }
        )
    return out


def cpu_seconds(pid: int | None = None) -> float:
    """User+system CPU seconds of a process (this one by default), from /proc (Linux)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    name: str
    events: int
    bytes: int
    seconds: float
    latencies: list[float]
    cpu_s: float = float("nan")  # CPU spent by the path's own process (API server / raw producer)

    @property
    def eps(self) -> float:
        return self.events / self.seconds

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def _drive(name: str, batches: list, connections: int, work) -> Result:
    """Run `work(worker_state, batch) -> latency` over all batches from `connections` threads."""
    q: queue.Queue = queue.Queue()
    for b in batches:
        q.put(b)
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker():
        local = []
        try:
            while True:
                try:
                    b = q.get_nowait()
                except queue.Empty:
                    break
                local.append(work(b))
        except BaseException as exc:
            errors.append(exc)
        with lock:
            latencies.extend(local)

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    n = sum(len(b[0]) for b in batches)
    size = sum(len(v) for b in batches for _, v in b[0])
    return Result(name, n, size, seconds, latencies)


def run_raw(settings: Settings, batches: list, connections: int) -> Result:
    from app.infra.kafka import make_producer

    producer = make_producer(settings)
    topic = settings.topic("interactions")
    producer.send(topic, b"{}", key="warmup").get(30)

    def work(b) -> float:
        t0 = time.perf_counter()
        futures = [producer.send(topic, value=v, key=k) for k, v in b[0]]
        for f in futures:
            f.get(timeout=30)
        return time.perf_counter() - t0

    try:
        cpu0 = cpu_seconds()
        res = _drive("raw kafka-python producer", batches, connections, work)
        res.cpu_s = cpu_seconds() - cpu0
        return res
    finally:
        producer.close(10)


def run_api(url: str, key: str, batches: list, connections: int, server_pid: int) -> Result:
    local = threading.local()

    def work(b) -> float:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(
                base_url=url,
                timeout=60,
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
        t0 = time.perf_counter()
        resp = client.post("/v1/events", content=b[1])
        lat = time.perf_counter() - t0
        assert resp.status_code == 202, f"API answered {resp.status_code}: {resp.text[:300]}"
        return lat

    cpu0 = cpu_seconds(server_pid)
    res = _drive("API (POST /v1/events)", batches, connections, work)
    res.cpu_s = cpu_seconds(server_pid) - cpu0
    return res


def start_api(
    settings: Settings, port: int, log_path: Path, profile: Path | None = None
) -> subprocess.Popen:
    env = dict(
        os.environ,
        FLYWHEEL_DATA_DIR=str(settings.data_dir),
        FLYWHEEL_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        FLYWHEEL_TOPIC_NAMESPACE=settings.topic_namespace,
        FLYWHEEL_RATE_LIMIT_PER_S="1000000",
        FLYWHEEL_RATE_LIMIT_BURST="1000000",
    )
    prefix = (
        [sys.executable]
        if profile is None
        else [sys.executable, "-m", "pyinstrument", "--renderer", "text", "--outfile", str(profile)]
    )
    proc = subprocess.Popen(
        [*prefix, "-m", "app.cli", "api", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=open(log_path, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"flywheel api exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"flywheel api not ready after 120s; see {log_path}")
        time.sleep(0.3)


def wait_idle(
    pid: int, timeout_s: float = 120.0, window_s: float = 1.0, max_busy: float = 0.05
) -> None:
    """Wait until process `pid` uses < `max_busy` of a core over `window_s`: start-up work in the
    background (other routers warm up, e.g. importing mlflow for the webhook receiver) must not
    be billed to the first measured round."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        c0 = cpu_seconds(pid)
        time.sleep(window_s)
        if cpu_seconds(pid) - c0 < max_busy * window_s:
            return


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--events", type=int, default=40_000, help="events per side per round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternating raw/api rounds; the best of each is compared",
    )
    ap.add_argument(
        "--connections", type=int, default=4, help="concurrent HTTP connections / producer threads"
    )
    ap.add_argument("--quick", action="store_true", help="5k events, 1 round")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="run the API under pyinstrument (pip install pyinstrument) and write its text report here",
    )
    args = ap.parse_args()
    if args.quick:
        args.events, args.rounds = 5_000, 1

    from rich.console import Console
    from rich.table import Table

    from app.db.keys import create_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope
    from app.infra.broker import LocalKafka, ensure_topics

    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-ingest-"))
    broker = LocalKafka(
        home=tmp / "kafka", port=free_port(), controller_port=free_port(), heap="768m"
    )
    api_proc = None
    try:
        with console.status("starting Kafka (real broker, KRaft)..."):
            broker.start(timeout=180)
        settings = Settings(
            data_dir=tmp / "data",
            kafka_bootstrap=broker.bootstrap,
            topic_namespace=f"bench{uuid.uuid4().hex[:8]}",
        )
        settings.data_dir.mkdir(parents=True)
        ensure_topics(settings)
        upgrade(settings.db_url)
        with session_scope(settings.db_url) as session:
            key, _ = create_key(session, ["ingest"], name="bench")
        port = free_port()
        with console.status("starting flywheel api..."):
            api_proc = start_api(settings, port, tmp / "api.log", args.profile)
        url = f"http://127.0.0.1:{port}"

        with console.status(f"encoding {args.events} events..."):
            events = make_events(args.events)
            batches = []
            for i in range(0, len(events), BATCH):
                chunk = events[i : i + BATCH]
                records = [(e["request_id"], orjson.dumps(e)) for e in chunk]
                batches.append((records, orjson.dumps({"events": chunk})))
        mean_size = sum(len(v) for b in batches for _, v in b[0]) / len(events)
        del events, chunk
        gc.collect()
        gc.freeze()  # the load generator's own heap must not cost it full-GC pauses mid-run
        console.print(
            f"{args.events} events of {mean_size:.0f} B mean in {len(batches)} batches of {BATCH}, "
            f"{args.connections} connections, broker {broker.bootstrap}, partitions "
            f"{settings.interactions_partitions}"
        )
        run_api(url, key, batches[:5], 1, api_proc.pid)  # warm-up: connection, producer metadata
        with console.status("waiting for the API process to finish its start-up work..."):
            wait_idle(api_proc.pid)

        best: dict[str, Result] = {}
        for r in range(args.rounds):
            for side in ("raw", "api"):
                with console.status(f"round {r + 1}/{args.rounds}: {side}..."):
                    res = (
                        run_raw(settings, batches, args.connections)
                        if side == "raw"
                        else run_api(url, key, batches, args.connections, api_proc.pid)
                    )
                console.print(
                    f"  round {r + 1} {side}: {res.eps:,.0f} events/s, p50 {res.pct(0.5):.1f} ms, "
                    f"p99 {res.pct(0.99):.1f} ms, {res.cpu_s / res.events * 1e6:.0f} CPU-us/event"
                )
                if side not in best or res.eps > best[side].eps:
                    best[side] = res

        table = Table(title="ingest: 100-event batches of ~1 KB events, acks=all, real broker")
        for col in ("path", "events/s", "MB/s", "p50 batch ms", "p99 batch ms", "CPU-us/event"):
            table.add_column(col, justify="right" if col != "path" else "left")
        for side in ("raw", "api"):
            res = best[side]
            table.add_row(
                res.name,
                f"{res.eps:,.0f}",
                f"{res.bytes / res.seconds / 1e6:.1f}",
                f"{res.pct(0.5):.1f}",
                f"{res.pct(0.99):.1f}",
                f"{res.cpu_s / res.events * 1e6:.0f}",
            )
        console.print(table)
        ratio = best["api"].eps / best["raw"].eps
        verdict = "[green]meets[/green]" if ratio >= 0.5 else "[red]below[/red]"
        console.print(f"ratio api/raw = {ratio:.2f}x ({verdict} the 0.5x target)")
        print(
            f"RESULT raw_eps={best['raw'].eps:.0f} api_eps={best['api'].eps:.0f} ratio={ratio:.3f} "
            f"api_p50_ms={best['api'].pct(0.5):.1f} api_p99_ms={best['api'].pct(0.99):.1f} "
            f"raw_p50_ms={best['raw'].pct(0.5):.1f} raw_p99_ms={best['raw'].pct(0.99):.1f} "
            f"api_cpu_us_per_event={best['api'].cpu_s / best['api'].events * 1e6:.0f} "
            f"raw_cpu_us_per_event={best['raw'].cpu_s / best['raw'].events * 1e6:.0f}"
        )
    finally:
        if api_proc is not None:  # SIGINT: graceful, lets --profile write its report
            stop_groups([api_proc], timeout_s=30, first=signal.SIGINT)
        broker.stop()


if __name__ == "__main__":
    main()
