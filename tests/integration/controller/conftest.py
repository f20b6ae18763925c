"""Fixtures for the controller's integration tests: a registered model with tiny versions on the
real MLflow server, and the real API app served by uvicorn on a free port."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.waiting import poll


@dataclass
class Registry:
    client: MlflowClient  # noqa: F821
    model: str
    versions: list[str]


@pytest.fixture()
def registry(mlflow_server, tmp_path: Path) -> Registry:
    """A fresh registered model with three versions whose artifacts are a few bytes each."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    model = f"policy-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(model)
    exp = client.create_experiment(f"exp-{model}")
    versions = []
    for i in range(3):
        run = client.create_run(exp)
        f = tmp_path / f"weights-{i}.txt"
        f.write_text(f"dummy weights {i}")
        mlflow.set_tracking_uri(mlflow_server.uri)
        client.log_artifact(run.info.run_id, str(f), artifact_path="weights")
        client.set_terminated(run.info.run_id)
        mv = client.create_model_version(
            model, source=f"{run.info.artifact_uri}/weights", run_id=run.info.run_id
        )
        versions.append(mv.version)
    return Registry(client, model, versions)


class ApiServer:
    def __init__(self, settings):
        import uvicorn

        from app.api.main import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start within 30s"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture()
def api_server() -> Iterator[Callable[..., ApiServer]]:
    started: list[ApiServer] = []

    def _start(settings) -> ApiServer:
        srv = ApiServer(settings).start()
        started.append(srv)
        return srv

    yield _start
    for srv in started:
        srv.stop()


def wait_for(pred: Callable[[], object], timeout: float, what: str, every: float = 0.2) -> object:
    return poll(pred, timeout, what, every)


def deployment_events(settings) -> list[dict]:
    from app.contracts.deployments import DeploymentLog

    with DeploymentLog(settings) as dlog:
        return [le.event.model_dump(mode="json") for le in dlog.read(stall_timeout_s=20)]
