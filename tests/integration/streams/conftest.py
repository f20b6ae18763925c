"""Fixtures for the streams integration tests: real workers (subprocesses) on the real broker.

`streams_env(settings, **extra)` builds the environment of a worker; `start_worker` runs
`python -m streams.worker` with it (stopped at teardown); `produce` writes records to the
interactions topic; `collect` reads an output topic; `scenario` builds a few thousand
events in random order with duplicates, orphans, late feedback and invalid records.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port
from tests.unit.streams.factories import generation, random_feedback
from tests.unit.streams.reference import Arrival

WINDOW = 2.5


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


def produce(settings, records: list[tuple[bytes | None, bytes]]) -> None:
    from app.contracts.kafka import make_producer

    prod = make_producer(settings, key_serializer=None)
    for key, value in records:
        prod.send(settings.topic("interactions"), key=key, value=value)
    prod.flush(30)
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
    from app.contracts.kafka import make_consumer

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


def arrivals(settings) -> list[Arrival]:
    """The interactions topic as the worker saw it: (partition order, record timestamp, event)."""
    from app.contracts.events import EventValidationError, parse_event

    recs = read_topic(settings, settings.topic("interactions"), expect=10**9, timeout=8.0)
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
