"""CPU of the embedded Kafka broker: the light JVM options (app/settings.py `KAFKA_LIGHT_JVM`, the
default) against Kafka's own G1 options, side by side in one run.

    .venv/bin/python -m bench.kafka_jvm              # 3 rounds, 20,000 records of 200 bytes
    .venv/bin/python -m bench.kafka_jvm --rounds 1 --records 60000

Each round starts one broker per option set (in alternating order, each on fresh storage),
waits until it serves metadata, creates a 3-partition topic, produces and consumes `--records`
records with kafka-python, then idles `--idle` seconds. It reports the broker JVM's CPU seconds
(user + system, from /proc) to the end of the load and over the idle time, the start-up time and
the load's wall time, and the ratio light / G1 of each (medians over the rounds). A local broker
idles for most of a `flywheel run` or a test session, so both the start and the idle matter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from app.infra.broker import LocalKafka
from app.settings import KAFKA_LIGHT_JVM
from tests.conftest import free_port

G1 = "-XX:+UseG1GC -XX:MaxGCPauseMillis=20"  # Kafka's own (bin/kafka-run-class.sh)
OPTIONS = {"light": KAFKA_LIGHT_JVM, "g1": G1}


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def one_broker(jvm_opts: str, records: int, idle_s: float) -> dict[str, float]:
    """Start, load, idle and stop one broker; its numbers."""
    from kafka import KafkaConsumer, KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    with tempfile.TemporaryDirectory(prefix="bench-kafka-jvm-") as home:
        broker = LocalKafka(
            home=Path(home), port=free_port(), controller_port=free_port(), jvm_opts=jvm_opts
        )
        t0 = time.monotonic()
        broker.start()
        ready_s = time.monotonic() - t0
        try:
            java = psutil.Process(broker.pid())
            admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
            admin.create_topics([NewTopic("bench", 3, 1)])
            admin.close()
            t1 = time.monotonic()
            producer = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=5)
            body = json.dumps({"x": "y" * 190}).encode()
            for _ in range(records):
                producer.send("bench", body)
            producer.flush()
            producer.close()
            consumer = KafkaConsumer(
                "bench",
                bootstrap_servers=broker.bootstrap,
                auto_offset_reset="earliest",
                enable_auto_commit=False,
            )
            seen = 0
            while seen < records:
                seen += sum(len(r) for r in consumer.poll(timeout_ms=1000).values())
            consumer.close()
            load_s = time.monotonic() - t1
            busy = _cpu(java)
            time.sleep(idle_s)
            idle = _cpu(java) - busy
        finally:
            broker.stop()
    return {"ready_s": ready_s, "load_s": load_s, "cpu_to_loaded_s": busy, "cpu_idle_s": idle}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--idle", type=float, default=30.0, help="idle seconds after the load")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in OPTIONS}
    for r in range(args.rounds):
        order = list(OPTIONS) if r % 2 == 0 else list(reversed(OPTIONS))
        for name in order:
            res = one_broker(OPTIONS[name], args.records, args.idle)
            runs[name].append(res)
            print(
                f"round {r + 1}/{args.rounds} {name:5s}  ready {res['ready_s']:.1f}s  "
                f"load {res['load_s']:.1f}s  CPU to loaded {res['cpu_to_loaded_s']:.1f}s  "
                f"CPU idle {res['cpu_idle_s']:.2f}s/{args.idle:.0f}s",
                flush=True,
            )
    med = {
        name: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
        for name, rs in runs.items()
    }
    print(f"\nmedians over {args.rounds} rounds; ratio = light / g1")
    for key in ("ready_s", "load_s", "cpu_to_loaded_s", "cpu_idle_s"):
        light, g1 = med["light"][key], med["g1"][key]
        print(f"  {key:16s} light {light:7.2f}  g1 {g1:7.2f}  ratio {light / g1:.2f}")


if __name__ == "__main__":
    main()
