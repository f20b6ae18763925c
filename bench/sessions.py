"""Benchmark of the session ledger: one streams worker, chat sessions beside one-call generations.

On one real broker, through ONE `python -m streams.worker` process, in one run:
  1. single-call burst: N one-call generations (no `turn`), each with one feedback event
     -> rollouts/s (first produce to the last rollout's record time on `<ns>.rollouts`);
  2. session burst: S sessions of T turns (N = S x T generation events, the same token lists
     as phase 1: each turn's prompt is the previous prompt + completion + 4 "tool result"
     tokens, so turns extend exactly; one tools_digest per session; one feedback on one turn;
     a session_outcome naming the last turn) -> turns/s and sessions/s (first produce to the
     last segment record) and the ratio session turns/s / single-call rollouts/s;
  3. live: sessions started at a steady rate, their turns `--turn-gap` apart, each turn's
     one-call twin sent at the same moment: latency at a load the worker keeps up with.

Latency. A session **closes** at the later of (a) its outcome's record time on
`<ns>.interactions` and (b) its last turn's label close = that generation's record time + the
wait window; its latency is the segment's record time on `<ns>.rollouts` minus its close.
A one-call rollout's latency is its record time minus (generation record time + window), as
in bench/streams.py. In a burst the latencies include the backlog's queueing; the live phase
gives the floor (ticks: FLYWHEEL_STREAMS_TICK_INTERVAL, SKEW_MARGIN).

Every session must come out as exactly one record of T turns closed by `end` with its
outcome; the bench fails otherwise. It also prints the worker's own counters
(flywheel_streams_segments_total, flywheel_streams_ledger_events_total) and its log's errors.

    .venv/bin/python -m bench.sessions              # 5000 sessions x 8 turns; ~75 s on 2 cores
    .venv/bin/python -m bench.sessions --quick      # 300 x 8, 6 s live
    .venv/bin/python -m bench.sessions --bootstrap 127.0.0.1:9092 --sessions 4000 --turns 16
"""

from __future__ import annotations

import argparse
import hashlib
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from bench.common import REPO, percentile

console = Console(width=130)
TOOL_RESULT = 4  # context tokens between turns (a tool's answer), mask 0 in the segment


# --- events (pure) -------------------------------------------------------------------------------
@dataclass
class Workload:
    """One phase's events: the session path's and its one-call twins', with what to check."""

    prefix: str
    turns: int
    session_events: list[dict[str, Any]] = field(default_factory=list)  # produce order
    call_events: list[dict[str, Any]] = field(default_factory=list)  # produce order
    # (session index, turn) of each event above: the live phase's schedule
    session_slots: list[tuple[int, int]] = field(default_factory=list)
    call_slots: list[tuple[int, int]] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)  # session id -> outcome

    @property
    def sessions(self) -> int:
        return len(self.outcomes)

    @property
    def generations(self) -> int:
        return sum(e["type"] == "generation" for e in self.session_events)


def session_turns(
    turns: int, rng: random.Random, prompt0: int = 48
) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) per turn: each prompt is the previous prompt + completion + a tool
    result of TOOL_RESULT tokens, so every turn extends the one before it exactly."""
    prompt, out = [rng.randrange(256) for _ in range(prompt0)], []
    for _ in range(turns):
        completion = [rng.randrange(256) for _ in range(rng.randint(16, 48))]
        out.append((prompt, completion))
        prompt = [*prompt, *completion, *(rng.randrange(256) for _ in range(TOOL_RESULT))]
    return out


def build_workload(prefix: str, sessions: int, turns: int, seed: int = 0) -> Workload:
    """`sessions` sessions of `turns` chat turns and, for every turn, a one-call twin (same
    tokens, its own request and session id, no `turn`) with one feedback event. Both are in
    turn-major order (every session's turn 0, then turn 1, ...): concurrent agents."""
    from tests.unit.streams.factories import generation, random_feedback

    rng, w = random.Random(seed), Workload(prefix, turns)
    plans = {f"{prefix}-s{j}": session_turns(turns, rng) for j in range(sessions)}
    fb_turn = {sid: rng.randrange(turns) for sid in plans}
    for k in range(turns):
        for j, (sid, plan) in enumerate(plans.items()):
            prompt, completion = plan[k]
            lp = [round(-rng.random() * 2, 4) for _ in completion]
            tok = {"prompt_tokens": prompt, "completion_tokens": completion, "logprobs": lp}
            rid, digest = f"{sid}-t{k}", hashlib.sha256(sid.encode()).hexdigest()
            sess = [generation(rid, session_id=sid, turn=k, tools_digest=digest, **tok)]
            if fb_turn[sid] == k:
                sess.append(random_feedback(rng, rid, f"{rid}-f") | {"session_id": sid})
            if k == turns - 1:
                w.outcomes[sid] = rng.choice(("success", "failure", "abandoned"))
                sess.append(outcome_event(sid, rid, w.outcomes[sid]))
            crid = f"{prefix}-c{j}-{k}"
            calls = [generation(crid, **tok), random_feedback(rng, crid, f"{crid}-f")]
            w.session_events += sess
            w.call_events += calls
            w.session_slots += [(j, k)] * len(sess)
            w.call_slots += [(j, k)] * len(calls)
    return w


def outcome_event(sid: str, last_rid: str, outcome: str) -> dict[str, Any]:
    from tests.unit.streams.factories import ts

    return {
        "type": "session_outcome",
        "event_id": f"{sid}-outcome",
        "request_id": last_rid,
        "session_id": sid,
        "ts": ts(0.0),
        "outcome": outcome,
    }


# --- stats and checks (pure) ---------------------------------------------------------------------
@dataclass(frozen=True)
class Latency:
    """Seconds from a close to the record on `<ns>.rollouts`, over `n` records."""

    n: int
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, xs: list[float]) -> Latency:
        return cls(
            len(xs), percentile(xs, 0.5), percentile(xs, 0.99), max(xs) if xs else float("nan")
        )


def session_close(outcome_ts: float, last_turn_ts: float, window: float) -> float:
    """When a session can end: the later of its outcome's record time and its last turn's
    label close (generation record time + wait window). Seconds."""
    return max(outcome_ts, last_turn_ts + window)


def check_sessions(w: Workload, records: dict[str, list[dict[str, Any]]]) -> list[str]:
    """What is wrong with the session records (session id -> its records on `<ns>.rollouts`):
    each session must be exactly one record of `w.turns` turns, closed by `end`, with its outcome."""
    bad = []
    for sid, outcome in w.outcomes.items():
        recs = records.get(sid, [])
        if len(recs) != 1:
            how = [(r.get("segment_closed_by"), len(r.get("turns") or [r])) for r in recs]
            bad.append(f"{sid}: {len(recs)} records (closed_by, turns): {how}")
            continue
        r = recs[0]
        n = len(r.get("turns") or [r])  # a one-turn segment has no `turns`
        if n != w.turns or r.get("segment_closed_by") != "end" or r.get("outcome") != outcome:
            bad.append(
                f"{sid}: {n} turns (want {w.turns}), closed_by {r.get('segment_closed_by')}, "
                f"outcome {r.get('outcome')} (want {outcome})"
            )
    return bad


def counters(text: str, name: str) -> dict[str, float]:
    """A Prometheus counter's samples in `text` (exposition format), by their labels joined ','."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 sessions, 6 s live phase")
    ap.add_argument("--bootstrap", help="use this broker instead of starting an embedded one")
    ap.add_argument("--sessions", type=int, help="burst sessions (default 5000, quick 300)")
    ap.add_argument("--turns", type=int, default=8, help="turns per session")
    ap.add_argument("--window", type=float, default=1.0, help="wait window, seconds")
    ap.add_argument("--idle", type=float, default=600.0, help="FLYWHEEL_STREAMS_SESSION_IDLE, s")
    ap.add_argument("--live-seconds", type=float, help="live phase length (default 15, quick 6)")
    ap.add_argument("--live-rate", type=float, default=20.0, help="live: sessions started per s")
    ap.add_argument("--turn-gap", type=float, default=0.2, help="live: seconds between turns")
    ap.add_argument("--profile", metavar="FILE", help="cProfile the worker's event loop into FILE")
    args = ap.parse_args(argv)
    args.sessions = args.sessions or (300 if args.quick else 5000)
    args.live_seconds = args.live_seconds or (6.0 if args.quick else 15.0)
    assert args.turns >= 1 and args.sessions >= 1, f"need turns, sessions >= 1: {args}"
    assert args.idle > 4 * args.window, (
        f"--idle {args.idle} must outlast the window: sessions end by outcome"
    )
    return args


# --- the run (broker, worker, topics) ------------------------------------------------------------
@dataclass
class Run:
    """The broker-facing state of one run: settings, the worker, a producer, the rollouts read so far."""

    settings: Any
    window: float
    port: int  # the worker's metrics port
    worker: subprocess.Popen
    log: Path
    prod: Any = None
    cons: Any = None
    by_rid: dict[str, list[tuple[float, dict]]] = field(default_factory=dict)
    by_sid: dict[str, list[tuple[float, dict]]] = field(default_factory=dict)

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text

    def cpu(self) -> float:
        return sum(counters(self.metrics(), "process_cpu_seconds_total").values())

    def poll(self, timeout_ms: int = 200) -> None:
        """Read what `<ns>.rollouts` has that this run has not read yet."""
        for recs in self.cons.poll(timeout_ms=timeout_ms, max_records=5000).values():
            for r in recs:
                v = orjson.loads(r.value)
                item = (r.timestamp / 1000.0, v)
                self.by_rid.setdefault(v["request_id"], []).append(item)
                self.by_sid.setdefault(v["session_id"], []).append(item)

    def send(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        """Produce `events` keyed by request_id; the futures of generations (by request_id) and
        outcomes (by event_id)."""
        topic, fut = self.settings.topic("interactions"), {}
        for ev in events:
            f = self.prod.send(topic, key=ev["request_id"].encode(), value=orjson.dumps(ev))
            if ev["type"] == "generation":
                fut[ev["request_id"]] = f
            elif ev["type"] == "session_outcome":
                fut[ev["event_id"]] = f
        return fut

    def wait(self, done, total: int, what: str, timeout: float = 600.0) -> None:
        """Poll the rollouts until `done()` (a count) reaches `total`, showing progress."""
        deadline = time.monotonic() + timeout
        with console.status(what) as status:
            while (n := done()) < total:
                if time.monotonic() > deadline or self.worker.poll() is not None:
                    raise SystemExit(f"{what}: {n}/{total} after {timeout:.0f} s; see {self.log}")
                status.update(f"{what}: {n}/{total}")
                self.poll()


def record_times(futures: dict[str, Any]) -> dict[str, float]:
    return {k: f.get(timeout=60).timestamp / 1000.0 for k, f in futures.items()}


@dataclass(frozen=True)
class PathResult:
    """One path through the worker: how many generations, its wall and CPU time, latencies."""

    generations: int
    sessions: int
    wall_s: float  # first produce -> last record on <ns>.rollouts
    cpu_s: float  # the worker's CPU over the phase
    produce_s: float  # first produce -> the producer flushed (it shares the cores)
    latency: Latency

    @property
    def rate(self) -> float:
        return self.generations / self.wall_s


def call_latencies(run: Run, w: Workload, times: dict[str, float]) -> list[float]:
    gens = [e["request_id"] for e in w.call_events if e["type"] == "generation"]
    return [run.by_rid[rid][0][0] - (times[rid] + run.window) for rid in gens]


def session_latencies(run: Run, w: Workload, times: dict[str, float]) -> list[float]:
    out = []
    for sid in w.outcomes:
        close = session_close(times[f"{sid}-outcome"], times[f"{sid}-t{w.turns - 1}"], run.window)
        out.append(run.by_sid[sid][0][0] - close)
    return out


def burst(run: Run, w: Workload, path: str) -> PathResult:
    """Produce one path's events as fast as possible and time them out of the worker."""
    calls = path == "calls"
    events = w.call_events if calls else w.session_events
    rids = [e["request_id"] for e in w.call_events if e["type"] == "generation"]
    cpu0, t0 = run.cpu(), time.time()
    with console.status(f"{path}: producing {len(events)} events..."):
        fut = run.send(events)
        run.prod.flush()
    produced = time.time() - t0
    if calls:
        run.wait(lambda: sum(r in run.by_rid for r in rids), len(rids), "single-call rollouts")
        last = max(run.by_rid[r][0][0] for r in rids)
        lat = call_latencies(run, w, record_times(fut))
    else:
        run.wait(lambda: sum(s in run.by_sid for s in w.outcomes), w.sessions, "session records")
        last = max(run.by_sid[s][0][0] for s in w.outcomes)
        lat = session_latencies(run, w, record_times(fut))
    return PathResult(
        w.generations,
        0 if calls else w.sessions,
        last - t0,
        run.cpu() - cpu0,
        produced,
        Latency.of(lat),
    )


def live(run: Run, w: Workload, rate: float, gap: float) -> tuple[Latency, Latency]:
    """Session j starts at j / rate, its turn k at + k * gap; each turn's one-call twin is sent at
    the same moment. The one-call and the session latencies."""
    plan = [
        ((j / rate + k * gap), i, e)
        for i, ((j, k), e) in enumerate(
            [*zip(w.session_slots, w.session_events), *zip(w.call_slots, w.call_events)]
        )
    ]
    plan.sort(key=lambda x: (x[0], x[1]))
    fut: dict[str, Any] = {}
    t0, end = time.perf_counter(), plan[-1][0]
    with console.status("live traffic...") as status:
        for at, _, ev in plan:
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            fut |= run.send([ev])
            status.update(f"live traffic: {at:.1f}/{end:.1f} s")
            run.poll(0)
        run.prod.flush()
    rids = [e["request_id"] for e in w.call_events if e["type"] == "generation"]
    run.wait(lambda: sum(r in run.by_rid for r in rids), len(rids), "live single-call rollouts")
    run.wait(lambda: sum(s in run.by_sid for s in w.outcomes), w.sessions, "live session records")
    times = record_times(fut)
    return Latency.of(call_latencies(run, w, times)), Latency.of(session_latencies(run, w, times))


def start_worker(
    stack: Any, idle: float, log: Path, profile: str | None = None
) -> tuple[subprocess.Popen, int]:
    """`python -m streams.worker` on the stack, sessions ending by their outcome; waits for /metrics."""
    import httpx

    from bench.streams import free_port

    port = free_port()
    env = stack.env(port) | {
        "FLYWHEEL_STREAMS_SESSION_IDLE": f"{idle:g}",
        "FLYWHEEL_STREAMS_SESSION_RETENTION": f"{max(3600.0, idle):g}",
    }
    if profile:  # streams/worker.py writes it at exit
        env["FLYWHEEL_STREAMS_PROFILE"] = str(Path(profile).resolve())
    proc = subprocess.Popen(
        [sys.executable, "-m", "streams.worker"],
        cwd=REPO,
        env=env,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    with console.status("starting the streams worker..."):
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"the worker exited with {proc.returncode}; see {log}")
            try:
                httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
                return proc, port
            except httpx.HTTPError:
                time.sleep(0.2)
    raise SystemExit(f"the worker's metrics never answered; see {log}")


def log_problems(log: Path) -> list[str]:
    """Lines of the worker's log that say something went wrong."""
    words = ("Traceback", "ERROR", "Error", "WARNING", "Exception")
    return [
        ln for ln in log.read_text(errors="replace").splitlines() if any(w in ln for w in words)
    ]


def report(args, calls: PathResult, sess: PathResult, live_lat, cnt, problems, log) -> dict:
    """Print the run's table and return its figures."""
    import os

    ratio, cpu_ratio = (
        sess.rate / calls.rate,
        (sess.generations / sess.cpu_s) / (calls.generations / calls.cpu_s),
    )
    console.print(
        f"[bold]session ledger benchmark[/bold] ({args.sessions} sessions x {args.turns} turns = "
        f"{sess.generations} generations per path; window {args.window:g} s, session idle "
        f"{args.idle:g} s; 1 worker, 3 partitions, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})"
    )
    console.print(
        f"  {'path':34s} {'gens/s':>8s} {'sess/s':>7s} {'wall s':>7s} {'produce s':>9s} {'gens/CPU-s':>10s}   latency p50 / p99 / max (s)"
    )
    for name, r in (
        ("single-call (1 feedback each)", calls),
        (f"sessions ({args.turns} turns, 1 fb, outcome)", sess),
    ):
        sps = f"{r.sessions / r.wall_s:7.1f}" if r.sessions else f"{'':7s}"
        console.print(
            f"  {name:34s} {r.rate:8.0f} {sps} {r.wall_s:7.2f} {r.produce_s:9.2f} {r.generations / r.cpu_s:10.0f}   "
            f"{r.latency.p50:.3f} / {r.latency.p99:.3f} / {r.latency.max:.3f}"
        )
    console.print(
        f"  ratio session turns/s / single-call rollouts/s: {ratio:.2f}x wall, {cpu_ratio:.2f}x per worker CPU-s"
    )
    (lc, ls) = live_lat
    console.print(
        f"  live ({args.live_rate:g} sessions/s, turns {args.turn_gap:g} s apart, each turn's one-call twin beside): "
        f"one-call p50 {lc.p50:.3f} / p99 {lc.p99:.3f} s ({lc.n}); session p50 {ls.p50:.3f} / p99 {ls.p99:.3f} s ({ls.n})"
    )
    console.print(
        "  latency: one-call = rollout record time - (generation record time + window); session = segment "
        "record time - close, close = max(outcome record time, last turn's record time + window)"
    )
    for name, vals in cnt.items():
        console.print(
            f"  {name}: " + ", ".join(f"{k or '-'} {v:g}" for k, v in sorted(vals.items()))
        )
    console.print(f"  worker log: {len(problems)} error/warning lines ({log})")
    for ln in problems[:10]:
        console.print(f"    {ln[:200]}")
    return {
        "calls": calls,
        "sessions": sess,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "live": live_lat,
        "counters": cnt,
        "log_problems": problems,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from app.infra.kafka import make_consumer, make_producer
    from bench.streams import Stack, bench_settings, start_broker, stop
    from streams.app import ensure_internal_topics

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-sessions-"))
    broker = None if args.bootstrap else start_broker(tmp)
    bootstrap = args.bootstrap or broker.bootstrap
    stack = Stack(bench_settings(bootstrap, tmp, args.window), bootstrap, tmp, args.window)
    worker = None
    try:
        with console.status("creating topics and building events..."):
            ensure_internal_topics(stack.settings)
            warm = build_workload("warm", 20, args.turns, seed=1)
            work = build_workload("b", args.sessions, args.turns, seed=2)
            n_live = max(1, int(args.live_rate * args.live_seconds))
            livew = build_workload("live", n_live, args.turns, seed=3)
        worker, port = start_worker(stack, args.idle, tmp / "worker.log", args.profile)
        run = Run(stack.settings, args.window, port, worker, tmp / "worker.log")
        run.prod = make_producer(stack.settings, key_serializer=None)
        run.cons = make_consumer(stack.settings, stack.settings.topic("rollouts"), group_id=None)
        burst(run, warm, "calls"), burst(run, warm, "sessions")  # assignment, first batches
        calls = burst(run, work, "calls")
        sess = burst(run, work, "sessions")
        live_lat = live(run, livew, args.live_rate, args.turn_gap)
        text = run.metrics()
        cnt = {
            n: counters(text, n)
            for n in ("flywheel_streams_segments_total", "flywheel_streams_ledger_events_total")
        }
        bad = [
            p
            for w in (warm, work, livew)
            for p in check_sessions(
                w, {s: [v for _, v in run.by_sid.get(s, [])] for s in w.outcomes}
            )
        ]
        dup = sum(
            len(v) > 1
            for w in (warm, work, livew)
            for e in w.call_events
            if e["type"] == "generation" and (v := run.by_rid.get(e["request_id"]))
        )
    finally:
        stop(worker)
        if broker is not None:
            broker.stop()
    figures = report(
        args, calls, sess, live_lat, cnt, log_problems(tmp / "worker.log"), tmp / "worker.log"
    )
    total = warm.sessions + work.sessions + livew.sessions
    if bad or dup:
        console.print(
            f"[red]FAILED[/red]: {len(bad)} sessions wrong, {dup} one-call rollouts repeated"
        )
        for p in bad[:20]:
            console.print(f"  {p}")
        raise SystemExit(1)
    console.print(
        f"  check: OK, each of {total} sessions is one record of {args.turns} turns closed by end with its outcome"
    )
    return figures


if __name__ == "__main__":
    main()
