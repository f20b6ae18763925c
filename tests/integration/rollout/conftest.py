"""Fixtures of the rollout tests: the whole stack (API, projector, controller with the real gate,
two replicas) on the session's real Kafka broker and MLflow server, one fresh model per test.

    .venv/bin/pytest tests/integration/rollout -q -s      # -s prints the measured timings
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.rollout.stack import RolloutStack

WEBHOOK_SECRET = "rollout-test-webhook-secret"


@pytest.fixture()
def rollout_stack(
    make_settings, mlflow_server, tmp_path: Path
) -> Iterator[Callable[..., RolloutStack]]:
    """`rollout_stack(**controller_overrides)` starts the stack; it is stopped after the test.

    Short canary (steps 5/25/50/100, 3 s and 50 labelled samples per arm per step), 0.5 s ticks,
    a 2 s alias poll; webhooks on unless `webhooks_enabled=False`.
    """
    from app.controller.config import ControllerSettings

    started: list[RolloutStack] = []

    def _start(**overrides) -> RolloutStack:
        settings = make_settings(
            model_name=f"rollout-{uuid.uuid4().hex[:8]}",
            mlflow_uri=mlflow_server.uri,
            webhook_secret=WEBHOOK_SECRET,
            database_url=f"sqlite:///{tmp_path / 'flywheel.db'}",
            ship_interval="5h",
        )
        cs = ControllerSettings(
            **{
                "min_step": 3.0,
                "min_samples": 50,
                "step_deadline": 600.0,
                "tick_interval": 0.5,
                "poll_interval": 2.0,
                "webhooks_enabled": True,
                "metrics_port": 0,
                "gate_rollouts": 64,
                **overrides,
            }
        )
        stack = RolloutStack(settings, cs, tmp_path)
        started.append(stack)
        return stack.start()

    yield _start
    for stack in started:
        stack.stop()
