"""Time from a rollback trigger to every replica serving the target version, webhooks on and off.

    .venv/bin/python -m bench.rollback                 # 5 runs per trigger and mode
    .venv/bin/python -m bench.rollback --quick         # 2 runs
    .venv/bin/python -m bench.rollback --runs 10 --poll-interval 5 --kafka 127.0.0.1:9092 --mlflow http://127.0.0.1:5000

The stack is the one the rollout tests run on (tests/integration/rollout/stack.py), all real and
local: an embedded Kafka broker and an `mlflow server` (started here unless given), the API app
(webhook receiver, operator verbs) on a uvicorn port, the controller loop with its polling
reconciler, and 2 replicas (uvicorn, own verified weight caches) following the deployment log.
Versions are tiny policies registered with the trainer's code. The controller runs with its
default tick (2 s) and alias poll (5 s, `--poll-interval`); the offline gate is switched off
(`gate_enabled=false`) because it is not on any rollback path and would only slow the set-up.

Triggers, each timed from the trigger to the moment both replicas' `/v1/status` show the target
as champion with no candidate (polled every 50 ms), p50/p95 over `--runs`:
- `ui`: `champion` moved to the previous version with `MlflowClient.set_registered_model_alias`
  (the registry call the MLflow UI's alias editor makes) -> webhook (or poller) -> alias_changed;
- `api`: `POST /v1/deployments/rollback {"version": previous}` (admin key) -> rolled_back;
- `analysis`: a candidate in canary gets clearly worse version-metrics buckets once its minimum
  step time has passed -> the controller's next tick decides rolled_back automatically;
- `floor` (the baseline, side by side): the same rolled_back event published straight onto
  `flywheel.deployments` (no HTTP, no MLflow, no controller): what following the log and
  swapping to a cached version costs the replicas. Ratios are trigger time / floor p50.
Targets: <= 10 s with webhooks; <= poll interval + 10 s without. For scale: Flagger's
automatic rollback waits `interval x threshold` failed checks (1 min x 5 in its docs) = 5 min.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

TRIGGERS = ("ui", "api", "analysis", "floor")
FLAGGER_S = 60.0 * 5  # Flagger: analysis interval 1m x threshold 5 failed checks


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 runs per trigger and mode")
    p.add_argument(
        "--runs", type=int, default=None, help="runs per trigger and mode (default 5, quick 2)"
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=5.0,
        help="the controller's alias poll interval, s (default 5)",
    )
    p.add_argument(
        "--tick-interval",
        type=float,
        default=2.0,
        help="the controller's tick interval, s (default 2)",
    )
    p.add_argument("--modes", default="webhooks,polling", help="comma-separated: webhooks, polling")
    p.add_argument(
        "--kafka", default=None, help="reuse this Kafka bootstrap instead of starting a broker"
    )
    p.add_argument(
        "--mlflow", default=None, help="reuse this MLflow server URI instead of starting one"
    )
    args = p.parse_args()
    args.runs = args.runs or (2 if args.quick else 5)
    assert args.runs >= 1, f"--runs must be >= 1, got {args.runs}"
    return args


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def event_delay(stack, type_: str, version: str, wall0: float) -> float | None:
    """Seconds from wall0 to the newest `type_` event that targets `version` (its ts is the publisher's clock)."""
    evs = [e for e in stack.log_events(type_) if e["version"] == version]
    if not evs:
        return None
    return datetime.fromisoformat(evs[-1]["ts"].replace("Z", "+00:00")).timestamp() - wall0


def run_mode(
    webhooks: bool, args: argparse.Namespace, kafka: str, uri: str, work: Path, console
) -> dict[str, Any]:
    from app.contracts.deployments import DeploymentEvent, DeploymentLog
    from app.controller.config import ControllerSettings
    from app.infra.broker import ensure_topics
    from app.settings import Settings
    from tests.integration.rollout.stack import RolloutStack, nudged, tiny_policy_state, wait_for

    mode = "webhooks" if webhooks else "polling"
    tag = uuid.uuid4().hex[:6]
    settings = Settings(
        data_dir=work / f"data-{mode}",
        kafka_bootstrap=kafka,
        mlflow_uri=uri,
        topic_namespace=f"rb{tag}",
        model_name=f"bench-rollback-{mode}-{tag}",
        webhook_secret="bench-webhook-secret",
    )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    ensure_topics(settings)
    cs = ControllerSettings(
        min_step=2.0,
        min_samples=50,
        step_deadline=3600.0,
        tick_interval=args.tick_interval,
        poll_interval=args.poll_interval,
        webhooks_enabled=webhooks,
        metrics_port=0,
        gate_enabled=False,
    )
    stack = RolloutStack(settings, cs, work / f"stack-{mode}").start()
    times: dict[str, list[float]] = {t: [] for t in TRIGGERS}
    decided: dict[str, list[float]] = {t: [] for t in TRIGGERS}
    slack = args.poll_interval + 60.0
    try:
        console.print(
            f"{mode}: registering the champion history (v1 base, v2 promoted by an operator)…"
        )
        base = tiny_policy_state(0)
        v1 = stack.versions.add(base, kind="base")
        stack.wait_serving(v1, None, timeout=300)
        v2 = stack.versions.add(nudged(base, 1), parent=v1)
        stack.wait_serving(v1, v2, 5.0, timeout=300)
        r = stack.verb("promote", reason="bench set-up", skip_remaining=True)
        assert r.status_code == 202, r.text
        stack.wait_serving(v2, None, timeout=120)
        wait_for(
            lambda: stack.aliases() == {"champion": v2},
            120,
            "MLflow aliases after the operator's promote",
        )
        console.print(f"{mode}: uploading {args.runs} candidates for the failed-analysis runs…")
        candidates = [
            stack.versions.upload(nudged(base, 100 + i), parent=v1) for i in range(args.runs)
        ]

        def settled(champion: str) -> None:
            """The controller has also moved MLflow's aliases (it does so on its next tick, possibly after
            the replicas swapped): only then is a new move in the UI a move away from `champion`."""
            wait_for(
                lambda: stack.aliases() == {"champion": champion},
                slack,
                f"MLflow aliases {{champion: {champion}}}",
            )

        def ui_move(target: str, record: bool) -> None:
            if record:  # a random phase against the controller's poll and tick loops
                time.sleep(random.uniform(0.0, max(args.poll_interval, args.tick_interval)))
            wall0, t0 = time.time(), time.monotonic()
            stack.client.set_registered_model_alias(stack.model, "champion", target)
            stack.wait_serving(target, None, timeout=slack, every=0.05)
            if record:
                times["ui"].append(time.monotonic() - t0)
                decided["ui"].append(
                    event_delay(stack, "alias_changed", target, wall0) or float("nan")
                )
            settled(target)

        for i in range(args.runs):
            ui_move(v1, record=True)  # v2 -> v1 in "the UI"
            ui_move(v2, record=False)  # set-up for the next trigger

            time.sleep(random.uniform(0.0, args.tick_interval))
            wall0, t0 = time.time(), time.monotonic()
            r = stack.verb("rollback", reason=f"bench run {i}", version=v1)
            assert r.status_code == 202, r.text
            stack.wait_serving(v1, None, timeout=slack, every=0.05)
            times["api"].append(time.monotonic() - t0)
            decided["api"].append(event_delay(stack, "rolled_back", v1, wall0) or float("nan"))
            settled(v1)
            ui_move(v2, record=False)

            wall0, t0 = time.time(), time.monotonic()
            with DeploymentLog(settings) as dlog:
                dlog.publish(
                    DeploymentEvent(
                        type="rolled_back",
                        model=stack.model,
                        version=v1,
                        from_version=v2,
                        source="api",
                        actor="bench",
                        reason=f"bench floor run {i}",
                    )
                )
            stack.wait_serving(v1, None, timeout=slack, every=0.05)
            times["floor"].append(time.monotonic() - t0)
            decided["floor"].append(0.0)
            settled(v1)
            ui_move(v2, record=False)

            cand = candidates[i]
            stack.versions.announce(cand)
            stack.wait_serving(v2, cand, 5.0, timeout=300)
            # the step's minimum time has passed (the next analysis can decide); the random part keeps the
            # trigger from landing at the same phase of the controller's tick every run
            time.sleep(cs.min_step + random.uniform(0.0, args.tick_interval))
            wall0, t0 = time.time(), time.monotonic()
            stack.feed.pair(cand, v2, 0.0, 0.8, n=200)
            stack.wait_serving(v2, None, timeout=slack, every=0.05)
            times["analysis"].append(time.monotonic() - t0)
            decided["analysis"].append(event_delay(stack, "rolled_back", v2, wall0) or float("nan"))
            settled(v2)
            console.print(
                f"{mode}: run {i + 1}/{args.runs}: "
                + ", ".join(f"{t} {times[t][-1]:.2f}s" for t in TRIGGERS)
            )
    finally:
        stack.stop()
    return {"mode": mode, "times": times, "decided": decided}


def report(results: list[dict[str, Any]], args: argparse.Namespace, console) -> None:
    from rich.table import Table

    t = Table(
        title=f"rollback trigger -> both replicas serve the target ({args.runs} runs each; "
        f"poll {args.poll_interval:g}s, tick {args.tick_interval:g}s)"
    )
    for col in (
        "mode",
        "trigger",
        "decision p50",
        "replicas p50",
        "p95",
        "max",
        "vs floor",
        "target",
        "met",
    ):
        t.add_column(col, justify="right" if col not in ("mode", "trigger") else "left")
    for res in results:
        floor = statistics.median(res["times"]["floor"])
        for trig in TRIGGERS:
            xs = res["times"][trig]
            target = (
                10.0 if res["mode"] == "webhooks" or trig != "ui" else args.poll_interval + 10.0
            )
            p95 = percentile(xs, 95)
            dec = [d for d in res["decided"][trig] if d == d]
            t.add_row(
                res["mode"],
                trig,
                f"{statistics.median(dec):.2f}s" if dec else "-",
                f"{statistics.median(xs):.2f}s",
                f"{p95:.2f}s",
                f"{max(xs):.2f}s",
                f"{statistics.median(xs) / floor:.1f}x" if trig != "floor" else "1.0x",
                f"<= {target:g}s",
                "yes" if p95 <= target else "NO",
            )
    console.print(t)
    console.print(
        "decision = trigger -> the deciding event on flywheel.deployments (alias_changed / rolled_back); "
        "replicas = trigger -> both replicas serving the target."
    )
    console.print(
        f"For scale: Flagger's default automatic rollback needs interval x threshold failed checks "
        f"(1 min x 5) = {FLAGGER_S:.0f}s; the `analysis` p50 here is "
        + ", ".join(
            f"{FLAGGER_S / statistics.median(r['times']['analysis']):.0f}x faster ({r['mode']})"
            for r in results
        )
        + " (once the canary's minimum step time has passed)."
    )


def main() -> None:
    args = parse_args()
    import logging

    from rich.console import Console

    from bench.common import local_services

    logging.basicConfig(level=logging.WARNING)
    console = Console(width=150)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    assert set(modes) <= {"webhooks", "polling"} and modes, (
        f"--modes takes webhooks and/or polling, got {args.modes!r}"
    )
    with local_services(args.kafka, args.mlflow, console, prefix="flywheel-bench-rollback-") as (
        kafka,
        uri,
        work,
    ):
        results = [run_mode(m == "webhooks", args, kafka, uri, work, console) for m in modes]
    report(results, args, console)


if __name__ == "__main__":
    main()
