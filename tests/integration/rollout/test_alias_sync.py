"""MLflow's `champion` alias follows the deployment state even when a decision undoes an
MLflow-UI move before the controller's next tick.

The case (it arises in `python -m bench.rollback`): champion v2, an operator moves it to v1 in
MLflow (folded as `alias_changed`), and a rollback to v2 arrives before the next tick. The
controller's cache of what it last wrote to MLflow still says (v2, none); if it trusted that cache
it would skip the sync, and MLflow would keep showing v1 while every replica serves v2. The
controller is driven step by step here (no threads, no clock), on the real MLflow server and
Kafka broker.

    .venv/bin/pytest tests/integration/rollout/test_alias_sync.py -q
"""

from __future__ import annotations

import uuid

import pytest

from app.contracts.deployments import Decision
from app.controller.config import ControllerSettings
from app.controller.controller import Controller
from app.registry.reconcile import reconcile_once

pytestmark = pytest.mark.integration


def model_with_two_versions(mlflow_server, tmp_path, prefix: str):
    """A new registered model with versions 1 and 2 (one logged artifact) on the real MLflow server."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    model = f"{prefix}-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(model)
    run = client.create_run(client.create_experiment(f"exp-{model}"))
    (tmp_path / "w.txt").write_text("weights")
    client.log_artifact(run.info.run_id, str(tmp_path / "w.txt"), artifact_path="w")
    for _ in range(2):
        client.create_model_version(
            model, source=f"{run.info.artifact_uri}/w", run_id=run.info.run_id
        )
    return client, model


def test_champion_alias_is_resynced_when_a_decision_undoes_a_ui_move_before_the_next_tick(
    make_settings, mlflow_server, tmp_path
):
    client, model = model_with_two_versions(mlflow_server, tmp_path, "alias-sync")
    settings = make_settings(model_name=model, mlflow_uri=mlflow_server.uri)
    ctl = Controller(settings, ControllerSettings(webhooks_enabled=False, metrics_port=0), client)
    ctl.caught_up = True
    try:

        def event(type_: str, version: str, frm: str | None = None) -> None:
            ctl.on_deployment(
                Decision(
                    type=type_,
                    version=version,
                    from_version=frm,
                    traffic_pct=100.0,
                    source="api",
                    actor="test",
                ).to_event(model)
            )

        event("promoted", "1")
        event("promoted", "2", "1")
        ctl.tick()
        assert dict(client.get_registered_model(model).aliases) == {"champion": "2"}

        client.set_registered_model_alias(
            model, "champion", "1"
        )  # the operator's move in the MLflow UI
        [moved] = reconcile_once(
            client, model, lambda ev: None, via="poll"
        )  # what the poller publishes
        ctl.on_deployment(moved)
        assert ctl.state.champion == "1"
        event(
            "rolled_back", "2", "1"
        )  # before the next tick: the state is back where the controller last synced
        ctl.tick()
        assert ctl.state.champion == "2"
        assert dict(client.get_registered_model(model).aliases) == {"champion": "2"}, (
            "MLflow's champion alias must follow the state (it was left on the UI move's version)"
        )
    finally:
        ctl.dlog.close()


def test_a_reader_between_flywheel_s_tag_write_and_alias_move_reports_nothing_an_outside_move_it_reports(
    mlflow_server, tmp_path
):
    """sync_aliases writes the acknowledged tag, then moves the alias. A webhook receiver or poller in
    another process reading in between must not take that for an operator's move; a real move in
    MLflow (alias moved, tag untouched) must still be reported."""
    import threading
    import time

    from app.contracts.aliases import TAG_PREFIX, read_snapshot, sync_aliases

    client, model = model_with_two_versions(mlflow_server, tmp_path, "alias-settle")
    sync_aliases(client, model, {"champion": "1"})

    # Flywheel's own move to 2, paused between its two calls (the tag says 2, the alias still 1)
    client.set_registered_model_tag(model, TAG_PREFIX + "champion", "2")
    published = []
    reader = threading.Thread(
        target=lambda: published.extend(
            reconcile_once(client, model, published.append, via="webhook")
        )
    )
    reader.start()
    time.sleep(0.1)  # the reader has seen the half-done move
    client.set_registered_model_alias(model, "champion", "2")  # the move completes
    client.set_registered_model_tag(
        model, "flywheel.alias.seq", str(read_snapshot(client, model).seq + 1)
    )
    reader.join(10)
    assert published == [], f"a move in progress was reported as an outside move: {published}"
    assert read_snapshot(client, model).acked["champion"] == "2"

    client.set_registered_model_alias(model, "champion", "1")  # an operator's move in the MLflow UI
    events = reconcile_once(client, model, lambda ev: None, via="poll")
    assert [
        (e["type"], e["version"], e["from_version"], e["details"]["alias"]) for e in events
    ] == [("alias_changed", "1", "2", "champion")]
    assert read_snapshot(client, model).acked["champion"] == "1", (
        "the reported move is acknowledged"
    )


class _ReadersBetweenWrites:
    """An MlflowClient after each of whose alias and tag writes another process looks at the
    aliases, as the API's webhook receiver or a poller does (app/registry/reconcile.py):

    - `settling`: a reader with the real settle time starts (a thread, no lock: another process);
      what it would report is kept in `settled`;
    - `catching`: the differences between aliases and acknowledged tags are kept in
      `transients`; one about the candidate alias is reported at once, as by a reader whose
      settle time is over before the rest of the move happened (a slow server), into `caught`."""

    WRITES = (
        "set_registered_model_alias",
        "delete_registered_model_alias",
        "set_registered_model_tag",
        "delete_registered_model_tag",
    )

    def __init__(self, client, model: str):
        self._client, self._model = client, model
        self.mode: str | None = None
        self.settled: list = []
        self.transients: list = []
        self.caught: list[dict] = []
        self.threads: list = []

    def __getattr__(self, name: str):
        import threading

        from app.contracts.aliases import detect_moves, read_snapshot
        from app.registry.reconcile import settled_moves

        attr = getattr(self._client, name)
        if name not in self.WRITES:
            return attr

        def write(*args, **kwargs):
            out = attr(*args, **kwargs)
            if self.mode == "settling":
                th = threading.Thread(
                    target=lambda: self.settled.extend(settled_moves(self._client, self._model))
                )
                th.start()
                self.threads.append(th)
            elif self.mode == "catching":
                moves = detect_moves(read_snapshot(self._client, self._model))
                self.transients += moves
                if any(m.alias == "candidate" for m in moves):
                    self.caught += reconcile_once(
                        self._client, self._model, lambda ev: None, via="webhook", settle_s=0
                    )
            return out

        return write


def test_a_promotion_produces_no_alias_changed_event(make_settings, mlflow_server, tmp_path):
    """Promoting the candidate moves `champion` to it and removes `candidate`: no alias_changed
    event follows. Readers in other processes see Flywheel's move as its own; a reader that
    catches it half-done and reports it (its settle time over mid-move) sees at worst the
    candidate alias already removed, which the controller does not answer. (With the tag
    removed before the alias it saw `candidate` on the new champion, which the controller
    answered with an `alias_changed` "alias restored".)"""
    from app.contracts.aliases import read_snapshot
    from app.registry.reconcile import settled_moves

    client, model = model_with_two_versions(mlflow_server, tmp_path, "alias-promote")
    run_id = client.get_model_version(model, "1").run_id
    client.create_model_version(
        model, source=client.get_model_version(model, "1").source, run_id=run_id
    )
    settings = make_settings(model_name=model, mlflow_uri=mlflow_server.uri)
    readers = _ReadersBetweenWrites(client, model)
    ctl = Controller(settings, ControllerSettings(webhooks_enabled=False, metrics_port=0), readers)
    ctl.caught_up = True
    published: list[dict] = []
    publish = ctl.publish
    ctl.publish = lambda events: (published.extend(events), publish(events))
    try:

        def decide(type_: str, version: str, frm: str | None, traffic: float) -> None:
            ctl.on_deployment(
                Decision(
                    type=type_, version=version, from_version=frm, traffic_pct=traffic
                ).to_event(model)
            )

        def promote(candidate: str, champion: str, mode: str) -> None:
            decide("canary_started", candidate, champion, 5.0)
            ctl.sync_mlflow()
            assert dict(client.get_registered_model(model).aliases) == {
                "champion": champion,
                "candidate": candidate,
            }
            decide("promoted", candidate, champion, 100.0)
            readers.mode = mode
            ctl.sync_mlflow()
            readers.mode = None
            assert dict(client.get_registered_model(model).aliases) == {"champion": candidate}

        decide("promoted", "1", None, 100.0)
        ctl.sync_mlflow()

        promote("2", "1", "settling")
        for th in readers.threads:
            th.join(30)
        assert readers.settled == [], (
            f"Flywheel's promotion read as an outside move: {readers.settled}"
        )

        promote("3", "2", "catching")
        on_candidate = [m for m in readers.transients if m.alias == "candidate"]
        assert on_candidate and all(m.to_version is None for m in on_candidate), (
            f"half-done, the promotion showed the candidate alias on a version: {on_candidate}"
        )
        assert [(e["details"]["alias"], e["version"]) for e in readers.caught] == [
            ("candidate", None)
        ], readers.caught
        for ev in readers.caught:  # the controller consumes what the reader published
            ctl.on_deployment(ev)
        ctl.sync_mlflow()

        answers = [
            e for e in published if e["type"] == "alias_changed" and e["source"] != "mlflow-ui"
        ]
        assert answers == [], f"promotions were followed by alias_changed answers: {answers}"
        assert (ctl.state.champion, ctl.state.candidate) == ("3", None)
        assert dict(client.get_registered_model(model).aliases) == {"champion": "3"}
        assert settled_moves(client, model, settle_s=0) == []
        assert read_snapshot(client, model).acked == {"champion": "3", "candidate": None}
    finally:
        ctl.dlog.close()
