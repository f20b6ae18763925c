"""Canaries on the real stack: a better candidate walks every step and is promoted; a worse one is
rolled back automatically and both replicas go back to the champion.

Asserted through the replicas (`POST /v1/complete` names the version that answered) and the
status API (`GET /v1/deployments`, `/v1/deployments/history`, `/v1/models/{v}`). The online
metrics are synthetic `flywheel.version-metrics` buckets (what streams/ publishes).

    .venv/bin/pytest tests/integration/rollout/test_canary.py -q -s
"""

from __future__ import annotations

import time

import pytest

from tests.integration.rollout.stack import CANARY_SESSION, CHAMPION_SESSION, nudged, wait_for

pytestmark = pytest.mark.integration


def answered_by(stack, session: str) -> set[str]:
    """The versions both replicas answer `session` with."""
    return {stack.complete(i, session)["model_version"] for i in range(len(stack.replicas))}


def start_canary(stack) -> tuple[str, str]:
    """Champion v1 served, v2 (one small training step away) gated and in canary at 5 % on both replicas."""
    t0 = time.monotonic()
    v1 = stack.bootstrap_champion()
    print(
        f"\nbase version registered -> gated -> promoted -> served by both replicas: {time.monotonic() - t0:.1f}s"
    )
    assert answered_by(stack, CANARY_SESSION) == {v1} and answered_by(stack, CHAMPION_SESSION) == {
        v1
    }
    t0 = time.monotonic()
    v2 = stack.versions.add(nudged(stack.versions.states[v1], seed=1), parent=v1)
    stack.wait_serving(v1, v2, 5.0, timeout=240)
    print(
        f"candidate registered -> gated -> canary 5% on both replicas: {time.monotonic() - t0:.1f}s"
    )
    assert answered_by(stack, CANARY_SESSION) == {v2}, "canary sessions are served by the candidate"
    assert answered_by(stack, CHAMPION_SESSION) == {v1}, "other sessions stay on the champion"
    st = wait_for(
        lambda: (s := stack.status()).get("candidate") == v2 and s,
        30,
        "status API to show the canary",
    )
    assert (st["champion"], st["phase"], st["traffic"]["candidate_pct"]) == (v1, "canary", 5.0), st
    gate = stack.model_version(v2)["gate"]
    assert (
        gate["passed"] is True
        and {c["name"]: c["status"] for c in gate["checks"]}["kl_to_champion"] == "info"
    ), gate
    # the aliases move in the controller's tick right after it publishes the canary, which the status
    # projection may show first
    wait_for(lambda: stack.aliases() == {"champion": v1, "candidate": v2}, 30, "MLflow aliases 1/2")
    return v1, v2


def test_better_candidate_passes_every_step_and_is_promoted(rollout_stack):
    stack = rollout_stack()
    v1, v2 = start_canary(stack)
    seen_traffic: set[float] = set()
    t0 = time.monotonic()

    def better() -> (
        bool
    ):  # every fresh bucket: candidate 0.7 vs champion 0.3 (sd 0.5, 100 samples each)
        stack.feed.pair(v2, v1, 0.7, 0.3)
        seen_traffic.update(t for _, _, t in stack.serving())
        return stack.status().get("champion") == v2

    wait_for(better, 180, f"promotion of v{v2}", every=0.5)
    took = time.monotonic() - t0
    stack.wait_serving(v2, None, timeout=60)
    print(
        f"canary 5 -> 25 -> 50 -> promoted (3 s min per step) and served: {time.monotonic() - t0:.1f}s "
        f"(promotion decided after {took:.1f}s)"
    )
    assert answered_by(stack, CANARY_SESSION) == {v2} and answered_by(stack, CHAMPION_SESSION) == {
        v2
    }
    assert {25.0, 50.0} & seen_traffic, (
        f"the replicas applied the intermediate steps (saw {seen_traffic})"
    )

    st = stack.status()
    assert (st["champion"], st["candidate"], st["phase"], st["traffic"]["candidate_pct"]) == (
        v2,
        None,
        "idle",
        0.0,
    ), st
    assert (
        st["last_analysis"]["verdict"] == "better_or_equal" and st["last_analysis"]["delta"] > 0
    ), st["last_analysis"]
    steps = [
        (e["type"], e["traffic_pct"])
        for e in reversed(stack.history(version=v2))
        if e["type"] in ("canary_started", "traffic_shifted", "promoted")
    ]
    assert steps == [
        ("canary_started", 5.0),
        ("traffic_shifted", 25.0),
        ("traffic_shifted", 50.0),
        ("promoted", 100.0),
    ], steps
    promoted = stack.history(type="promoted", version=v2)[0]
    assert (promoted["source"], promoted["from_version"]) == ("controller", v1), promoted
    assert stack.model_version(v2)["rollout"]["status"] == "champion"
    assert stack.model_version(v1)["rollout"]["status"] == "retired"
    wait_for(
        lambda: stack.aliases() == {"champion": v2},
        30,
        "MLflow aliases to follow (candidate removed)",
    )
    replicas = wait_for(
        lambda: (
            len(
                rs := [
                    r
                    for r in stack.status()["replicas"]
                    if r["champion_version"] == v2 and r["candidate_version"] is None
                ]
            )
            == 2
            and rs
        ),
        30,
        "both replicas on v2 in the status API",
        every=0.5,
    )
    assert sorted(r["replica_id"] for r in replicas) == ["replica-1", "replica-2"], replicas
    assert {r["url"] for r in replicas} == {srv.url for srv in stack.replicas}, replicas


def test_worse_candidate_is_rolled_back_and_replicas_return_to_the_champion(rollout_stack):
    stack = rollout_stack()
    v1, v2 = start_canary(stack)
    t0 = time.monotonic()

    def worse() -> bool:  # candidate 0.0 vs champion 0.8
        stack.feed.pair(v2, v1, 0.0, 0.8)
        return any(e["type"] == "rolled_back" for e in stack.log_events())

    wait_for(worse, 120, f"automatic rollback of v{v2}", every=0.5)
    decided = time.monotonic() - t0
    stack.wait_serving(v1, None, timeout=60)
    print(
        f"worse candidate: rollback decided after {decided:.1f}s (3 s min step), "
        f"both replicas back on v{v1} after {time.monotonic() - t0:.1f}s"
    )
    for session in (CANARY_SESSION, CHAMPION_SESSION, "any-other-session"):
        assert answered_by(stack, session) == {v1}, f"{session} is served by the champion again"

    [rb] = wait_for(
        lambda: stack.history(type="rolled_back"), 30, "rolled_back in the status API history"
    )
    assert (rb["version"], rb["from_version"], rb["source"]) == (v1, v2, "controller"), rb
    assert "worse" in rb["reason"] and rb["details"]["analysis"]["verdict"] == "worse", rb
    st = wait_for(
        lambda: (s := stack.status()).get("candidate") is None and s,
        30,
        "status API to end the canary",
    )
    assert (st["champion"], st["phase"], st["traffic"]["candidate_pct"]) == (v1, "idle", 0.0), st
    assert stack.model_version(v2)["rollout"]["status"] == "rolled_back"
    wait_for(lambda: stack.aliases() == {"champion": v1}, 30, "candidate alias removed in MLflow")
    time.sleep(3)  # several controller ticks: a rolled-back version is never canaried again
    assert [e["version"] for e in stack.log_events("canary_started")] == [v2]
    assert stack.serving() == [(v1, None, 0.0)] * 2
