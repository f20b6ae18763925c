"""MLflow as a control surface on the real stack: moving `champion` back to an older version —
in the real MLflow UI (headless Debian Chromium driven by Playwright, tests/browser.py), with the
MLflow client call the UI makes, and with webhooks disabled (the polling reconciler alone) —
makes both replicas serve that version, and the status API and its history show the move with
source `mlflow-ui`.

    .venv/bin/pytest tests/integration/rollout/test_alias_moves.py -q -s
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.rollout.stack import CANARY_SESSION, CHAMPION_SESSION, nudged, wait_for

pytestmark = pytest.mark.integration


def champion_promoted_by_operator(stack) -> tuple[str, str]:
    """v1 served, v2 gated and in canary, then promoted by an operator through the API (skip_remaining)."""
    v1 = stack.bootstrap_champion()
    v2 = stack.versions.add(nudged(stack.versions.states[v1], seed=1), parent=v1)
    stack.wait_serving(v1, v2, 5.0, timeout=240)
    r = stack.verb("promote", reason="looks good to me", skip_remaining=True)
    assert r.status_code == 202, r.text
    assert [(e["type"], e["version"], e["source"]) for e in r.json()["events"]] == [
        ("promoted", v2, "api")
    ]
    stack.wait_serving(v2, None, timeout=60)
    wait_for(
        lambda: stack.aliases() == {"champion": v2},
        30,
        "MLflow aliases to follow the operator's promote",
    )
    return v1, v2


def assert_move_carried_out(stack, old: str, new: str, via: str, seconds: float) -> None:
    for session in (CANARY_SESSION, CHAMPION_SESSION):
        assert {stack.complete(i, session)["model_version"] for i in range(2)} == {new}, session
    [ev] = wait_for(
        lambda: stack.history(type="alias_changed"), 30, "alias_changed in the status API history"
    )
    assert (ev["version"], ev["from_version"], ev["source"], ev["actor"]) == (
        new,
        old,
        "mlflow-ui",
        "mlflow-ui",
    ), ev
    assert ev["details"]["alias"] == "champion" and ev["details"]["observed_via"] == via, ev
    assert f"moved to version {new}" in ev["reason"], ev["reason"]
    st = wait_for(
        lambda: (s := stack.status()).get("champion") == new and s, 30, "status API champion"
    )
    assert (st["candidate"], st["phase"]) == (None, "idle"), st
    assert stack.model_version(new)["rollout"]["is_champion"] is True
    reps = wait_for(
        lambda: (
            len(rs := [r for r in stack.status()["replicas"] if r["champion_version"] == new]) == 2
            and rs
        ),
        30,
        "both replicas in the status API on the new champion",
        every=0.5,
    )
    assert sorted(r["replica_id"] for r in reps) == ["replica-1", "replica-2"], reps
    time.sleep(2)  # several controller ticks: the controller must not move the alias back
    assert stack.aliases() == {"champion": new}
    assert stack.serving() == [(new, None, 0.0)] * 2
    print(
        f"\nchampion v{old} -> v{new} via {via}: both replicas serving v{new} {seconds:.2f}s after the alias moved"
    )


def test_moving_champion_in_the_mlflow_ui_makes_both_replicas_serve_it(
    rollout_stack, tmp_path: Path
):
    from tests.browser import move_alias_in_ui

    stack = rollout_stack(
        poll_interval=600.0
    )  # the webhook must carry it: the poller waits 10 minutes
    v1, v2 = champion_promoted_by_operator(stack)
    t0 = time.monotonic()
    move = move_alias_in_ui(
        stack.settings.mlflow_uri, stack.model, "champion", v1, screenshot_dir=tmp_path / "ui"
    )
    assert (move.from_version, move.version, move.changed) == (v2, v1, True), move
    saved = time.monotonic()
    took = stack.wait_serving(v1, None, timeout=60)
    print(
        f"\nUI move in Chromium: {saved - t0:.1f}s (browser start + page + dialog); "
        f"replicas serving v{v1} {took:.2f}s after the UI showed the saved alias"
    )
    assert_move_carried_out(stack, v2, v1, "webhook", took)
    assert move.screenshots and move.screenshots[-1].read_bytes().startswith(b"\x89PNG"), (
        move.screenshots
    )


def test_moving_champion_with_the_mlflow_client_is_carried_out_by_the_webhook(rollout_stack):
    stack = rollout_stack(poll_interval=600.0)
    v1, v2 = champion_promoted_by_operator(stack)
    t0 = time.monotonic()
    stack.client.set_registered_model_alias(
        stack.model, "champion", v1
    )  # the registry call the UI's editor makes
    took = stack.wait_serving(v1, None, timeout=60)
    assert_move_carried_out(stack, v2, v1, "webhook", took)
    assert time.monotonic() - t0 < 600, "carried out long before the poller would have looked"


def test_with_webhooks_disabled_the_reconciler_alone_carries_out_the_move(rollout_stack):
    interval = 2.0
    stack = rollout_stack(webhooks_enabled=False, poll_interval=interval)
    assert stack._webhook_id is None
    assert not [
        w
        for w in stack.client.list_webhooks(max_results=100)
        if w.name == f"flywheel-{stack.model}"
    ]
    v1, v2 = champion_promoted_by_operator(stack)
    stack.client.set_registered_model_alias(stack.model, "champion", v1)
    took = stack.wait_serving(v1, None, timeout=interval + 30)
    assert_move_carried_out(stack, v2, v1, "poll", took)
    assert took <= interval + 10, f"poll interval {interval}s + 10s target; took {took:.2f}s"
