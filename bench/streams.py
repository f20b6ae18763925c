"""Benchmark of one streams worker on a real Kafka broker, beside a plain kafka-python loop.

Measures, in the same run and on the same broker:
  1. baseline: a plain kafka-python consume -> produce loop copying the interactions backlog
     to a scratch topic (events/s; no parsing, no state);
  2. worker:   `python -m streams.worker` draining the same backlog (events/s from the worker's
     Prometheus counter: first to last event, start-up excluded) -> ratio worker / baseline;
  3. label latency: live traffic at a steady rate; for each rollout, its record time on the
     rollouts topic minus the moment its window closed (generation record time + window),
     p50/p99. Target: >= 5,000 events/s per worker, p99 <= 2 s.

    .venv/bin/python bench/streams.py            # ~60k events, starts an embedded broker
    .venv/bin/python bench/streams.py --quick    # ~12k events
    .venv/bin/python bench/streams.py --bootstrap 127.0.0.1:9092

Numbers depend on the machine; on a shared, busy host they are a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402

console = Console()


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
        out.append((rid.encode(), json.dumps(generation(rid, version=f"m{i % 3}", n_tokens=rng.randint(8, 64))).encode()))
        out += [(rid.encode(), json.dumps(random_feedback(rng, rid, f"{rid}-f{j}")).encode()) for j in range(rng.randint(0, 4))]
        i += 1
    return out[:n_events]


def baseline(settings, n: int) -> float:
    """Plain kafka-python consume -> produce of the backlog; events/s."""
    from app.kafka_io import make_consumer, make_producer

    dest = f"{settings.topic_namespace}.bench-copy"
    cons = make_consumer(settings, settings.topic("interactions"), group_id=f"bench-{uuid.uuid4().hex[:6]}")
    prod = make_producer(settings, key_serializer=None)
    seen, t0 = 0, None
    while seen < n:
        batches = cons.poll(timeout_ms=1000, max_records=2000)
        for recs in batches.values():
            if t0 is None:
                t0 = time.perf_counter()
            for r in recs:
                prod.send(dest, key=r.key, value=r.value)
            seen += len(recs)
        cons.commit()
    prod.flush()
    dt = time.perf_counter() - t0
    cons.close()
    prod.close()
    return n / dt


def metric(port: int, name: str) -> float:
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (~12k backlog events, 5 s live phase)")
    ap.add_argument("--bootstrap", help="use this broker instead of starting an embedded one")
    ap.add_argument("--events", type=int, help="backlog events (default 60000, quick 12000)")
    ap.add_argument("--window", type=float, default=2.0, help="wait window in seconds")
    ap.add_argument("--rate", type=float, default=300.0, help="live phase: generations per second")
    args = ap.parse_args()
    n = args.events or (12_000 if args.quick else 60_000)
    live_s = 5.0 if args.quick else 15.0

    from app.infra.kafka import LocalKafka
    from app.kafka_io import make_consumer, make_producer
    from app.settings import Settings
    from streams.app import ensure_internal_topics

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-streams-"))
    broker = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        broker = LocalKafka(home=tmp / "kafka", port=free_port(), controller_port=free_port(), heap="768m")
        with console.status("starting an embedded Kafka broker..."):
            broker.start(timeout=120)
        bootstrap = broker.bootstrap
    settings = Settings(kafka_bootstrap=bootstrap, topic_namespace=f"bench{uuid.uuid4().hex[:8]}", data_dir=tmp,
                        interactions_partitions=3, rollouts_partitions=3, wait_window=args.window)
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
            base_rate = baseline(settings, n)
        port = free_port()
        env = dict(os.environ, FLYWHEEL_KAFKA_BOOTSTRAP=bootstrap, FLYWHEEL_TOPIC_NAMESPACE=settings.topic_namespace,
                   FLYWHEEL_INTERACTIONS_PARTITIONS="3", FLYWHEEL_ROLLOUTS_PARTITIONS="3", FLYWHEEL_DATA_DIR=str(tmp),
                   FLYWHEEL_WAIT_WINDOW=str(args.window), FLYWHEEL_STREAMS_METRICS_PORT=str(port), PYTHONPATH=str(REPO))
        log = open(tmp / "worker.log", "ab")
        worker = subprocess.Popen([sys.executable, "-m", "streams.worker"], cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        t_first = t_last = None
        deadline = time.monotonic() + 600
        with console.status("worker: draining the backlog...") as status:
            while time.monotonic() < deadline:
                done = metric(port, "flywheel_streams_events_in_total")
                now = time.perf_counter()
                if done > 0 and t_first is None:
                    t_first, first_count = now, done
                if done >= n:
                    t_last = now
                    break
                status.update(f"worker: {int(done)}/{n} events")
                time.sleep(0.05)
        assert t_last is not None, f"worker did not drain the backlog; see {tmp / 'worker.log'}"
        worker_rate = (n - first_count) / max(t_last - t_first, 1e-6)

        # live phase: steady traffic, then measure close -> rollout latency
        live = make_events(int(args.rate * live_s * 3), seed=1)
        gen_keys = set()
        with console.status(f"live traffic for {live_s:.0f} s..."):
            t0, sent = time.perf_counter(), 0
            per_tick = max(1, int(args.rate * 3 / 50))
            while sent < len(live):
                for k, v in live[sent:sent + per_tick]:
                    prod.send(settings.topic("interactions"), key=k, value=v)
                    if b'"generation"' in v:
                        gen_keys.add(k)
                sent += per_tick
                time.sleep(max(0.0, t0 + sent / (args.rate * 3) - time.perf_counter()))
            prod.flush()
        cons = make_consumer(settings, settings.topic("interactions"), group_id=None, consumer_timeout_ms=1000)
        gen_rt = {}
        for r in cons:
            if r.key in gen_keys and b'"generation"' in r.value:
                gen_rt.setdefault(r.key, r.timestamp / 1000.0)
        cons.close()
        cons = make_consumer(settings, settings.topic("rollouts"), group_id=None, consumer_timeout_ms=2000)
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
        if worker is not None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
        if broker is not None:
            broker.stop()

    console.print(f"[bold]streams benchmark[/bold] ({n} backlog events, 3 partitions, window {args.window:g} s, "
                  f"{os.cpu_count()} CPUs; shared machines give lower bounds)")
    console.print(f"  baseline kafka-python consume->produce: {base_rate:10.0f} events/s")
    console.print(f"  streams worker (1 process):             {worker_rate:10.0f} events/s   "
                  f"ratio {worker_rate / base_rate:.2f}x   target >= 5000/s: {'MET' if worker_rate >= 5000 else 'NOT MET'}")
    console.print(f"  label latency after window close ({len(lat)}/{len(gen_keys)} rollouts): p50 {p50:.3f} s  p99 {p99:.3f} s   "
                  f"target p99 <= 2 s: {'MET' if p99 <= 2.0 else 'NOT MET'}")


if __name__ == "__main__":
    main()
