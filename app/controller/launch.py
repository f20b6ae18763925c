"""Launcher of `flywheel controller`: build the parts from settings, serve metrics, run until SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading

from app.controller.config import ControllerSettings
from app.settings import Settings

log = logging.getLogger(__name__)


def run_controller(settings: Settings, cs: ControllerSettings) -> None:
    """Run `flywheel controller` with validated settings (the CLI builds both, flags applied)."""
    from mlflow import MlflowClient
    from prometheus_client import start_http_server

    from app.controller.controller import Controller
    from app.controller.gate_io import GateRunner

    client = MlflowClient(tracking_uri=settings.mlflow_uri, registry_uri=settings.mlflow_uri)
    runner = GateRunner(settings, client, cs.gate, cs.gate_rollouts, cs.gate_reward_rollouts)
    if cs.metrics_port:
        start_http_server(cs.metrics_port)
        log.info("controller metrics on :%d/metrics", cs.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Controller(settings, cs, client, gate=runner.run, background_gate=True).run(stop)
