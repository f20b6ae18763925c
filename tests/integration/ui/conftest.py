"""Fixtures for the MLflow UI browser tests: a fresh registered model with three tiny versions on
the real MLflow server (`mlflow_server` from tests/conftest.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class UiModel:
    client: MlflowClient  # noqa: F821
    name: str
    versions: list[str]  # ["1", "2", "3"]


@pytest.fixture()
def ui_model(mlflow_server, tmp_path: Path) -> UiModel:
    """A registered model whose three versions point at a few bytes logged under one run."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    name = f"ui-policy-{uuid.uuid4().hex[:8]}"
    run = client.create_run(client.create_experiment(f"exp-{name}"))
    weights = tmp_path / "weights.txt"
    weights.write_text("dummy weights")
    client.log_artifact(run.info.run_id, str(weights), artifact_path="weights")
    client.set_terminated(run.info.run_id)
    client.create_registered_model(name)
    versions = [
        client.create_model_version(
            name, source=f"{run.info.artifact_uri}/weights", run_id=run.info.run_id
        ).version
        for _ in range(3)
    ]
    assert versions == ["1", "2", "3"], f"expected versions 1..3 of a fresh model, got {versions}"
    return UiModel(client, name, versions)
