"""The controller loop on the real broker and MLflow server: a better candidate walks every step
and is promoted, a worse one is rolled back automatically, aliases follow, a UI move is obeyed; a
controller started again with a step running restarts the step instead of pausing it."""

from __future__ import annotations

import threading
import time

import pytest

from app.contracts.aliases import read_snapshot
from app.contracts.deployments import Decision
from app.controller.config import ControllerSettings
from app.controller.controller import Controller
from app.controller.gate import GateResult
from app.controller.monitors import Check
from tests.integration.controller.conftest import deployment_events, wait_for
from tests.integration.rollout.stack import (
    MetricsFeed as Feeder,
)  # publishes version-metrics like streams/

pytestmark = pytest.mark.integration


def gate(version, champion):
    """The test's gate verdicts (the real gate is unit-tested on real policies in tests/unit/controller)."""
    return GateResult([Check("synthetic", "pass", detail=f"v{version} vs champion {champion}")])


def fast_settings() -> ControllerSettings:
    """Steps of half a second, a 600 s deadline, a tick every 0.2 s; no webhooks, no metrics port."""
    return ControllerSettings(
        min_step=0.5,
        min_samples=50,
        step_deadline=600,
        tick_interval=0.2,
        poll_interval=0.5,
        webhooks_enabled=False,
        metrics_port=0,
    )


def register(settings, *versions: str) -> None:
    """The trainer's version_registered events for `versions`, on the deployment log."""
    from app.contracts.deployments import DeploymentEvent, DeploymentLog

    with DeploymentLog(settings) as dlog:
        for v in versions:
            dlog.publish(
                DeploymentEvent.model_validate(
                    Decision(
                        type="version_registered", version=v, source="trainer", actor="trainer"
                    ).to_event(settings.model_name)
                )
            )


def types(settings, since=0):
    return [(e["type"], e["version"], e["traffic_pct"]) for e in deployment_events(settings)][
        since:
    ]


def test_better_candidate_promoted_worse_rolled_back_ui_move_obeyed(registry, make_settings):
    client, model = registry.client, registry.model
    settings = make_settings(model_name=model, mlflow_uri=client.tracking_uri)
    cs = fast_settings()
    ctl = Controller(
        settings, cs, client, gate=gate, background_gate=True
    )  # as `flywheel controller` runs it
    stop = threading.Event()
    ready = threading.Event()
    th = threading.Thread(target=ctl.run, args=(stop, ready.set), daemon=True)
    th.start()
    feed = Feeder(settings)
    try:
        assert ready.wait(60), "controller did not catch up"
        register(settings, "1", "2")
        wait_for(lambda: ("canary_started", "2", 5.0) in types(settings), 30, "canary of v2")
        assert ("promoted", "1", 100.0) in types(settings), (
            "the first gated version becomes champion"
        )
        wait_for(
            lambda: read_snapshot(client, model).aliases == {"champion": "1", "candidate": "2"},
            30,
            "aliases 1/2",
        )

        def better():  # candidate 0.7 vs champion 0.3 in every fresh bucket until promoted
            feed.bucket("2", 100, 0.7)
            feed.bucket("1", 100, 0.3)
            return ("promoted", "2", 100.0) in types(settings)

        wait_for(better, 90, "promotion of v2", every=0.5)
        steps = [
            t for t in types(settings) if t[1] == "2" and t[0] in ("traffic_shifted", "promoted")
        ]
        assert steps == [
            ("traffic_shifted", "2", 25.0),
            ("traffic_shifted", "2", 50.0),
            ("promoted", "2", 100.0),
        ]
        wait_for(
            lambda: read_snapshot(client, model).aliases == {"champion": "2", "candidate": None},
            30,
            "champion alias on 2",
        )

        register(settings, "3")
        wait_for(lambda: ("canary_started", "3", 5.0) in types(settings), 30, "canary of v3")

        def worse():
            feed.bucket("3", 100, 0.0)
            feed.bucket("2", 100, 0.8)
            return any(t[0] == "rolled_back" for t in types(settings))

        wait_for(worse, 90, "automatic rollback of v3", every=0.5)
        [rb] = [e for e in deployment_events(settings) if e["type"] == "rolled_back"]
        assert (rb["version"], rb["from_version"], rb["source"]) == ("2", "3", "controller")
        assert (
            rb["details"]["analysis"]["verdict"] == "worse"
            and rb["details"]["analysis"]["upper"] < -cs.margin
        )
        wait_for(
            lambda: read_snapshot(client, model).aliases == {"champion": "2", "candidate": None},
            30,
            "candidate alias removed",
        )
        assert ctl.state.failed == ["3"] and ctl.state.known_good == ["1", "2"]

        # an operator moves champion back to 1 in the MLflow UI; the poller reports it, the controller obeys
        client.set_registered_model_alias(model, "champion", "1")
        wait_for(lambda: ctl.state.champion == "1", 30, "controller to take champion 1")
        [ac] = [e for e in deployment_events(settings) if e["type"] == "alias_changed"]
        assert (ac["version"], ac["from_version"], ac["source"]) == ("1", "2", "mlflow-ui")
        time.sleep(2)  # several ticks: the controller must not move the alias back
        assert read_snapshot(client, model).aliases["champion"] == "1"
    finally:
        stop.set()
        th.join(30)
        feed.producer.close()
    assert not th.is_alive()


def test_a_controller_started_again_restarts_the_running_step_instead_of_pausing_it(
    registry, make_settings
):
    client, model = registry.client, registry.model
    settings = make_settings(model_name=model, mlflow_uri=client.tracking_uri)
    cs = fast_settings()
    down = 1300.0  # the second controller starts 1,300 s later: past the step's 600 s deadline

    def start(clock):
        ctl = Controller(settings, cs, client, gate=gate, clock=clock)
        stop, ready = threading.Event(), threading.Event()
        th = threading.Thread(target=ctl.run, args=(stop, ready.set), daemon=True)
        th.start()
        assert ready.wait(60), "controller did not catch up"
        return ctl, stop, th

    ctl, stop, th = start(time.time)
    try:
        register(settings, "1", "2")
        wait_for(lambda: ("canary_started", "2", 5.0) in types(settings), 30, "canary of v2")
    finally:
        stop.set()
        th.join(30)
    assert not th.is_alive()
    assert ctl.state.phase == "canary" and not any(
        e["type"] == "canary_resumed" for e in deployment_events(settings)
    ), "a controller that saw the step start does not restart it"

    ctl, stop, th = start(lambda: time.time() + down)
    feed = Feeder(settings)
    try:
        [r] = wait_for(
            lambda: [e for e in deployment_events(settings) if e["type"] == "canary_resumed"],
            30,
            "the step's restart",
        )
        assert (r["version"], r["source"], r["traffic_pct"]) == ("2", "controller", 5.0)
        assert r["details"]["step_restart"] is True and r["details"]["step"] == 0
        assert ctl.state.phase == "canary"
        assert ctl.state.step_started_at.timestamp() >= time.time() + down - 60

        def judged():  # buckets on the second controller's clock, candidate 0.7 vs champion 0.3
            feed.bucket("2", 100, 0.7, at=time.time() + down)
            feed.bucket("1", 100, 0.3, at=time.time() + down)
            return ("traffic_shifted", "2", 25.0) in types(settings)

        wait_for(judged, 60, "v2's restarted step to pass", every=0.5)
        assert "canary_paused" not in [t[0] for t in types(settings)]
    finally:
        stop.set()
        th.join(30)
        feed.producer.close()
    assert not th.is_alive()
