"""Launcher of `flywheel controller`: build the parts from settings, serve metrics, run until SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading

from app.settings import Settings

log = logging.getLogger(__name__)


def run_controller(settings: Settings, metrics_port: int | None = None) -> None:
    from mlflow import MlflowClient
    from prometheus_client import start_http_server
    from pydantic import ValidationError

    from app.controller.config import ControllerSettings
    from app.controller.controller import Controller
    from app.controller.gate_io import GateRunner

    try:
        cs = ControllerSettings()
    except ValidationError as exc:
        raise SystemExit(
            f"invalid controller configuration (FLYWHEEL_CONTROLLER_*):\n{exc}"
        ) from None
    client = MlflowClient(tracking_uri=settings.mlflow_uri, registry_uri=settings.mlflow_uri)
    runner = GateRunner(settings, client, cs.gate(), cs.gate_rollouts, cs.gate_reward_rollouts)
    port = cs.metrics_port if metrics_port is None else metrics_port
    if port:
        start_http_server(port)
        log.info("controller metrics on :%d/metrics", port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Controller(settings, cs, client, gate=runner.run, background_gate=True).run(stop)
