"""The controller's commands served on the API's port: the operator verbs and the settings they read.

    decisions = operator_command(state, "rollback", get_command_settings().canary(),
                                 actor="alice", reason="bad outputs", version="6")

The operator verbs (POST /v1/deployments/{promote,abort,rollback,pause,resume}, app/api/routes/
admin.py) are a pure function of the typed deployment state (app/contracts/deployment_state.py):
`operator_command` returns the `Decision`s a verb becomes (source `api`, the caller as actor), or
raises `CommandRejected` with the HTTP status (409: the verb does not apply now; 422: a bad
target). The caller publishes them on the deployment log; the controller carries them out. The
canary's state machine (app/controller/canary.py) advances a step with the same `advance`.

`CanaryConfig` is how a canary proceeds (its steps and thresholds). `ControllerCommandSettings`
reads it and the webhook replay window from the environment (`FLYWHEEL_CONTROLLER_<FIELD>`), for
the API's verbs and webhook receiver; the controller's `ControllerSettings`
(app/controller/config.py) inherits these fields, so each is declared once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from app.contracts.deployment_state import DeploymentState
from app.contracts.deployments import Decision
from app.settings import Duration
from app.settings_base import FlywheelSettings


def _csv_floats(v: object) -> object:
    """`5,25,50,100` (the environment's form) -> (5.0, 25.0, 50.0, 100.0)."""
    if isinstance(v, str):
        return tuple(float(x) for x in v.replace(" ", "").split(",") if x)
    return v


class CanaryConfig(BaseModel):
    """How a canary proceeds. Each field is also the setting `FLYWHEEL_CONTROLLER_<FIELD>`
    (`ControllerCommandSettings` below); durations accept `90`, `30s`, `15m`, `1h30m` and are seconds."""

    steps: Annotated[tuple[float, ...], NoDecode, BeforeValidator(_csv_floats)] = Field(
        (5.0, 25.0, 50.0, 100.0),
        description="Canary steps: the candidate's % of sessions per step, comma-separated, increasing, ending at 100 (= promotion).",
    )
    min_step: Duration = Field(
        600.0, ge=0, description="Minimum time a canary step lasts before it can be judged."
    )
    min_samples: int = Field(
        200,
        ge=2,
        description="Minimum labelled samples per arm (candidate and champion) in a step's window before it is judged.",
    )
    step_deadline: Duration = Field(
        3 * 3600.0,
        gt=0,
        description="A canary step still inconclusive this long after it started pauses for an operator.",
    )
    alpha: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Error level of the canary's confidence sequence (two-sided, time-uniform).",
    )
    margin: float = Field(
        0.05,
        ge=0,
        description="Non-inferiority margin of the canary (reward units): not worse than this counts as equal.",
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
        description="Roll back a canary confidently worse on a user-outcome guardrail (acceptance, kept-edit rate, follow-up sentiment, tool-call success rate, users' ratings; agent sessions' task success and give-ups), whatever its reward.",
    )
    guardrail_margin: float = Field(
        0.02,
        ge=0,
        description="Non-inferiority margin of the canary's user-outcome guardrails (rate or sentiment units).",
    )
    min_sessions: int = Field(
        50,
        ge=2,
        description="Agent sessions that ended with an outcome, per arm in a step's window, before the canary's session guardrails (task success, give-ups) are judged; with fewer they are skipped, neither passed nor failed.",
    )

    min_ratings: int = Field(
        30,
        ge=2,
        description="Rated completions (an agent session's rating is on its last turn), per arm in a step's window, before the canary's rating guardrail is judged; with fewer it is skipped, neither passed nor failed.",
    )

    @field_validator("steps")
    @classmethod
    def _steps_increase_to_100(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not v or v[-1] != 100.0 or any(b <= a for a, b in zip(v, v[1:])) or v[0] <= 0:
            raise ValueError(
                f"canary steps must increase from >0 and end at 100 (e.g. 5,25,50,100), got {v}"
            )
        return v


class ControllerCommandSettings(CanaryConfig, FlywheelSettings):
    """The controller settings its commands on the API's port read: the canary's (`CanaryConfig`)
    and the webhook replay window. Env prefix `FLYWHEEL_CONTROLLER_`; `ControllerSettings`
    (app/controller/config.py) inherits them with the rest of the controller's settings."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_CONTROLLER_", extra="ignore", validate_default=True
    )

    webhook_window: Duration = Field(
        300.0,
        description="Replay window: deliveries whose timestamp is further from now are rejected.",
    )

    def canary(self) -> CanaryConfig:
        """The canary's thresholds (the fields inherited from CanaryConfig)."""
        return CanaryConfig.model_validate(
            {name: getattr(self, name) for name in CanaryConfig.model_fields}
        )


@lru_cache(maxsize=1)
def get_command_settings() -> ControllerCommandSettings:
    return ControllerCommandSettings()


def advance(
    state: DeploymentState, cfg: CanaryConfig, reason: str, details: dict[str, Any], **who: str
) -> Decision:
    """The canary's next step: `traffic_shifted` to the next step's share, or `promoted` when the
    next step is the last (100%). Shared by the canary's judgement and the `promote` verb."""
    nxt = state.step + 1
    if nxt >= len(cfg.steps) - 1:  # the last step is 100% = the candidate becomes champion
        return Decision(
            type="promoted",
            version=state.candidate,
            from_version=state.champion,
            traffic_pct=100.0,
            reason=reason,
            details={**details, "step": len(cfg.steps) - 1},
            **who,
        )
    return Decision(
        type="traffic_shifted",
        version=state.candidate,
        from_version=state.champion,
        traffic_pct=cfg.steps[nxt],
        reason=reason,
        details={**details, "step": nxt},
        **who,
    )


# --- operator verbs ---------------------------------------------------------------------------
class CommandRejected(ValueError):
    """The verb does not apply to the current state (HTTP 409) or names a bad target (422)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def operator_command(
    state: DeploymentState,
    verb: str,
    cfg: CanaryConfig,
    *,
    actor: str,
    reason: str = "",
    version: str | None = None,
    skip_remaining: bool = False,
) -> list[Decision]:
    """The deployment events an operator verb becomes (source `api`), or CommandRejected."""
    return _command(
        state, verb, cfg, actor=actor, reason=reason, version=version, skip_remaining=skip_remaining
    )


def _command(
    state: DeploymentState,
    verb: str,
    cfg: CanaryConfig,
    *,
    actor: str,
    reason: str,
    version: str | None,
    skip_remaining: bool,
) -> list[Decision]:
    who = {"source": "api", "actor": actor}
    why = reason or f"operator {verb}"
    if verb in ("promote", "abort", "pause") and state.candidate is None:
        raise CommandRejected(
            f"{verb}: no canary is running for {state.model} (champion {state.champion})"
        )
    if verb == "promote":
        if skip_remaining:
            return [
                Decision(
                    type="promoted",
                    version=state.candidate,
                    from_version=state.champion,
                    traffic_pct=100.0,
                    reason=why,
                    details={"skip_remaining": True},
                    **who,
                )
            ]
        return [advance(state, cfg, why, {"manual": True}, **who)]
    if verb == "abort":
        return [
            Decision(
                type="aborted",
                version=state.candidate,
                from_version=state.candidate,
                traffic_pct=0.0,
                reason=why,
                **who,
            )
        ]
    if verb == "pause":
        if state.phase != "canary":
            raise CommandRejected(
                f"pause: the canary of {state.candidate} is {state.phase}, not running"
            )
        return [
            Decision(
                type="canary_paused",
                version=state.candidate,
                traffic_pct=state.traffic_pct,
                reason=why,
                **who,
            )
        ]
    if verb == "resume":
        if state.phase != "paused":
            raise CommandRejected(f"resume: nothing is paused (phase {state.phase})")
        return [
            Decision(
                type="canary_resumed",
                version=state.candidate,
                traffic_pct=state.traffic_pct,
                reason=why,
                **who,
            )
        ]
    if verb == "rollback":
        targets = state.rollback_targets(cfg.known_good_n)
        if not targets:
            raise CommandRejected(
                f"rollback: no known-good version other than champion {state.champion} to roll back to"
            )
        target = version or targets[0]
        if target not in targets:
            raise CommandRejected(
                f"rollback: version {target} is not one of the last {cfg.known_good_n} known-good "
                f"versions {targets}",
                status=422,
            )
        out = []
        if (
            state.candidate is not None
        ):  # a rollback of the champion also ends any canary, explicitly
            out.append(
                Decision(
                    type="aborted",
                    version=state.candidate,
                    from_version=state.candidate,
                    traffic_pct=0.0,
                    reason=f"rollback to version {target}: {why}",
                    **who,
                )
            )
        out.append(
            Decision(
                type="rolled_back",
                version=target,
                from_version=state.champion,
                traffic_pct=0.0,
                reason=why,
                **who,
            )
        )
        return out
    raise CommandRejected(
        f"unknown verb {verb!r}; use promote, abort, rollback, pause or resume", status=422
    )
