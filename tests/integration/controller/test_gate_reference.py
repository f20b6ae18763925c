"""The gate's weight-change check compares a version with its nearest ancestor that did not fail
the gate: a child trained past a rejected (e.g. corrupted) checkpoint is judged on its own."""

from __future__ import annotations

import pytest

from app.controller.gate import GateConfig
from app.controller.gate_io import GateRunner
from app.settings import Settings

pytestmark = pytest.mark.integration


def test_weight_change_reference_skips_parents_that_failed_the_gate(registry, mlflow_server):
    client, model, (v1, v2, v3) = registry.client, registry.model, registry.versions
    client.set_model_version_tag(model, v2, "parent_version", v1)
    client.set_model_version_tag(model, v3, "parent_version", v2)
    runner = GateRunner(Settings(mlflow_uri=mlflow_server.uri), client, GateConfig(), n_rollouts=0)

    assert runner.reference_version(model, {"parent_version": v2}) == v2, (
        "a parent that passed is the reference"
    )
    client.set_model_version_tag(model, v2, "flywheel.gate.status", "failed")
    assert runner.reference_version(model, {"parent_version": v2}) == v1, (
        "a failed parent is skipped"
    )
    client.delete_model_version_tag(model, v2, "flywheel.gate.status")
    client.set_model_version_tag(model, v2, "planted_bad", "true")
    assert runner.reference_version(model, {"parent_version": v2}) == v1, (
        "a planted bad parent is skipped, gated or not (a newer version can supersede it)"
    )
    client.set_model_version_tag(model, v1, "flywheel.gate.status", "failed")
    assert runner.reference_version(model, {"parent_version": v2}) is None, (
        "no passing ancestor: no reference"
    )
    assert runner.reference_version(model, {"parent_version": "none"}) is None
