"""The offline gate on the real stack: a NaN checkpoint and a corrupted (blown-up) one are stopped
(`gate_failed`), never get the `candidate` alias, and no replica ever serves them.

    .venv/bin/pytest tests/integration/rollout/test_gate.py -q -s
"""

from __future__ import annotations

import time

import pytest

from tests.integration.rollout.stack import (
    CANARY_SESSION,
    CHAMPION_SESSION,
    blown_up,
    wait_for,
    with_nan,
)

pytestmark = pytest.mark.integration


def test_nan_and_corrupted_checkpoints_are_stopped_by_the_gate_and_never_served(rollout_stack):
    stack = rollout_stack()
    v1 = stack.bootstrap_champion()
    base = stack.versions.states[v1]
    t0 = time.monotonic()
    # one at a time: the controller gates the newest registered version without a verdict, and a
    # version registered before its predecessor's gate started supersedes it (run_gates)
    v_nan = stack.versions.add(with_nan(base), parent=v1)
    wait_for(
        lambda: v_nan in {e["version"] for e in stack.history(type="gate_failed")},
        240,
        "the NaN version's gate_failed",
    )
    v_big = stack.versions.add(blown_up(base), parent=v1)

    failed = wait_for(
        lambda: (
            {e["version"]: e for e in stack.history(type="gate_failed")}.keys() >= {v_nan, v_big}
            and {e["version"]: e for e in stack.history(type="gate_failed")}
        ),
        240,
        "two gate_failed events",
    )
    print(
        f"\nNaN and blown-up checkpoints registered -> gate_failed in the status API: {time.monotonic() - t0:.1f}s"
    )
    checks = {
        v: {c["name"]: c["status"] for c in failed[v]["details"]["checks"]} for v in (v_nan, v_big)
    }
    assert checks[v_nan]["weights_finite"] == "fail", checks[v_nan]
    assert checks[v_big]["weights_finite"] == "pass" and checks[v_big]["weight_change"] == "fail", (
        checks[v_big]
    )
    assert (
        "weights_finite" in failed[v_nan]["reason"] and "weight_change" in failed[v_big]["reason"]
    )
    assert all(failed[v]["source"] == "controller" for v in (v_nan, v_big))
    for v in (v_nan, v_big):
        tags = stack.client.get_model_version(stack.model, v).tags
        assert tags["flywheel.gate.status"] == "failed", tags
        assert stack.model_version(v)["rollout"]["status"] == "gate_failed"
        assert stack.model_version(v)["gate"]["passed"] is False

    time.sleep(3)  # several controller ticks and replica polls after the verdicts
    assert stack.log_events("canary_started") == [], (
        "a version that failed the gate is never canaried"
    )
    assert stack.aliases() == {"champion": v1}, "and never gets the candidate alias"
    st = stack.status()
    assert (st["champion"], st["candidate"], st["phase"]) == (v1, None, "idle"), st
    assert stack.serving() == [(v1, None, 0.0)] * 2
    for session in (CANARY_SESSION, CHAMPION_SESSION, "s-1", "s-2", "s-3"):
        assert {stack.complete(i, session)["model_version"] for i in range(2)} == {v1}
    synced = {
        e["version"]
        for e in stack.log_events()
        if e["type"] in ("replica_synced", "replica_sync_failed")
    }
    assert synced == {v1}, f"replicas only ever loaded the champion, not {synced - {v1}}"
    for i in range(2):
        assert stack.replica_status(i)["desired"] == {
            "champion": v1,
            "candidate": None,
            "traffic_pct": 0.0,
        }
