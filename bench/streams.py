"""Benchmark of one streams worker on a real Kafka broker, beside a plain kafka-python loop.

Measures, in the same run and on the same broker:
  1. baseline: a plain kafka-python consume -> produce loop copying the interactions backlog
     to a scratch topic (events/s; no parsing, no state);
  2. bare Faust: a Faust agent (same take_events batching) that only counts the backlog:
     the ceiling Faust's own per-record path sets for any Faust worker on this machine;
  3. worker:   `python -m streams.worker` draining the same backlog (events/s from the worker's
     Prometheus counter: first to last event, start-up excluded) -> ratio worker / baseline;
     once with Faust's stock fetch loop (FLYWHEEL_STREAMS_EAGER_DRAIN=false) and once as
     configured by default (streams/consumer.py: records delivered without per-record tasks);
  4. label latency: live traffic at a steady rate; for each rollout, its record time on the
     rollouts topic minus the moment its window closed (generation record time + window),
     p50/p99. Target: >= 5,000 events/s per worker, p99 <= 2 s.

Each throughput is also given per CPU-second of the process doing the work (the worker's
`process_cpu_seconds_total` over the drain; the baseline's getrusage): on a machine where
many processes compete for the cores, wall-clock rates mostly measure the scheduler, while
events per CPU-second is what one dedicated core would sustain.

    .venv/bin/python -m bench.streams            # ~60k events, starts an embedded broker
    .venv/bin/python -m bench.streams --quick    # ~12k events
    .venv/bin/python -m bench.streams --bootstrap 127.0.0.1:9092

Numbers depend on the machine; on a shared, busy host they are a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from app.infra.procs import stop_groups
from bench.common import REPO

if TYPE_CHECKING:
    from kafka import KafkaProducer

    from app.infra.broker import LocalKafka
    from app.settings import Settings

console = Console(width=130)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_events(n_events: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """Generations with 0-4 feedback events each (keyed by request_id), until n_events."""
    from tests.unit.streams.factories import generation, random_feedback

    rng, out, i = random.Random(seed), [], 0
    while len(out) < n_events:
        rid = f"b{seed}-{i}"
        out.append(
            (
                rid.encode(),
                json.dumps(
                    generation(rid, version=f"m{i % 3}", n_tokens=rng.randint(8, 64))
                ).encode(),
            )
        )
        out += [
            (rid.encode(), json.dumps(random_feedback(rng, rid, f"{rid}-f{j}")).encode())
            for j in range(rng.randint(0, 4))
        ]
        i += 1
    return out[:n_events]


@dataclass(frozen=True)
class Rate:
    """A throughput through the backlog."""

    wall: float  # events/s
    cpu: float  # events per CPU-second of the process doing the work


def baseline(settings, n: int) -> Rate:
    """Plain kafka-python consume -> produce of the backlog."""
    import resource

    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    from app.infra.kafka import make_consumer, make_producer

    dest = f"{settings.topic_namespace}.bench-copy"
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:  # the broker creates no topic on request (app/infra/broker.py)
        admin.create_topics(
            [NewTopic(dest, num_partitions=settings.interactions_partitions, replication_factor=1)]
        )
    finally:
        admin.close()
    cons = make_consumer(
        settings, settings.topic("interactions"), group_id=f"bench-{uuid.uuid4().hex[:6]}"
    )
    prod = make_producer(settings, key_serializer=None)
    seen, t0, cpu0 = 0, None, None
    while seen < n:
        batches = cons.poll(timeout_ms=1000, max_records=2000)
        for recs in batches.values():
            if t0 is None:
                t0, cpu0 = time.perf_counter(), _cpu(resource)
            for r in recs:
                prod.send(dest, key=r.key, value=r.value)
            seen += len(recs)
        cons.commit()
    prod.flush()
    dt, cpu = time.perf_counter() - t0, _cpu(resource) - cpu0
    cons.close()
    prod.close()
    return Rate(n / dt, n / max(cpu, 1e-6))


def _cpu(resource) -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bare_faust_worker() -> None:
    """`--bare-faust-worker`: a Faust agent that only counts records (run as a subprocess by the bench)."""
    import faust
    from faust.worker import Worker
    from prometheus_client import Counter, start_http_server

    from app.settings import get_settings
    from streams.config import StreamsConfig

    settings, cfg = get_settings(), StreamsConfig()
    counted = Counter(
        "flywheel_streams_events_in_total", "records counted by the bare agent", ["outcome"]
    )
    start_http_server(cfg.metrics_port, addr="127.0.0.1")
    app = faust.App(
        f"{settings.topic_namespace}-bare-faust",
        broker=f"kafka://{settings.kafka_bootstrap}",
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        topic_partitions=settings.interactions_partitions,
        datadir=settings.data_dir / f"{settings.topic_namespace}-bare-faust-data",
    )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    source = app.topic(
        settings.topic("interactions"),
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
    )

    @app.agent(source, concurrency=1)
    async def count(stream):
        async for events in stream.take_events(cfg.batch_max_events, within=cfg.batch_within):
            counted.labels("ok").inc(len(events))

    worker = Worker(app, loglevel="WARNING", quiet=True)
    worker.spinner = None
    worker.execute_from_commandline()


def drain(
    cmd: list[str], env: dict[str, str], port: int, n: int, log_path: Path, what: str
) -> tuple[subprocess.Popen, Rate]:
    """Start `cmd` and time it through the backlog: the process, still running, and its rate."""
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    t_first = t_last = None
    deadline = time.monotonic() + 600
    with console.status(f"{what}: draining the backlog...") as status:
        while time.monotonic() < deadline:
            done = metric(port, "flywheel_streams_events_in_total")
            now = time.perf_counter()
            if done > 0 and t_first is None:
                t_first, first_count, cpu0 = now, done, metric(port, "process_cpu_seconds_total")
            if done >= n:
                t_last, cpu1 = now, metric(port, "process_cpu_seconds_total")
                break
            status.update(f"{what}: {int(done)}/{n} events")
            time.sleep(0.05)
    if t_last is None:
        stop(proc)
        raise AssertionError(f"{what} did not drain the backlog; see {log_path}")
    return proc, Rate(
        (n - first_count) / max(t_last - t_first, 1e-6),
        (n - first_count) / max(cpu1 - cpu0, 1e-6),
    )


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        stop_groups([proc], 30)


def metric(port: int, name: str) -> float:
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="small run (~12k backlog events, 5 s live phase)"
    )
    ap.add_argument("--bootstrap", help="use this broker instead of starting an embedded one")
    ap.add_argument("--events", type=int, help="backlog events (default 60000, quick 12000)")
    ap.add_argument("--window", type=float, default=2.0, help="wait window in seconds")
    ap.add_argument("--rate", type=float, default=300.0, help="live phase: generations per second")
    ap.add_argument(
        "--profile",
        metavar="FILE",
        help="run the worker under cProfile (event-loop thread) and write FILE",
    )
    ap.add_argument("--bare-faust-worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


@dataclass(frozen=True)
class Stack:
    """The broker, topics and data directory of a run, and how a worker process is pointed at them."""

    settings: Settings
    bootstrap: str
    data_dir: Path
    window: float

    def env(self, port: int) -> dict[str, str]:
        """A worker process's environment, its metrics on `port`."""
        return dict(
            os.environ,
            FLYWHEEL_KAFKA_BOOTSTRAP=self.bootstrap,
            FLYWHEEL_TOPIC_NAMESPACE=self.settings.topic_namespace,
            FLYWHEEL_INTERACTIONS_PARTITIONS="3",
            FLYWHEEL_ROLLOUTS_PARTITIONS="3",
            FLYWHEEL_DATA_DIR=str(self.data_dir),
            FLYWHEEL_WAIT_WINDOW=str(self.window),
            FLYWHEEL_STREAMS_METRICS_PORT=str(port),
            PYTHONPATH=str(REPO),
        )


@dataclass(frozen=True)
class Rates:
    """The backlog's four throughputs, measured one after the other on the same broker."""

    baseline: Rate
    bare: Rate
    stock: Rate
    worker: Rate


@dataclass(frozen=True)
class Latency:
    """Rollout record time minus window close over the live phase's generations, seconds."""

    rollouts: int
    generations: int
    p50: float
    p99: float

    @classmethod
    def of(cls, lat: list[float], generations: int) -> Latency:
        lat = sorted(lat)
        p50 = lat[len(lat) // 2] if lat else float("nan")
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")
        return cls(len(lat), generations, p50, p99)


def start_broker(tmp: Path) -> LocalKafka:
    from app.infra.broker import LocalKafka

    broker = LocalKafka(
        home=tmp / "kafka", port=free_port(), controller_port=free_port(), heap="768m"
    )
    with console.status("starting an embedded Kafka broker..."):
        broker.start(timeout=120)
    return broker


def bench_settings(bootstrap: str, tmp: Path, window: float) -> Settings:
    from app.settings import Settings

    return Settings(
        kafka_bootstrap=bootstrap,
        topic_namespace=f"bench{uuid.uuid4().hex[:8]}",
        data_dir=tmp,
        interactions_partitions=3,
        rollouts_partitions=3,
        wait_window=window,
    )


def produce_backlog(settings: Settings, n: int) -> KafkaProducer:
    """`n` interaction events on the interactions topic; the producer, kept open for the live phase."""
    from app.infra.kafka import make_producer

    events = make_events(n)
    with console.status(f"producing a backlog of {n} interaction events..."):
        prod = make_producer(settings, key_serializer=None)
        for k, v in events:
            prod.send(settings.topic("interactions"), key=k, value=v)
        prod.flush()
    return prod


@dataclass(frozen=True)
class Drainer:
    """A process timed through the backlog: `python -m *module`, logging to `log_name`."""

    what: str  # its name in the progress line and in the error if it does not drain
    module: tuple[str, ...]
    log_name: str
    env: dict[str, str] = field(default_factory=dict)  # added to Stack.env

    def drain(self, stack: Stack, n: int) -> tuple[subprocess.Popen, Rate]:
        """`drain` on a free metrics port: the process, still running, and its rate."""
        port = free_port()
        return drain(
            [sys.executable, "-m", *self.module],
            stack.env(port) | self.env,
            port,
            n,
            stack.data_dir / self.log_name,
            self.what,
        )

    def drain_and_stop(self, stack: Stack, n: int) -> Rate:
        proc, rate = self.drain(stack, n)
        stop(proc)
        return rate


BARE_FAUST = Drainer("bare Faust agent", ("bench.streams", "--bare-faust-worker"), "bare-faust.log")


def stock_worker(stack: Stack) -> Drainer:
    """The streams worker on Faust's stock fetch loop, under its own consumer group."""
    return Drainer(
        "worker, Faust's stock fetch loop",
        ("streams.worker",),
        "worker-stock.log",
        {
            "FLYWHEEL_STREAMS_EAGER_DRAIN": "false",
            "FLYWHEEL_STREAMS_APP_ID": f"{stack.settings.topic_namespace}-stock",
        },
    )


def configured_worker(profile: str | None) -> Drainer:
    """The streams worker as configured by default, under cProfile when `profile` names a file."""
    env = {"FLYWHEEL_STREAMS_PROFILE": str(Path(profile).resolve())} if profile else {}
    return Drainer("worker", ("streams.worker",), "worker.log", env)


def send_live_traffic(
    settings: Settings, prod: KafkaProducer, rate: float, live_s: float
) -> set[bytes]:
    """Steady traffic at `rate` generations per second (with their feedback) for about `live_s`;
    the generations' keys."""
    live = make_events(int(rate * live_s * 3), seed=1)
    gen_keys = set()
    with console.status(f"live traffic for {live_s:.0f} s..."):
        t0, sent = time.perf_counter(), 0
        per_tick = max(1, int(rate * 3 / 50))
        while sent < len(live):
            for k, v in live[sent : sent + per_tick]:
                prod.send(settings.topic("interactions"), key=k, value=v)
                if b'"generation"' in v:
                    gen_keys.add(k)
            sent += per_tick
            time.sleep(max(0.0, t0 + sent / (rate * 3) - time.perf_counter()))
        prod.flush()
    return gen_keys


def label_latency(settings: Settings, gen_keys: set[bytes], window: float) -> Latency:
    """For each generation of `gen_keys`, its rollout's record time minus its window's close."""
    from app.infra.kafka import make_consumer

    cons = make_consumer(
        settings, settings.topic("interactions"), group_id=None, consumer_timeout_ms=1000
    )
    gen_rt = {}
    for r in cons:
        if r.key in gen_keys and b'"generation"' in r.value:
            gen_rt.setdefault(r.key, r.timestamp / 1000.0)
    cons.close()
    cons = make_consumer(
        settings, settings.topic("rollouts"), group_id=None, consumer_timeout_ms=2000
    )
    lat, t_end = [], time.monotonic() + window + 30
    while len(lat) < len(gen_keys) and time.monotonic() < t_end:
        for r in cons:
            if r.key in gen_rt:
                lat.append(r.timestamp / 1000.0 - (gen_rt[r.key] + window))
        if len(lat) < len(gen_keys):
            time.sleep(0.2)
    cons.close()
    return Latency.of(lat, len(gen_keys))


def print_report(n: int, window: float, rates: Rates, latency: Latency) -> None:
    base, bare, stock, worker = rates.baseline, rates.bare, rates.stock, rates.worker
    console.print(
        f"[bold]streams benchmark[/bold] ({n} backlog events, 3 partitions, window {window:g} s, "
        f"{os.cpu_count()} CPUs; shared machines give lower bounds)"
    )
    console.print(
        f"  {'':40s} {'events/s':>10s} {'ratio':>7s}   {'events/CPU-s':>12s} {'ratio':>7s}"
    )
    for name, r in (
        ("baseline kafka-python consume->produce", base),
        ("bare Faust agent (counts only)", bare),
        ("worker, Faust's stock fetch loop", stock),
        ("streams worker (1 process)", worker),
    ):
        console.print(
            f"  {name:40s} {r.wall:10.0f} {r.wall / base.wall:6.2f}x   {r.cpu:12.0f} {r.cpu / base.cpu:6.2f}x"
        )
    console.print(
        f"  worker / same worker on Faust's stock fetch loop: {worker.wall / stock.wall:.2f}x wall, "
        f"{worker.cpu / stock.cpu:.2f}x per CPU-second"
    )
    console.print(
        f"  worker / bare Faust: {worker.wall / bare.wall:.2f}x wall, {worker.cpu / bare.cpu:.2f}x per CPU-second;  "
        f"target >= 5000 events/s: {'MET' if worker.wall >= 5000 else 'NOT MET'} wall-clock here, "
        f"{'MET' if worker.cpu >= 5000 else 'NOT MET'} per CPU-second (one dedicated core)"
    )
    console.print(
        f"  label latency after window close ({latency.rollouts}/{latency.generations} rollouts): "
        f"p50 {latency.p50:.3f} s  p99 {latency.p99:.3f} s   "
        f"target p99 <= 2 s: {'MET' if latency.p99 <= 2.0 else 'NOT MET'}"
    )


def main() -> None:
    args = parse_args()
    if args.bare_faust_worker:
        return bare_faust_worker()
    n = args.events or (12_000 if args.quick else 60_000)
    live_s = 5.0 if args.quick else 15.0

    from streams.app import ensure_internal_topics

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-streams-"))
    broker = None if args.bootstrap else start_broker(tmp)
    bootstrap = args.bootstrap or broker.bootstrap
    stack = Stack(bench_settings(bootstrap, tmp, args.window), bootstrap, tmp, args.window)
    ensure_internal_topics(stack.settings)
    worker = None
    try:
        prod = produce_backlog(stack.settings, n)
        with console.status("baseline: plain kafka-python consume -> produce loop..."):
            base = baseline(stack.settings, n)
        bare = BARE_FAUST.drain_and_stop(stack, n)
        stock = stock_worker(stack).drain_and_stop(stack, n)
        # the configured worker keeps running: the live phase measures it
        worker, configured = configured_worker(args.profile).drain(stack, n)
        gen_keys = send_live_traffic(stack.settings, prod, args.rate, live_s)
        latency = label_latency(stack.settings, gen_keys, args.window)
    finally:
        stop(worker)
        if broker is not None:
            broker.stop()
    print_report(n, args.window, Rates(base, bare, stock, configured), latency)


if __name__ == "__main__":
    main()
