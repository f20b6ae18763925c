"""Soak: valid clients beside invalid and slow ones, on loopback, for a bounded time.

Starts its own real parts (a Kafka broker, `flywheel api` as its own process: real uvicorn,
migrations, SQLite; with `--replica` also an MLflow server and a `flywheel replica` process
serving a tiny registered policy) and runs three phases with the same valid clients:

1. baseline: only the valid clients (ingest batches to the API, completions from the replica),
   each paced at a fixed request rate, so latency is comparable across phases;
2. soak: the valid clients plus hostile ones:
   - invalid clients cycling through malformed JSON, NaN literals, deep nesting, invalid and
     unknown-field events, too many events, a body over the API's limit, one event over the
     broker's record limit, bad/missing keys, a form content-type, lower-case-`z` timestamps,
     big unsigned webhook posts, and on the replica malformed bodies, tiny temperatures, lone
     surrogates, huge prompts and `n`;
   - slow clients holding many connections open with half-sent heads or bodies (slow-loris),
     one byte every couple of seconds, each connection up to `--slow-hold` seconds;
3. recovery: the valid clients alone again.

Every client is bounded in time (request timeout, socket timeouts, the phase clock), so the
soak ends on time whatever the servers do. At the end the interactions topic is read back:
**lost** = acknowledged (202 from the API, 200 from the replica) but not on the topic; it must
be 0 (the exit status is 1 otherwise). Printed: per client kind and phase accepted / rejected
(4xx) / 5xx / hung (no answer within the timeout) / reset (connection reset or closed without
an answer) counts; the valid clients' p50/p99 per phase and the ratio soak/baseline; what
happened to the slow connections (closed by the server vs held open to the client's bound);
the servers' RSS before and after.

    .venv/bin/python -m bench.soak              # 30 s baseline, 180 s soak, 30 s recovery
    .venv/bin/python -m bench.soak --quick      # about 60 s of phases (10 + 40 + 10)
    .venv/bin/python -m bench.soak --no-replica # the API alone (no MLflow, no torch)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import select
import socket
import sys
import threading
import time
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from bench.common import local_services, percentile, rss_mib, start_role, stop_role
from bench.ingest import wait_idle

warnings.filterwarnings(
    "ignore", category=DeprecationWarning
)  # kafka-python's key_serializer notice
PHASES = ("baseline", "soak", "recovery")
OUTCOMES = ("accepted", "rejected", "5xx", "hung", "reset")


# --- bookkeeping ----------------------------------------------------------------------------------
@dataclass
class Tally:
    """Thread-safe counts, latencies and acknowledged ids of every client."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter = field(default_factory=Counter)  # (kind, phase, outcome) -> n
    statuses: Counter = field(default_factory=Counter)  # (kind, case, status or error) -> n
    latencies: dict = field(default_factory=dict)  # (kind, phase) -> [s] of accepted requests
    acked_events: set = field(default_factory=set)  # event_ids of 202 batches
    acked_generations: set = field(default_factory=set)  # request_ids of 200 completions
    slow: Counter = field(default_factory=Counter)  # (target, mode, outcome) -> connections
    slow_held_s: list = field(default_factory=list)  # how long each server-closed connection lived

    def record(
        self, kind: str, phase: str, case: str, outcome: str, status: str, latency: float | None
    ) -> None:
        with self.lock:
            self.outcomes[kind, phase, outcome] += 1
            self.statuses[kind, case, status] += 1
            if latency is not None and outcome == "accepted":
                self.latencies.setdefault((kind, phase), []).append(latency)


class Clock:
    """The current phase, shared by every client; `stop` ends them all."""

    def __init__(self) -> None:
        self.phase = "warmup"
        self.stop = threading.Event()
        self.hostile = threading.Event()  # set during the soak phase only


def classify(call) -> tuple[str, str, httpx.Response | None, float]:
    """Run `call()` (an httpx request) -> (outcome, status or error name, response, seconds)."""
    t0 = time.perf_counter()
    try:
        r = call()
    except httpx.TimeoutException as exc:
        return "hung", type(exc).__name__, None, time.perf_counter() - t0
    except (httpx.TransportError, OSError) as exc:  # reset, closed without an answer, refused
        return "reset", type(exc).__name__, None, time.perf_counter() - t0
    dt = time.perf_counter() - t0
    s = r.status_code
    outcome = "accepted" if s < 300 else "5xx" if s >= 500 else "rejected"
    return outcome, str(s), r, dt


def paced(clock: Clock, rate: float, active: threading.Event | None = None):
    """Yield at `rate` per second until the clock stops (only while `active` is set, if given)."""
    period, nxt = 1.0 / rate, time.monotonic()
    while not clock.stop.is_set():
        if active is not None and not active.is_set():
            active.wait(0.2)
            nxt = time.monotonic()
            continue
        yield
        nxt += period
        delay = nxt - time.monotonic()
        if delay > 0:
            clock.stop.wait(delay)
        else:
            nxt = time.monotonic()  # fell behind (a slow answer): do not burst to catch up


# --- request bodies ------------------------------------------------------------------------------
TS = "2026-11-21T10:00:00Z"


def feedback_events(n: int) -> list[dict]:
    out = []
    for _ in range(n):
        rid = uuid.uuid4().hex
        out.append(
            {
                "event_id": uuid.uuid4().hex,
                "type": "rating",
                "request_id": rid,
                "session_id": "soak",
                "ts": TS,
                "value": 1,
            }
        )
    return out


def generation_event(prompt_tokens: int) -> dict:
    return {
        "event_id": uuid.uuid4().hex,
        "type": "generation",
        "request_id": uuid.uuid4().hex,
        "session_id": "soak",
        "ts": TS,
        "model_version": "1",
        "prompt_tokens": [200] * prompt_tokens,
        "completion_tokens": [33, 10],
        "logprobs": [-0.5, -0.25],
        "temperature": 1.0,
        "tokenizer": "byte-v1",
    }


@dataclass
class Case:
    """One hostile request: where it goes, its headers and body (bytes, built once)."""

    name: str
    target: str  # "api" | "replica"
    path: str
    body: bytes
    headers: dict[str, str]
    fresh_ids: bool = False  # the body is valid: rebuild it per request with new event ids


def hostile_cases(ingest_key: str) -> list[Case]:
    auth = {"Authorization": f"Bearer {ingest_key}", "Content-Type": "application/json"}
    js = {"Content-Type": "application/json"}

    def ev(**kw) -> bytes:
        e = feedback_events(1)[0]
        e.update(kw)
        return orjson.dumps({"events": [e]})

    big_events = []  # ~8 KB tool_error events (each valid) until the body is over the 4 MiB limit
    while sum(map(len, map(orjson.dumps, big_events))) < int(4.3e6):
        e = {
            **feedback_events(1)[0],
            "type": "tool_error",
            "message": "x" * 4096,
            "hint": "y" * 4096,
        }
        e.pop("value")
        big_events.append(e)
    big_body = orjson.dumps({"events": big_events})
    depth = 20000
    return [
        Case("malformed_json", "api", "/v1/events", b'{"events": [{"event_id": ', auth),
        Case("nan_literal", "api", "/v1/events", ev().replace(b'"value":1', b'"value":NaN'), auth),
        Case(
            "deep_nesting",
            "api",
            "/v1/events",
            b'{"events": ' + b"[" * depth + b"]" * depth + b"}",
            auth,
        ),
        Case(
            "invalid_events",
            "api",
            "/v1/events",
            orjson.dumps(
                {
                    "events": [
                        {**feedback_events(1)[0], "value": 3},
                        {**feedback_events(1)[0], "ts": "2026-11-21T10:00:00"},
                        {**feedback_events(1)[0], "type": "bogus"},
                        {**feedback_events(1)[0], "colour": "red"},
                    ]
                }
            ),
            auth,
        ),
        Case(
            "too_many_events",
            "api",
            "/v1/events",
            orjson.dumps({"events": feedback_events(1001)}),
            auth,
        ),
        Case("body_over_limit", "api", "/v1/events", big_body, auth),
        Case(
            "event_over_record_limit",
            "api",
            "/v1/events",
            orjson.dumps({"events": [generation_event(300_000)]}),
            auth,
            fresh_ids=True,
        ),
        Case(
            "bad_key",
            "api",
            "/v1/events",
            ev(),
            {**js, "Authorization": "Bearer fw_deadbeef_" + "x" * 40},
        ),
        Case("no_key", "api", "/v1/events", ev(), js),
        Case(
            "form_content_type",
            "api",
            "/v1/events",
            ev(),
            {**auth, "Content-Type": "application/x-www-form-urlencoded"},
            fresh_ids=True,
        ),
        Case(
            "lowercase_z_ts",
            "api",
            "/v1/events",
            ev(ts="2026-11-21t10:00:00z"),
            auth,
            fresh_ids=True,
        ),
        Case(
            "webhook_unsigned_big",
            "api",
            "/v1/hooks/mlflow",
            b'{"x": "' + b"y" * (8 << 20) + b'"}',
            js,
        ),
        Case(
            "admin_bad_key_nan",
            "api",
            "/v1/deployments/pause",
            b'{"reason": NaN}',
            {**js, "Authorization": "Bearer fw_deadbeef_" + "x" * 40},
        ),
        Case("r_malformed_json", "replica", "/v1/complete", b'{"prompt": ', js),
        Case(
            "r_tiny_temperature",
            "replica",
            "/v1/complete",
            b'{"session_id": "s", "prompt": "def f(", "max_tokens": 4, "temperature": 1e-300}',
            js,
        ),
        Case(
            "r_lone_surrogate",
            "replica",
            "/v1/complete",
            b'{"session_id": "s", "prompt": "\\ud800", "max_tokens": 4}',
            js,
        ),
        Case(
            "r_huge_prompt",
            "replica",
            "/v1/complete",
            orjson.dumps({"session_id": "s", "prompt": "a" * (8 << 20), "max_tokens": 4}),
            js,
        ),
        Case(
            "r_huge_n",
            "replica",
            "/v1/complete",
            b'{"session_id": "s", "prompt": "x", "n": 1000000000}',
            js,
        ),
    ]


def refresh_ids(body: bytes) -> tuple[bytes, list[str]]:
    """A valid body again with new event ids (so an accepted one is not a duplicate)."""
    doc = orjson.loads(body)
    for e in doc["events"]:
        e["event_id"] = uuid.uuid4().hex
    return orjson.dumps(doc), [e["event_id"] for e in doc["events"]]


# --- clients -------------------------------------------------------------------------------------
def valid_ingest(
    clock: Clock, tally: Tally, url: str, key: str, rate: float, batch: int, timeout: float
) -> None:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    client = httpx.Client(base_url=url, headers=headers, timeout=timeout)
    for _ in paced(clock, rate):
        events = feedback_events(batch)
        body = orjson.dumps({"events": events})
        phase = clock.phase
        outcome, status, resp, dt = classify(lambda: client.post("/v1/events", content=body))
        tally.record("ingest", phase, "valid", outcome, status, dt)
        if resp is not None and resp.status_code == 202:
            with tally.lock:
                tally.acked_events.update(e["event_id"] for e in events)
        if resp is None:  # a broken connection: start a new one
            client.close()
            client = httpx.Client(base_url=url, headers=headers, timeout=timeout)
    client.close()


def valid_complete(clock: Clock, tally: Tally, url: str, rate: float, timeout: float) -> None:
    client = httpx.Client(base_url=url, timeout=timeout)
    for i, _ in enumerate(paced(clock, rate)):
        body = {
            "session_id": f"soak-{i % 50}",
            "prompt": "def add(a, b):\n    ",
            "max_tokens": 8,
            "temperature": 0.8,
        }
        phase = clock.phase
        outcome, status, resp, dt = classify(lambda: client.post("/v1/complete", json=body))
        tally.record("complete", phase, "valid", outcome, status, dt)
        if resp is not None and resp.status_code == 200:
            with tally.lock:
                tally.acked_generations.update(c["request_id"] for c in resp.json()["completions"])
        if resp is None:
            client.close()
            client = httpx.Client(base_url=url, timeout=timeout)
    client.close()


def invalid_client(
    clock: Clock,
    tally: Tally,
    urls: dict[str, str],
    cases: list[Case],
    start: int,
    rate: float,
    timeout: float,
) -> None:
    clients = {t: httpx.Client(base_url=u, timeout=timeout) for t, u in urls.items()}
    order = itertools.cycle(cases[start:] + cases[:start])
    for _ in paced(clock, rate, active=clock.hostile):
        case = next(order)
        body, ids = refresh_ids(case.body) if case.fresh_ids else (case.body, [])
        client = clients[case.target]
        phase = clock.phase
        outcome, status, resp, _ = classify(
            lambda: client.post(case.path, content=body, headers=case.headers)
        )
        tally.record(f"invalid→{case.target}", phase, case.name, outcome, status, None)
        if resp is not None and resp.status_code == 202 and ids:
            with tally.lock:
                tally.acked_events.update(ids)
        if resp is None:
            client.close()
            clients[case.target] = httpx.Client(base_url=urls[case.target], timeout=timeout)
    for c in clients.values():
        c.close()


def _slow_open(host: str, port: int, mode: str, path: str, key: str) -> socket.socket:
    s = socket.create_connection((host, port), timeout=5)
    if mode == "head":
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode())
    else:
        s.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + '{"events": ['
            ).encode()
        )
    s.setblocking(False)
    return s


def slow_client(
    clock: Clock,
    tally: Tally,
    targets: list[tuple[str, str, int, str]],
    key: str,
    conns: int,
    hold_s: float,
    trickle_s: float,
) -> None:
    """Keep `conns` half-sent requests open, one byte every `trickle_s`, each up to `hold_s`."""
    live: list[tuple[socket.socket, str, str, float]] = []
    pick = itertools.cycle([(t, m) for t in targets for m in ("head", "body")])

    def close(entry, outcome: str) -> None:
        s, name, mode, t0 = entry
        with tally.lock:
            tally.slow[name, mode, outcome] += 1
            if outcome == "closed_by_server":
                tally.slow_held_s.append(time.monotonic() - t0)
        s.close()

    while not clock.stop.is_set():
        if not clock.hostile.is_set():
            for entry in live:
                close(entry, "held_to_phase_end")
            live = []
            clock.hostile.wait(0.2)
            continue
        while len(live) < conns:
            (name, host, port, path), mode = next(pick)
            try:
                live.append((_slow_open(host, port, mode, path, key), name, mode, time.monotonic()))
            except OSError:
                with tally.lock:
                    tally.slow[name, mode, "connect_failed"] += 1
                break
        keep = []
        for entry in live:
            s, _, mode, t0 = entry
            readable, _, _ = select.select([s], [], [], 0)
            if readable:  # the server answered (408/400/413) or closed: it enforces a limit
                close(entry, "closed_by_server")
                continue
            if time.monotonic() - t0 > hold_s:
                close(entry, "held_to_bound")
                continue
            try:
                s.send(b"a" if mode == "head" else b" ")
                keep.append(entry)
            except OSError:
                close(entry, "closed_by_server")
        live = keep
        clock.stop.wait(trickle_s)
    for entry in live:
        close(entry, "held_to_phase_end")


# --- the stack -----------------------------------------------------------------------------------
def register_tiny_policy(settings, console) -> None:
    """Version 1 of a tiny policy in MLflow as the trainer ships it, announced as champion."""
    from tests.integration.replica.conftest import Registered, publish_deployment
    from tests.unit.replica.conftest import TINY, tiny_state

    reg = Registered(
        settings.mlflow_uri, settings.model_name, {**TINY, "init_seed": 0}, anchor_every=8
    )
    reg.add(tiny_state(0)[1])
    publish_deployment(settings, "version_registered", "1")
    publish_deployment(settings, "promoted", "1")
    console.print(f"registered {settings.model_name} v1 (tiny policy) and promoted it")


def read_back(settings, timeout_s: float = 180.0) -> tuple[set[str], set[str]]:
    """(event_ids, generation request_ids) on the interactions topic, read to its end offsets."""
    from kafka import TopicPartition

    from app.infra.kafka import make_consumer

    consumer = make_consumer(settings, group_id=None)
    events, generations = set(), set()
    try:
        topic = settings.topic("interactions")
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to {end} within {timeout_s}s")
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    e = json.loads(r.value)
                    events.add(e.get("event_id"))
                    if e.get("type") == "generation":
                        generations.add(e.get("request_id"))
    finally:
        consumer.close()
    return events, generations


# --- report --------------------------------------------------------------------------------------
def report(
    console, tally: Tally, rss: dict[str, dict[str, float]], lost: dict[str, int], args
) -> None:
    from rich.table import Table

    t = Table(title="requests per client kind and phase")
    for col in ("client", "phase", *OUTCOMES, "p50 ms", "p99 ms"):
        t.add_column(col, justify="left" if col in ("client", "phase") else "right")
    kinds = sorted({k for k, _, _ in tally.outcomes}, key=lambda k: (k.startswith("invalid"), k))
    for kind in kinds:
        for phase in PHASES:
            row = [tally.outcomes[kind, phase, o] for o in OUTCOMES]
            if not any(row):
                continue
            lat = tally.latencies.get((kind, phase), [])
            t.add_row(
                kind,
                phase,
                *map(str, row),
                f"{percentile(lat, 0.5) * 1e3:.1f}" if lat else "-",
                f"{percentile(lat, 0.99) * 1e3:.1f}" if lat else "-",
            )
    console.print(t)

    c = Table(title="hostile cases (soak phase): answers")
    c.add_column("client")
    c.add_column("case")
    c.add_column("answers (status or error: count)")
    by_case: dict[tuple[str, str], list[str]] = {}
    for (kind, case, status), n in sorted(tally.statuses.items()):
        if kind.startswith("invalid"):
            by_case.setdefault((kind, case), []).append(f"{status}: {n}")
    for (kind, case), answers in by_case.items():
        c.add_row(kind, case, ", ".join(answers))
    console.print(c)

    s = Table(
        title=f"slow connections (one byte every {args.slow_trickle:g} s, client bound {args.slow_hold:g} s)"
    )
    for col in (
        "target",
        "mode",
        "closed_by_server",
        "held_to_bound",
        "held_to_phase_end",
        "connect_failed",
    ):
        s.add_column(col, justify="left" if col in ("target", "mode") else "right")
    for name, mode in sorted({(n, m) for n, m, _ in tally.slow}):
        s.add_row(
            name,
            mode,
            *(
                str(tally.slow[name, mode, o])
                for o in (
                    "closed_by_server",
                    "held_to_bound",
                    "held_to_phase_end",
                    "connect_failed",
                )
            ),
        )
    console.print(s)
    if tally.slow_held_s:
        console.print(
            f"server-closed slow connections lived p50 {percentile(tally.slow_held_s, 0.5):.1f} s, "
            f"max {max(tally.slow_held_s):.1f} s"
        )

    for role, r in rss.items():
        console.print(f"RSS {role}: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in r.items()))
    summary = []
    for kind in ("ingest", "complete"):
        base, soak = (
            tally.latencies.get((kind, "baseline"), []),
            tally.latencies.get((kind, "soak"), []),
        )
        if base and soak:
            b99, s99 = percentile(base, 0.99), percentile(soak, 0.99)
            console.print(
                f"{kind}: valid clients' p99 {s99 * 1e3:.1f} ms under the soak vs {b99 * 1e3:.1f} ms "
                f"baseline: ratio {s99 / b99:.2f}x"
            )
            summary.append(f"{kind}_p99_ratio={s99 / b99:.3f}")
        elif (
            tally.outcomes[kind, "baseline", "accepted"] or tally.outcomes[kind, "soak", "accepted"]
        ):
            console.print(f"{kind}: no accepted requests in one of the phases; no p99 ratio")
    totals = {o: sum(n for (k, _, oo), n in tally.outcomes.items() if oo == o) for o in OUTCOMES}
    console.print(
        f"acknowledged: {len(tally.acked_events)} events (API), {len(tally.acked_generations)} generations "
        f"(replica); lost: {lost['events']} events, {lost['generations']} generations"
        + (" [green](none)[/green]" if not any(lost.values()) else " [red]LOST[/red]")
    )
    print(
        "RESULT "
        + " ".join(
            [f"{k}={v}" for k, v in totals.items()]
            + summary
            + [
                f"lost_events={lost['events']}",
                f"lost_generations={lost['generations']}",
                f"slow_closed_by_server={sum(n for (_, _, o), n in tally.slow.items() if o == 'closed_by_server')}",
                f"slow_held_to_bound={sum(n for (_, _, o), n in tally.slow.items() if o == 'held_to_bound')}",
                *(f"rss_{role}_mib={r['before']:.0f}->{r['after']:.0f}" for role, r in rss.items()),
            ]
        )
    )


# --- main ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--baseline", type=float, default=30.0, help="seconds of the valid clients alone, before"
    )
    ap.add_argument(
        "--duration",
        type=float,
        default=180.0,
        help="seconds of the soak (valid + hostile clients)",
    )
    ap.add_argument(
        "--recovery", type=float, default=30.0, help="seconds of the valid clients alone, after"
    )
    ap.add_argument("--quick", action="store_true", help="10 s + 40 s + 10 s")
    ap.add_argument(
        "--no-replica",
        dest="replica",
        action="store_false",
        help="the API alone (no MLflow server, no replica)",
    )
    ap.add_argument(
        "--valid-clients", type=int, default=4, help="paced ingest clients (10-event batches)"
    )
    ap.add_argument(
        "--valid-rate", type=float, default=10.0, help="requests/s of each valid ingest client"
    )
    ap.add_argument(
        "--complete-rate", type=float, default=4.0, help="requests/s of the valid replica client"
    )
    ap.add_argument("--invalid-clients", type=int, default=3)
    ap.add_argument(
        "--invalid-rate", type=float, default=4.0, help="requests/s of each invalid client"
    )
    ap.add_argument("--slow-clients", type=int, default=2, help="threads of slow connections")
    ap.add_argument(
        "--slow-conns", type=int, default=24, help="connections each slow thread keeps open"
    )
    ap.add_argument(
        "--slow-hold", type=float, default=30.0, help="the longest a slow connection is held (s)"
    )
    ap.add_argument(
        "--slow-trickle", type=float, default=2.0, help="seconds between a slow client's bytes"
    )
    ap.add_argument(
        "--timeout", type=float, default=30.0, help="request timeout: no answer by then = hung"
    )
    ap.add_argument(
        "--kafka", default=None, help="reuse this Kafka bootstrap instead of starting a broker"
    )
    args = ap.parse_args()
    if args.quick:
        args.baseline, args.duration, args.recovery, args.slow_hold = 10.0, 40.0, 10.0, 15.0

    from rich.console import Console

    from app.db.keys import create_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope
    from app.infra.broker import LocalKafka, ensure_topics
    from app.settings import Settings
    from tests.conftest import free_port

    console = Console(width=None if sys.stdout.isatty() else 140)
    procs: dict[str, object] = {}
    with local_services(
        kafka=args.kafka,
        mlflow_uri=None if args.replica else "",
        console=console,
        prefix="flywheel-soak-",
    ) as (bootstrap, mlflow_uri, work):
        try:
            settings = Settings(
                data_dir=work / "data",
                kafka_bootstrap=bootstrap,
                mlflow_uri=mlflow_uri or "http://127.0.0.1:9",
                topic_namespace=f"soak{uuid.uuid4().hex[:8]}",
                model_name=f"soak-policy-{uuid.uuid4().hex[:6]}",
            )
            settings.data_dir.mkdir(parents=True)
            ensure_topics(settings)
            upgrade(settings.db_url)
            with session_scope(settings.db_url) as session:
                key, _ = create_key(session, ["ingest"], name="soak")
            env = dict(
                os.environ,
                FLYWHEEL_DATA_DIR=str(settings.data_dir),
                FLYWHEEL_KAFKA_BOOTSTRAP=bootstrap,
                FLYWHEEL_TOPIC_NAMESPACE=settings.topic_namespace,
                FLYWHEEL_MLFLOW_URI=settings.mlflow_uri,
                FLYWHEEL_MODEL_NAME=settings.model_name,
            )
            api_port = free_port()
            with console.status("starting flywheel api..."):
                procs["api"] = start_role(
                    [
                        sys.executable,
                        "-m",
                        "app.cli",
                        "api",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(api_port),
                    ],
                    env,
                    work / "api.log",
                    f"http://127.0.0.1:{api_port}/readyz",
                )
            urls = {"api": f"http://127.0.0.1:{api_port}"}
            slow_targets = [("api", "127.0.0.1", api_port, "/v1/events")]
            if args.replica:
                with console.status("registering a tiny policy, starting flywheel replica..."):
                    register_tiny_policy(settings, console)
                    rport = free_port()
                    procs["replica"] = start_role(
                        [
                            sys.executable,
                            "-m",
                            "app.cli",
                            "replica",
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(rport),
                            "--replica-id",
                            "soak-r1",
                        ],
                        {**env, "FLYWHEEL_REPLICA_CACHE_DIR": str(work / "cache")},
                        work / "replica.log",
                        f"http://127.0.0.1:{rport}/readyz",
                        timeout_s=300,
                    )
                urls["replica"] = f"http://127.0.0.1:{rport}"
                slow_targets.append(("replica", "127.0.0.1", rport, "/v1/complete"))
            broker_pid = LocalKafka(home=work / "kafka").pid() if args.kafka is None else None
            pids = {
                **{name: p.pid for name, p in procs.items()},
                **({"kafka": broker_pid} if broker_pid else {}),
            }
            return run_phases(console, args, settings, key, urls, slow_targets, pids, work)
        finally:
            for p in procs.values():
                stop_role(p)


def run_phases(
    console,
    args,
    settings,
    key: str,
    urls: dict[str, str],
    slow_targets,
    pids: dict[str, int],
    work: Path,
) -> int:
    cases = [c for c in hostile_cases(key) if c.target in urls]
    clock, tally = Clock(), Tally()
    threads = [
        threading.Thread(
            target=valid_ingest,
            args=(clock, tally, urls["api"], key, args.valid_rate, 10, args.timeout),
            name=f"valid-{i}",
            daemon=True,
        )
        for i in range(args.valid_clients)
    ]
    if "replica" in urls:
        threads.append(
            threading.Thread(
                target=valid_complete,
                args=(clock, tally, urls["replica"], args.complete_rate, args.timeout),
                name="complete",
                daemon=True,
            )
        )
    threads += [
        threading.Thread(
            target=invalid_client,
            args=(
                clock,
                tally,
                urls,
                cases,
                i * len(cases) // max(1, args.invalid_clients),
                args.invalid_rate,
                args.timeout,
            ),
            name=f"invalid-{i}",
            daemon=True,
        )
        for i in range(args.invalid_clients)
    ]
    threads += [
        threading.Thread(
            target=slow_client,
            args=(
                clock,
                tally,
                slow_targets,
                key,
                args.slow_conns,
                args.slow_hold,
                args.slow_trickle,
            ),
            name=f"slow-{i}",
            daemon=True,
        )
        for i in range(args.slow_clients)
    ]
    console.print(
        f"{args.valid_clients} valid ingest clients x {args.valid_rate:g} req/s (10 events each)"
        + (f", 1 completion client x {args.complete_rate:g} req/s" if "replica" in urls else "")
        + f"; soak adds {args.invalid_clients} invalid clients x {args.invalid_rate:g} req/s over "
        f"{len(cases)} cases and {args.slow_clients}x{args.slow_conns} slow connections"
    )
    with console.status("waiting for the servers to finish their start-up work..."):
        httpx.post(
            f"{urls['api']}/v1/events",
            content=orjson.dumps({"events": feedback_events(1)}),
            timeout=60,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        for role in ("api", "replica"):
            if role in pids:
                wait_idle(pids[role])
    rss = {role: {"before": rss_mib(pid)} for role, pid in pids.items()}
    for t in threads:
        t.start()
    for phase, seconds in (
        ("warmup", 5.0),
        ("baseline", args.baseline),
        ("soak", args.duration),
        ("recovery", args.recovery),
    ):
        clock.phase = phase
        (clock.hostile.set if phase == "soak" else clock.hostile.clear)()
        with console.status(f"{phase}: {seconds:.0f} s..."):
            time.sleep(seconds)
        if phase == "soak":
            for role, pid in pids.items():
                rss[role]["after soak"] = rss_mib(pid)
    clock.stop.set()
    deadline = time.monotonic() + args.timeout + 10
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        console.print(f"[red]client threads still blocked after their bound: {stuck}[/red]")
    for role, pid in pids.items():
        rss[role]["after"] = rss_mib(pid)
    with console.status("reading the interactions topic back..."):
        on_topic, generations = read_back(settings)
    with tally.lock:
        lost = {
            "events": len(tally.acked_events - on_topic),
            "generations": len(tally.acked_generations - generations),
        }
    report(console, tally, rss, lost, args)
    console.print(f"logs in {work}")
    return 1 if any(lost.values()) or stuck else 0


if __name__ == "__main__":
    sys.exit(main())
