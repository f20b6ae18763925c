"""Fixtures for the streams integration tests: real workers (subprocesses) on the real broker.

`streams_env(settings, **extra)` builds the environment of a worker; `start_worker` runs
`python -m streams.worker` with it (stopped at teardown); `produce` writes records to the
interactions topic; `collect` reads an output topic; `scenario` builds a few thousand
events in random order with duplicates, orphans, late feedback and invalid records;
`metric` / `scrape` read a worker's Prometheus series and `wait_for_assignment` waits until its
group's rebalance gave it partitions.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port
from tests.unit.streams.factories import generation, random_feedback
from tests.unit.streams.reference import Arrival
from tests.waiting import poll

WINDOW = 2.5


def broker_timed_settings(make_settings, **overrides):
    """`make_settings(...)` whose interactions topic stamps records with the broker's append time
    (`message.timestamp.type=LogAppendTime`, docs/STREAMS.md "Time").

    The reference (tests/unit/streams/reference.py) decides on record times alone; the worker also
    closes labels on ticks of its wall clock minus FLYWHEEL_STREAMS_SKEW_MARGIN (0.5 s), which agree
    with record times only when no record reaches the broker later than that after its timestamp.
    With the producer's CreateTime a loaded machine breaks that: measured beside the full suite
    (load ~18), 1 of 12,000 records reached the broker 2.5 s after its CreateTime (p99 0.28 s), and
    a feedback record so delayed near its window's end is rightly `after_close` for the worker but
    inside the window for the reference (seen as a rollout with reward 0.0 instead of -0.5 in 2 of
    31 runs under load, nothing else amiss in the workers' metrics and logs).
    With the broker's time a record is never stamped before a tick that did not count it."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    from app.contracts.topics import INTERACTIONS, TOPICS, topic_partitions
    from app.infra.broker import ensure_topics

    settings = make_settings(create_topics=False, **overrides)

    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:
        config = {**TOPICS[INTERACTIONS], "message.timestamp.type": "LogAppendTime"}
        admin.create_topics(
            [
                NewTopic(
                    settings.topic(INTERACTIONS),
                    num_partitions=topic_partitions(settings, INTERACTIONS),
                    replication_factor=settings.replication_factor,
                    topic_configs=config,
                )
            ]
        )
    finally:
        admin.close()
    ensure_topics(settings)  # the others, as make_settings creates them
    return settings


def streams_env(settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "FLYWHEEL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "FLYWHEEL_TOPIC_NAMESPACE": settings.topic_namespace,
            "FLYWHEEL_INTERACTIONS_PARTITIONS": str(settings.interactions_partitions),
            "FLYWHEEL_ROLLOUTS_PARTITIONS": str(settings.rollouts_partitions),
            "FLYWHEEL_DATA_DIR": str(settings.data_dir),
            "FLYWHEEL_WAIT_WINDOW": str(WINDOW),
            "FLYWHEEL_STREAMS_METRICS_PORT": str(free_port()),
            "FLYWHEEL_STREAMS_METRICS_BUCKET": "2s",
            "FLYWHEEL_STREAMS_SESSION_TIMEOUT": "8s",
            "FLYWHEEL_STREAMS_CLOSED_RETENTION": "120s",
            "PYTHONPATH": str(REPO),
        }
    )
    env.update(extra)
    return env


class WorkerProc:
    def __init__(self, env: dict[str, str], log: Path):
        self.env, self.log_path = env, log
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streams.worker"],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def metrics(self) -> str:
        """The worker's non-zero `flywheel_streams_*` samples (what it consumed, sent, dropped, waits
        for), or why they could not be read."""
        import httpx

        port = self.env["FLYWHEEL_STREAMS_METRICS_PORT"]
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
        except httpx.HTTPError as exc:
            return f"(no metrics: {type(exc).__name__}: {exc})"
        return "\n".join(
            line
            for line in text.splitlines()
            if line.startswith("flywheel_streams_")
            and not line.endswith((" 0.0", " 0"))
            and "_bucket{" not in line
        )

    def stacks(self) -> str:
        """Every asyncio task's and thread's stack of the running worker (it dumps them on SIGUSR2,
        streams/worker.py `dump_stacks`), read from its log; '' once it has exited."""
        if self.proc.poll() is not None:
            return ""
        before = self.log_path.stat().st_size
        os.kill(self.proc.pid, signal.SIGUSR2)

        def dumped() -> str:
            with open(self.log_path, "rb") as f:
                f.seek(before)
                return f.read().decode(errors="replace")

        def complete() -> str:
            # faulthandler writes the signalled (main) thread last: its frames end the dump
            text = dumped()
            main = text.split("Current thread")[-1] if "Current thread" in text else ""
            return text if "in <module>" in main else ""

        # a worker too stuck to finish its dump still shows what it wrote
        return (poll(complete, 5.0, "the stack dump", every=0.05, fail=False) or dumped())[-12000:]


@pytest.fixture()
def start_worker(tmp_path: Path):
    procs: list[WorkerProc] = []

    def _start(settings, **extra: str) -> WorkerProc:
        w = WorkerProc(streams_env(settings, **extra), tmp_path / f"worker{len(procs)}.log")
        procs.append(w)
        return w

    yield _start
    for w in procs:
        w.kill(signal.SIGTERM)


def metric(worker, series: str, retry: bool = True) -> float:
    """The sum of a series (name, optionally with its labels as the exposition prints them, e.g.
    'x_total{reason="a"}') from the worker's Prometheus endpoint. A connection reset or a slow
    answer (a loaded machine) is retried while the worker lives, up to conftest.STALL_S."""
    import httpx

    url = f"http://127.0.0.1:{worker.env['FLYWHEEL_STREAMS_METRICS_PORT']}/metrics"
    start = time.monotonic()
    while True:
        try:
            text = httpx.get(url, timeout=STALL_S).text
            break
        except httpx.TransportError:
            if not retry or worker.proc.poll() is not None or time.monotonic() - start > STALL_S:
                raise
    total = 0.0
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if name == series or ("{" not in series and name.startswith(series + "{")):
                total += float(value)
    return total


def scrape(worker, series: str) -> float | None:
    """`metric`, or None while the worker's metrics endpoint is not up yet."""
    import httpx

    try:
        return metric(worker, series, retry=False)
    except httpx.HTTPError:
        return None


def wait_for_assignment(worker, workers) -> None:
    """Until `worker` owns interactions partitions (flywheel_streams_assigned_partitions > 0): its
    group's rebalance completed. Fails when a worker exits, or after conftest.STALL_S without it."""

    def assigned() -> bool:
        for w in workers:
            assert w.proc.poll() is None, f"a worker exited:\n{w.tail()}"
        return bool(scrape(worker, "flywheel_streams_assigned_partitions"))

    if not poll(assigned, STALL_S, "partitions assigned", every=0.2, fail=False):
        raise AssertionError(
            f"no partitions assigned {STALL_S:.0f} s after its start: the rebalance never "
            f"completed\n{worker.tail()}"
        )


def produce(settings, records: list[tuple[bytes | None, bytes]]) -> None:
    from app.infra.kafka import make_producer

    # a loaded broker can take long to answer metadata: wait (up to STALL_S) instead of failing
    prod = make_producer(settings, key_serializer=None, max_block_ms=int(STALL_S * 1000))
    for key, value in records:
        prod.send(settings.topic("interactions"), key=key, value=value)
    prod.flush(STALL_S)
    prod.close()


def read_topic(
    settings,
    topic: str,
    expect: int,
    timeout: float,
    settle: float = 1.0,
    distinct_keys: bool = False,
) -> list[Any]:
    """Consume `topic` from the beginning until `expect` records arrived (then `settle` s more) or timeout.

    distinct_keys: count distinct record keys instead of records, for topics where a restarted
    worker legitimately re-emits some records (at-least-once): the duplicates must not stop the
    read before the last distinct record arrived."""
    from app.infra.kafka import make_consumer

    cons = make_consumer(settings, topic, group_id=None, consumer_timeout_ms=200)
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    settle_until = None
    while time.monotonic() < deadline:
        for rec in cons:
            out.append(rec)
        seen = len({r.key for r in out}) if distinct_keys else len(out)
        if seen >= expect and settle_until is None:
            settle_until = time.monotonic() + settle
        if settle_until is not None and time.monotonic() >= settle_until:
            break
    cons.close()
    return out


# How long a read may see nothing new before a test gives up. Not a deadline: a read waits as long
# as records keep arriving, however slow the machine; a worker that goes this long without one
# record of output, alive and with input left, is stuck. The worker's own longest legitimate
# silence is a rebalance (FLYWHEEL_STREAMS_SESSION_TIMEOUT 8 s here, rebalance timeout 10 s, then
# table recovery), so this leaves a wide margin for a loaded machine.
STALL_S = 90.0


class Stalled(AssertionError):
    """A read saw nothing new for STALL_S while what it waited for had not all arrived."""


def read_until(
    settings,
    topic: str,
    want: int,
    *,
    key_of: Callable[[Any], Any] | None = None,
    alive: Sequence[WorkerProc] = (),
    stall_s: float = STALL_S,
    settle: float = 1.0,
) -> list[Any]:
    """Consume `topic` from the beginning until `want` distinct records arrived (then `settle` s more).

    Distinct by `key_of(record)` (default: every record counts), so at-least-once duplicates never
    end the read before the last distinct record. Waits on progress, not on a deadline: it fails
    (`Stalled`, with the count) only when no new distinct record arrived for `stall_s`, and at once
    when a process in `alive` exits."""
    from app.infra.kafka import make_consumer

    cons = make_consumer(settings, topic, group_id=None, consumer_timeout_ms=200)
    out: list[Any] = []
    seen: set[Any] = set()
    start = last_new = time.monotonic()
    settle_until = None
    try:
        while True:
            for rec in cons:
                out.append(rec)
                key = key_of(rec) if key_of is not None else len(out)
                if key not in seen:
                    seen.add(key)
                    last_new = time.monotonic()
            now = time.monotonic()
            if len(seen) >= want:
                settle_until = settle_until or now + settle
                if now >= settle_until:
                    return out
                continue
            dead = [w for w in alive if w.proc.poll() is not None]
            if dead:
                raise Stalled(
                    f"{topic}: {len(seen)} of {want} distinct records, and a worker exited "
                    f"(rc {dead[0].proc.returncode}):\n{dead[0].tail()}"
                )
            if now - last_new > stall_s:
                raise Stalled(
                    f"{topic}: {len(seen)} of {want} distinct records after {now - start:.0f} s; "
                    f"nothing new for the last {now - last_new:.0f} s"
                    + "".join(
                        f"\n--- alive worker {w.log_path.name}:\n{w.tail()}"
                        f"\n--- its metrics:\n{w.metrics()}\n--- its stacks:\n{w.stacks()}"
                        for w in alive
                    )
                )
    finally:
        cons.close()


def read_to_end(settings, topic: str, stall_s: float = STALL_S) -> list[Any]:
    """Every record of `topic` up to its end offsets as of the call (each partition read to its end,
    however long that takes: fails only when the read makes no progress for `stall_s`)."""
    from kafka.errors import KafkaTimeoutError
    from kafka.structs import TopicPartition

    from app.infra.kafka import make_consumer

    cons = make_consumer(settings, group_id=None)
    try:
        parts = None
        start = last_new = time.monotonic()
        while not parts:  # metadata of a topic just created can take a moment
            parts = cons.partitions_for_topic(topic)
            assert parts or time.monotonic() - start < stall_s, f"{topic}: no partitions"
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        cons.assign(tps)
        cons.seek_to_beginning(*tps)
        while True:  # a starved broker can miss the request's own timeout: ask again
            try:
                end = cons.end_offsets(tps)
                break
            except KafkaTimeoutError:
                if time.monotonic() - start > stall_s:
                    raise
        out: list[Any] = []
        while any(cons.position(tp) < end[tp] for tp in tps):
            got = cons.poll(timeout_ms=200)
            for recs in got.values():
                out.extend(r for r in recs if r.offset < end[TopicPartition(r.topic, r.partition)])
            if got:
                last_new = time.monotonic()
            elif time.monotonic() - last_new > stall_s:
                raise Stalled(
                    f"{topic}: read {len(out)} records, stuck at "
                    f"{ {tp.partition: cons.position(tp) for tp in tps} } of {end}"
                )
        return out
    finally:
        cons.close()


def arrivals(settings) -> list[Arrival]:
    """The interactions topic as the worker saw it: (partition order, record timestamp, event)."""
    from app.contracts.events import EventValidationError, parse_event

    recs = read_to_end(settings, settings.topic("interactions"))
    out = []
    for r in recs:
        try:
            ev = json.loads(r.value)
            parse_event(ev)
        except (ValueError, EventValidationError):
            continue
        if r.key != ev["request_id"].encode():
            continue
        out.append(Arrival(r.partition * 10**9 + r.offset, r.timestamp / 1000.0, ev))
    return out


def scenario(
    seed: int, n_requests: int
) -> tuple[list[tuple[bytes | None, bytes]], list[tuple[bytes, bytes]], int]:
    """(phase-1 records in random order, phase-2 late feedback, number of invalid records)."""
    rng = random.Random(seed)
    phase1, phase2, invalid = [], [], 0
    for i in range(n_requests):
        rid = f"req-{seed}-{i}"
        evs = []
        has_gen = rng.random() < 0.9
        if has_gen:
            evs.append(
                generation(
                    rid,
                    t=rng.uniform(0, 5),
                    version=rng.choice(["m1", "m2"]),
                    n_tokens=rng.randint(1, 8),
                )
            )
        evs += [random_feedback(rng, rid, f"{rid}-f{j}") for j in range(rng.randint(0, 5))]
        evs += [dict(e) for e in evs if rng.random() < 0.15]  # duplicates
        phase1 += [(rid.encode(), json.dumps(e).encode()) for e in evs]
        if has_gen and rng.random() < 0.2:
            late = random_feedback(rng, rid, f"{rid}-late")
            phase2.append((rid.encode(), json.dumps(late).encode()))
    bad = [
        (b"k", b"{not json"),
        (b"k2", json.dumps({"type": "accept", "event_id": "x"}).encode()),
        (b"wrong-key", json.dumps(random_feedback(rng, "req-x", "kx")).encode()),
        (None, b"\xff\xfe"),
    ]
    phase1 += bad
    invalid = len(bad)
    rng.shuffle(phase1)
    return phase1, phase2, invalid
