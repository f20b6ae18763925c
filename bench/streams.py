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
from pathlib import Path

from rich.console import Console

from app.infra.procs import stop_groups
from bench.common import REPO

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


def baseline(settings, n: int) -> tuple[float, float]:
    """Plain kafka-python consume -> produce of the backlog; (events/s, events per CPU-second)."""
    import resource

    from app.contracts.kafka import make_consumer, make_producer

    dest = f"{settings.topic_namespace}.bench-copy"
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
    return n / dt, n / max(cpu, 1e-6)


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
) -> tuple[subprocess.Popen, float, float]:
    """Start `cmd` and time it through the backlog: (process, events/s, events per CPU-second)."""
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
    return (
        proc,
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


def main() -> None:
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
    args = ap.parse_args()
    if args.bare_faust_worker:
        return bare_faust_worker()
    n = args.events or (12_000 if args.quick else 60_000)
    live_s = 5.0 if args.quick else 15.0

    from app.contracts.kafka import make_consumer, make_producer
    from app.infra.kafka import LocalKafka
    from app.settings import Settings
    from streams.app import ensure_internal_topics

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-streams-"))
    broker = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        broker = LocalKafka(
            home=tmp / "kafka", port=free_port(), controller_port=free_port(), heap="768m"
        )
        with console.status("starting an embedded Kafka broker..."):
            broker.start(timeout=120)
        bootstrap = broker.bootstrap
    settings = Settings(
        kafka_bootstrap=bootstrap,
        topic_namespace=f"bench{uuid.uuid4().hex[:8]}",
        data_dir=tmp,
        interactions_partitions=3,
        rollouts_partitions=3,
        wait_window=args.window,
    )
    ensure_internal_topics(settings)
    worker = None
    try:
        events = make_events(n)
        with console.status(f"producing a backlog of {n} interaction events..."):
            prod = make_producer(settings, key_serializer=None)
            for k, v in events:
                prod.send(settings.topic("interactions"), key=k, value=v)
            prod.flush()
        with console.status("baseline: plain kafka-python consume -> produce loop..."):
            base_rate, base_cpu = baseline(settings, n)

        def env_for(port: int) -> dict[str, str]:
            return dict(
                os.environ,
                FLYWHEEL_KAFKA_BOOTSTRAP=bootstrap,
                FLYWHEEL_TOPIC_NAMESPACE=settings.topic_namespace,
                FLYWHEEL_INTERACTIONS_PARTITIONS="3",
                FLYWHEEL_ROLLOUTS_PARTITIONS="3",
                FLYWHEEL_DATA_DIR=str(tmp),
                FLYWHEEL_WAIT_WINDOW=str(args.window),
                FLYWHEEL_STREAMS_METRICS_PORT=str(port),
                PYTHONPATH=str(REPO),
            )

        port = free_port()
        bare, bare_rate, bare_cpu = drain(
            [sys.executable, "-m", "bench.streams", "--bare-faust-worker"],
            env_for(port),
            port,
            n,
            tmp / "bare-faust.log",
            "bare Faust agent",
        )
        stop(bare)
        port = free_port()
        stock, stock_rate, stock_cpu = drain(
            [sys.executable, "-m", "streams.worker"],
            env_for(port)
            | {
                "FLYWHEEL_STREAMS_EAGER_DRAIN": "false",
                "FLYWHEEL_STREAMS_APP_ID": f"{settings.topic_namespace}-stock",
            },
            port,
            n,
            tmp / "worker-stock.log",
            "worker, Faust's stock fetch loop",
        )
        stop(stock)
        port = free_port()
        worker_env = env_for(port) | (
            {"FLYWHEEL_STREAMS_PROFILE": str(Path(args.profile).resolve())} if args.profile else {}
        )
        worker, worker_rate, worker_cpu = drain(
            [sys.executable, "-m", "streams.worker"],
            worker_env,
            port,
            n,
            tmp / "worker.log",
            "worker",
        )

        # live phase: steady traffic, then measure close -> rollout latency
        live = make_events(int(args.rate * live_s * 3), seed=1)
        gen_keys = set()
        with console.status(f"live traffic for {live_s:.0f} s..."):
            t0, sent = time.perf_counter(), 0
            per_tick = max(1, int(args.rate * 3 / 50))
            while sent < len(live):
                for k, v in live[sent : sent + per_tick]:
                    prod.send(settings.topic("interactions"), key=k, value=v)
                    if b'"generation"' in v:
                        gen_keys.add(k)
                sent += per_tick
                time.sleep(max(0.0, t0 + sent / (args.rate * 3) - time.perf_counter()))
            prod.flush()
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
        lat, t_end = [], time.monotonic() + args.window + 30
        while len(lat) < len(gen_keys) and time.monotonic() < t_end:
            for r in cons:
                if r.key in gen_rt:
                    lat.append(r.timestamp / 1000.0 - (gen_rt[r.key] + args.window))
            if len(lat) < len(gen_keys):
                time.sleep(0.2)
        cons.close()
        lat.sort()
        p50 = lat[len(lat) // 2] if lat else float("nan")
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")
    finally:
        stop(worker)
        if broker is not None:
            broker.stop()

    console.print(
        f"[bold]streams benchmark[/bold] ({n} backlog events, 3 partitions, window {args.window:g} s, "
        f"{os.cpu_count()} CPUs; shared machines give lower bounds)"
    )
    console.print(
        f"  {'':40s} {'events/s':>10s} {'ratio':>7s}   {'events/CPU-s':>12s} {'ratio':>7s}"
    )
    for name, rate, cpu in (
        ("baseline kafka-python consume->produce", base_rate, base_cpu),
        ("bare Faust agent (counts only)", bare_rate, bare_cpu),
        ("worker, Faust's stock fetch loop", stock_rate, stock_cpu),
        ("streams worker (1 process)", worker_rate, worker_cpu),
    ):
        console.print(
            f"  {name:40s} {rate:10.0f} {rate / base_rate:6.2f}x   {cpu:12.0f} {cpu / base_cpu:6.2f}x"
        )
    console.print(
        f"  worker / same worker on Faust's stock fetch loop: {worker_rate / stock_rate:.2f}x wall, "
        f"{worker_cpu / stock_cpu:.2f}x per CPU-second"
    )
    console.print(
        f"  worker / bare Faust: {worker_rate / bare_rate:.2f}x wall, {worker_cpu / bare_cpu:.2f}x per CPU-second;  "
        f"target >= 5000 events/s: {'MET' if worker_rate >= 5000 else 'NOT MET'} wall-clock here, "
        f"{'MET' if worker_cpu >= 5000 else 'NOT MET'} per CPU-second (one dedicated core)"
    )
    console.print(
        f"  label latency after window close ({len(lat)}/{len(gen_keys)} rollouts): p50 {p50:.3f} s  p99 {p99:.3f} s   "
        f"target p99 <= 2 s: {'MET' if p99 <= 2.0 else 'NOT MET'}"
    )


if __name__ == "__main__":
    main()
