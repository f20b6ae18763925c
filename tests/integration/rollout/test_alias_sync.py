"""Regression: MLflow's `champion` alias follows the deployment state even when a decision undoes an
MLflow-UI move before the controller's next tick.

Found by bench/rollback.py: champion v2, an operator moves it to v1 in MLflow (folded as
`alias_changed`), and a rollback to v2 arrives before the next tick. The controller's cache of
what it last wrote to MLflow still said (v2, none), so it skipped the sync and MLflow kept
showing v1 while every replica served v2. The controller is driven step by step here (no
threads, no clock), on the real MLflow server and Kafka broker.

    .venv/bin/pytest tests/integration/rollout/test_alias_sync.py -q
"""

from __future__ import annotations

import uuid

import pytest

from app.controller.config import ControllerSettings
from app.controller.controller import Controller
from app.controller.reconciler import reconcile_once
from app.controller.state import Decision

pytestmark = pytest.mark.integration


def test_champion_alias_is_resynced_when_a_decision_undoes_a_ui_move_before_the_next_tick(make_settings, mlflow_server,
                                                                                          tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    model = f"alias-sync-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(model)
    run = client.create_run(client.create_experiment(f"exp-{model}"))
    (tmp_path / "w.txt").write_text("weights")
    client.log_artifact(run.info.run_id, str(tmp_path / "w.txt"), artifact_path="w")
    for _ in range(2):
        client.create_model_version(model, source=f"{run.info.artifact_uri}/w", run_id=run.info.run_id)
    settings = make_settings(model_name=model, mlflow_uri=mlflow_server.uri)
    ctl = Controller(settings, ControllerSettings(webhooks_enabled=False, metrics_port=0), client)
    ctl.caught_up = True
    try:
        def event(type_: str, version: str, frm: str | None = None) -> None:
            ctl.on_deployment(Decision(type=type_, version=version, from_version=frm, traffic_pct=100.0,
                                       source="api", actor="test").to_event(model))

        event("promoted", "1")
        event("promoted", "2", "1")
        ctl.tick()
        assert dict(client.get_registered_model(model).aliases) == {"champion": "2"}

        client.set_registered_model_alias(model, "champion", "1")  # the operator's move in the MLflow UI
        [moved] = reconcile_once(client, model, lambda ev: None, via="poll")  # what the poller publishes
        ctl.on_deployment(moved)
        assert ctl.state.champion == "1"
        event("rolled_back", "2", "1")  # before the next tick: the state is back where the controller last synced
        ctl.tick()
        assert ctl.state.champion == "2"
        assert dict(client.get_registered_model(model).aliases) == {"champion": "2"}, \
            "MLflow's champion alias must follow the state (it was left on the UI move's version)"
    finally:
        ctl.dlog.close()
