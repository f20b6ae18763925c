"""Controller settings, env prefix `FLYWHEEL_CONTROLLER_` (the API's admin and hook routes read them too).

    FLYWHEEL_CONTROLLER_STEPS=5,25,50,100  FLYWHEEL_CONTROLLER_MIN_STEP=10m  FLYWHEEL_CONTROLLER_POLL_INTERVAL=5s

Durations accept the same forms as the main settings (`90`, `30s`, `15m`, `1h30m`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated

from pydantic import BeforeValidator, Field
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.controller.canary import CanaryConfig
from app.controller.gate import GateConfig
from app.settings import Duration


def _csv_floats(v: object) -> object:
    if isinstance(v, str):
        return tuple(float(x) for x in v.replace(" ", "").split(",") if x)
    return v


class ControllerSettings(BaseSettings):
    """Canary, gate, alias-reconciliation and webhook knobs of `flywheel controller`."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_CONTROLLER_", extra="ignore", validate_default=True
    )

    # canary
    steps: Annotated[tuple[float, ...], NoDecode, BeforeValidator(_csv_floats)] = Field(
        (5.0, 25.0, 50.0, 100.0),
        description="Canary steps: candidate's % of sessions, comma-separated, ending at 100.",
    )
    min_step: Duration = Field(600.0, description="Minimum duration of a canary step.")
    min_samples: int = Field(
        200, ge=2, description="Minimum labelled samples per arm in a step before it is judged."
    )
    step_deadline: Duration = Field(
        3 * 3600.0, description="An inconclusive step pauses for an operator after this long."
    )
    alpha: float = Field(
        0.05, gt=0, lt=1, description="Error level of the canary's confidence sequence."
    )
    margin: float = Field(
        0.05,
        ge=0,
        description="Non-inferiority margin (reward units): not worse than this counts as equal.",
    )
    cs_target_n: int = Field(
        1000,
        ge=1,
        description="Samples at which the canary's confidence sequence is tightest (set near a step's expected sample size).",
    )
    known_good_n: int = Field(
        5, ge=1, description="How many previous known-good versions `rollback` may target."
    )
    guardrails: bool = Field(
        True,
        description="Roll back a canary confidently worse on acceptance, kept-edit rate, follow-up sentiment or tool-call success rate, whatever its reward.",
    )
    guardrail_margin: float = Field(
        0.02,
        ge=0,
        description="Non-inferiority margin of the canary's user-outcome guardrails (rate or sentiment units).",
    )
    # gate
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
    gate_reward_margin: float = Field(
        0.02,
        ge=0,
        description="The gate fails a version whose predicted reward is confidently below the champion's by more than this.",
    )
    gate_samples_per_prompt: int = Field(
        4,
        ge=1,
        description="Completions the gate samples per prompt from candidate and champion each.",
    )
    gate_regression_tolerance: float = Field(
        1.0,
        ge=0,
        description="The gate fails a version whose per-token NLL on the fixed regression set rises more than this (nats) over the champion's.",
    )
    gate_max_kl: float | None = Field(
        None,
        gt=0,
        description="Fail versions above this KL(candidate||champion) per token; unset: the KL is recorded, not judged.",
    )
    gate_max_invalid_increase: float = Field(
        0.05,
        ge=0,
        description="Gate: fail when the candidate's broken-tool-call rate exceeds the champion's by more than this (confidence bound; 1 turns the monitor off).",
    )
    gate_max_no_edit_increase: float = Field(
        0.05,
        ge=0,
        description="Gate: fail when the candidate's no-edit rate (empty, or only comments and strings) exceeds the champion's by more than this (confidence bound; 1 turns the monitor off).",
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
    webhook_window: Duration = Field(
        300.0,
        description="Replay window: deliveries whose timestamp is further from now are rejected.",
    )
    # process
    tick_interval: Duration = Field(
        2.0, description="How often the controller loop re-evaluates deadlines and the canary."
    )
    metrics_port: int = Field(
        9103, ge=0, description="Prometheus /metrics port of `flywheel controller` (0: none)."
    )

    def canary(self) -> CanaryConfig:
        return CanaryConfig(
            steps=self.steps,
            min_step_s=self.min_step,
            min_samples=self.min_samples,
            step_deadline_s=self.step_deadline,
            alpha=self.alpha,
            margin=self.margin,
            known_good_n=self.known_good_n,
            cs_target_n=self.cs_target_n,
            guardrails=self.guardrails,
            guardrail_margin=self.guardrail_margin,
        )

    def gate(self) -> GateConfig:
        return GateConfig(
            reward_margin=self.gate_reward_margin,
            samples_per_prompt=self.gate_samples_per_prompt,
            max_kl=self.gate_max_kl,
            regression_tolerance=self.gate_regression_tolerance,
            max_invalid_increase=self.gate_max_invalid_increase,
            max_no_edit_increase=self.gate_max_no_edit_increase,
        )


@lru_cache(maxsize=1)
def get_controller_settings() -> ControllerSettings:
    return ControllerSettings()
