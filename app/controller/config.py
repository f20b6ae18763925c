"""Controller settings, env prefix `FLYWHEEL_CONTROLLER_`.

    FLYWHEEL_CONTROLLER_STEPS=5,25,50,100  FLYWHEEL_CONTROLLER_MIN_STEP=10m
    FLYWHEEL_CONTROLLER_GATE_MAX_KL=0.5    FLYWHEEL_CONTROLLER_POLL_INTERVAL=5s

Each threshold is declared once, in the model that uses it: the canary's in `CanaryConfig` and
the webhook replay window in `ControllerCommandSettings` (app/registry/operator.py: the API's
operator verbs and webhook receiver read them too; `ControllerSettings` inherits their fields:
`FLYWHEEL_CONTROLLER_<FIELD>`), the offline gate's in `gate.GateConfig` (nested as `gate`:
`FLYWHEEL_CONTROLLER_GATE_<FIELD>`). Durations accept the same forms as the main settings
(`90`, `30s`, `15m`, `1h30m`). A bad value fails at construction with the variable's name
(app/settings_base.py).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from app.controller.gate import GateConfig
from app.registry.operator import ControllerCommandSettings
from app.settings import Duration


class ControllerSettings(ControllerCommandSettings):
    """Canary, gate, alias-reconciliation and webhook knobs of `flywheel controller`."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_CONTROLLER_",
        env_nested_delimiter="_",
        env_nested_max_split=1,  # GATE_MAX_KL -> gate.max_kl
        extra="ignore",
        validate_default=True,
    )

    # canary and webhook replay window: the fields of ControllerCommandSettings
    # gate
    gate: GateConfig = Field(
        default_factory=GateConfig,
        description="Thresholds of the offline gate, one setting each (FLYWHEEL_CONTROLLER_GATE_<FIELD>).",
    )
    gate_enabled: bool = Field(
        True,
        description="Run the offline gate on version_registered (off: every version passes untested, recorded as such).",
    )
    gate_rollouts: int = Field(
        256, ge=0, description="Held-out logged rollouts the gate evaluates on (newest first)."
    )
    gate_reward_rollouts: int = Field(
        2000, ge=0, description="Newest logged rollouts the gate's reward model is fitted on."
    )
    # aliases and webhooks
    poll_interval: Duration = Field(
        5.0, description="How often the reconciler compares MLflow aliases with Flywheel's copy."
    )
    webhooks_enabled: bool = Field(
        True, description="Register an MLflow webhook for alias moves (the poller runs either way)."
    )
    webhook_url: str | None = Field(
        None,
        description="Public URL of POST /v1/hooks/mlflow (default: http://<api_host>:<api_port>/v1/hooks/mlflow).",
    )
    # process
    tick_interval: Duration = Field(
        2.0, description="How often the controller loop re-evaluates deadlines and the canary."
    )
    metrics_port: int = Field(
        9103, ge=0, description="Prometheus /metrics port of `flywheel controller` (0: none)."
    )
