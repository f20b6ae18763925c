"""Start-up replay of the deployment log after a day of replica heartbeats, before and after
heartbeats moved to their own compacted topic.

    python -m bench.replay                          # 1 day, the default fleet (see below)
    python -m bench.replay --replicas 8 --days 2 --kafka 127.0.0.1:9092

A day of events is written to a real broker (an embedded one started here unless `--kafka`):
heartbeats = days x 86400 / heartbeat interval (ReplicaConfig, 15 s) x replicas (`flywheel run`
starts 2), and the decisions of days x 86400 / FLYWHEEL_SHIP_INTERVAL (5 h) versions, each
registered, gated, canaried over four steps and promoted, with a `replica_synced` per replica
and slot. Then it times what a start-up reads, the way the roles read it (median of `--runs`):

- before: `<ns>.deployments` holds decisions and heartbeats; a replica, the controller and a
  projector rebuild all read every record (DeploymentLog.read + the fold);
- after: `<ns>.deployments` holds decisions only (what a replica and the controller read), and
  `<ns>.replica-status` (keyed by replica id) holds the heartbeats, which only the projector
  reads; as a consumer reads it right after writing (compaction has not run yet), and after a
  forced compaction (a copy of the topic with `segment.ms=1000` and
  `min.cleanable.dirty.ratio=0.01`; the cleaner then keeps about the latest report per replica).

Prints records and seconds for each, and the ratios before / after.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from app.contracts.deployment_state import apply_heartbeat, replay
from app.contracts.deployments import DeploymentEvent, DeploymentLog
from app.contracts.replica_status import ReplicaStatusLog
from app.replica.config import ReplicaConfig
from app.settings import Settings

MODEL = "flywheel-policy"
DAY_S = 86400.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--days", type=float, default=1.0, help="days of events (default 1)")
    p.add_argument("--replicas", type=int, default=2, help="replicas (default 2, as flywheel run)")
    p.add_argument("--runs", type=int, default=3, help="timed reads per measurement (median)")
    p.add_argument(
        "--kafka", default=None, help="bootstrap of a running broker (default: start one)"
    )
    p.add_argument(
        "--compaction-wait",
        type=float,
        default=120.0,
        help="s to wait for the cleaner (default 120)",
    )
    return p.parse_args()


# --- a day of events ----------------------------------------------------------------------------
def day_of_events(
    days: float, replicas: int, heartbeat_s: float, ship_s: float
) -> tuple[list[DeploymentEvent], list[DeploymentEvent]]:
    """(decisions, heartbeats), each oldest first, over `days` from a fixed start."""
    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    ids = [f"replica-{i}" for i in range(replicas)]

    def ev(type_: str, at: float, version: str | None, **kw) -> DeploymentEvent:
        kw.setdefault("source", "controller")
        return DeploymentEvent(
            type=type_, model=MODEL, version=version, ts=t0 + timedelta(seconds=at), **kw
        )

    decisions: list[DeploymentEvent] = []
    n_versions = max(1, int(days * DAY_S / ship_s))
    for i in range(n_versions):
        v, parent, at = str(i + 1), (str(i) if i else None), i * ship_s
        decisions.append(
            ev("version_registered", at, v, from_version=parent, source="trainer",
               details={"run_id": f"run-{v}", "rollouts_consumed": 5000 * (i + 1)})
        )  # fmt: skip
        if parent is None:
            decisions.append(ev("promoted", at + 1, v, reason="first version"))
            continue
        decisions.append(ev("gate_passed", at + 60, v, from_version=parent))
        decisions.append(
            ev(
                "canary_started",
                at + 61,
                v,
                from_version=parent,
                traffic_pct=5.0,
                details={"step": 0},
            )
        )
        decisions += [
            ev("replica_synced", at + 62, v, source="replica",
               details={"replica_id": rid, "slot": "candidate"})
            for rid in ids
        ]  # fmt: skip
        for step, pct in enumerate((25.0, 50.0, 100.0), start=1):
            decisions.append(
                ev(
                    "traffic_shifted",
                    at + 61 + 600 * step,
                    v,
                    traffic_pct=pct,
                    details={"step": step},
                )
            )
        decisions.append(ev("promoted", at + 2400, v, from_version=parent))
        decisions += [
            ev("replica_synced", at + 2401, v, source="replica", details={"replica_id": rid})
            for rid in ids
        ]
    heartbeats = [
        ev("replica_heartbeat", k * heartbeat_s, None, source="replica",
           details={"replica_id": rid, "champion_version": "1", "status": "serving"})
        for k in range(int(days * DAY_S / heartbeat_s))
        for rid in ids
    ]  # fmt: skip
    return decisions, heartbeats


def publish(settings: Settings, topic: str, events: list[DeploymentEvent], key: Callable) -> None:
    """Write `events` in order, batched (one flush at the end)."""
    from app.infra.kafka import make_producer

    producer = make_producer(settings, linger_ms=20)
    try:
        for e in events:
            producer.send(topic, key=key(e), value=e.to_bytes())
        producer.flush(timeout=120)
    finally:
        producer.close(timeout=30)


# --- what a start-up reads ----------------------------------------------------------------------
def read_log(settings: Settings) -> int:
    """A replica's / the controller's start-up: the deployment log to its end, folded."""
    n = 0

    def counted() -> Iterator[DeploymentEvent]:
        nonlocal n
        for logged in DeploymentLog(settings).read(stall_timeout_s=60):
            n += 1
            yield logged.event

    state = replay(MODEL, counted())
    assert state.champion is not None, "the replayed log names no champion"
    return n


def read_status(settings: Settings) -> int:
    """The projector's rebuild of `replicas`: the replica-status topic to its end, folded."""
    replicas, n = {}, 0
    for logged in ReplicaStatusLog(settings).read(stall_timeout_s=60):
        n += 1
        replicas = apply_heartbeat(replicas, logged.event)
    return n


def timed(fn: Callable[[Settings], int], settings: Settings, runs: int) -> tuple[int, float]:
    """(records read, median seconds) of `runs` reads."""
    records, seconds = 0, []
    for _ in range(runs):
        t = time.perf_counter()
        records = fn(settings)
        seconds.append(time.perf_counter() - t)
    return records, statistics.median(seconds)


def create_compacting_status_topic(settings: Settings) -> None:
    """`<ns>.replica-status` with configs that let the cleaner run within the benchmark."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:
        admin.create_topics(
            [
                NewTopic(
                    settings.topic("replica-status"),
                    num_partitions=settings.default_partitions,
                    replication_factor=settings.replication_factor,
                    topic_configs={
                        "cleanup.policy": "compact",
                        "segment.ms": "1000",
                        "min.cleanable.dirty.ratio": "0.01",
                    },
                )
            ]
        )
    finally:
        admin.close()


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    if bootstrap is not None:
        yield bootstrap
        return
    from app.infra.broker import LocalKafka
    from tests.conftest import free_port

    kafka = LocalKafka(
        home=Path(tempfile.mkdtemp(prefix="flywheel-bench-replay-")) / "kafka",
        port=free_port(),
        controller_port=free_port(),
        heap="512m",
    )
    print("starting Kafka…", flush=True)
    kafka.start(timeout=180)
    try:
        yield kafka.bootstrap
    finally:
        kafka.stop()


def main() -> None:
    from app.infra.broker import ensure_topics

    args = parse_args()
    base = Settings()
    heartbeat_s = ReplicaConfig.model_fields["heartbeat_interval"].default
    decisions, heartbeats = day_of_events(args.days, args.replicas, heartbeat_s, base.ship_interval)
    print(
        f"{args.days:g} day(s): {len(decisions)} decisions, {len(heartbeats)} heartbeats "
        f"({args.replicas} replicas every {heartbeat_s:g} s; a version every {base.ship_interval:g} s)"
    )
    by_model, by_replica = (lambda e: e.model), (lambda e: e.details["replica_id"])
    with broker(args.kafka) as bootstrap:
        run = uuid.uuid4().hex[:6]

        def settings(name: str) -> Settings:
            return Settings(
                kafka_bootstrap=bootstrap,
                topic_namespace=f"replay{run}{name}",
                data_dir=Path(tempfile.mkdtemp(prefix="flywheel-bench-replay-")),
            )

        before, after, compacted = settings("before"), settings("after"), settings("compacted")
        create_compacting_status_topic(compacted)
        for s in (before, after, compacted):
            ensure_topics(s)
        merged = sorted(decisions + heartbeats, key=lambda e: e.ts)
        publish(before, before.topic("deployments"), merged, by_model)
        publish(after, after.topic("deployments"), decisions, by_model)
        publish(after, after.topic("replica-status"), heartbeats, by_replica)
        publish(compacted, compacted.topic("replica-status"), heartbeats, by_replica)

        b_n, b_s = timed(read_log, before, args.runs)
        a_n, a_s = timed(read_log, after, args.runs)
        st_n, st_s = timed(read_status, after, args.runs)
        # the active segment is never cleaned: roll it (segment.ms passed) with one more report
        deadline = time.monotonic() + args.compaction_wait
        time.sleep(1.5)
        publish(compacted, compacted.topic("replica-status"), heartbeats[-1:], by_replica)
        c_n = read_status(compacted)
        while (
            c_n > 2 * args.replicas * compacted.default_partitions + 1
            and time.monotonic() < deadline
        ):
            time.sleep(5)
            c_n = read_status(compacted)
        c_n, c_s = timed(read_status, compacted, args.runs)

    print()
    print(f"{'start-up read':58} {'records':>8} {'seconds':>8}")
    rows = [
        ("before: deployments (decisions + heartbeats)", b_n, b_s),
        ("after: deployments (decisions only): replica, controller", a_n, a_s),
        ("after: replica-status, before compaction (projector)", st_n, st_s),
        ("after: replica-status, after a forced compaction", c_n, c_s),
    ]
    for name, n, s in rows:
        print(f"{name:58} {n:>8} {s:>8.3f}")
    print()
    print(
        f"replica / controller start-up, before / after: {b_n / a_n:.0f}x records, "
        f"{b_s / a_s:.1f}x seconds"
    )
    print(
        f"projector rebuild, before / after (log + uncompacted status): "
        f"{b_n / (a_n + st_n):.2f}x records, {b_s / (a_s + st_s):.2f}x seconds; "
        f"after compaction: {b_n / (a_n + c_n):.0f}x records, {b_s / (a_s + c_s):.1f}x seconds"
    )


if __name__ == "__main__":
    main()
