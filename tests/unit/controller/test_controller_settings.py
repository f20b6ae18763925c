"""Controller settings: every gate and canary threshold is a setting, declared once, and a bad
value fails at start-up naming its variable (in the exception and on `flywheel controller`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from app.cli import app
from app.config_reference import all_settings
from app.controller.config import ControllerSettings
from app.controller.gate import GateConfig
from app.registry.operator import CanaryConfig


def _env_names() -> set[str]:
    return {s.env for s in all_settings() if s.owner.endswith("ControllerSettings")}


def test_every_gate_and_canary_threshold_is_a_described_setting():
    names = _env_names()
    for field in GateConfig.model_fields:
        assert f"FLYWHEEL_CONTROLLER_GATE_{field.upper()}" in names, field
    for field in CanaryConfig.model_fields:
        assert f"FLYWHEEL_CONTROLLER_{field.upper()}" in names, field
    undescribed = [s.env for s in all_settings() if not s.description]
    assert not undescribed, f"settings without a description: {undescribed}"
    assert "FLYWHEEL_CONTROLLER_GATE" not in names  # the nested model itself is not a variable


def test_each_threshold_is_declared_once():
    own = set(ControllerSettings.model_fields) - set(CanaryConfig.model_fields)
    assert not own & set(GateConfig.model_fields), "a gate threshold is declared twice"
    assert not any(f.startswith("gate_") and f[5:] in GateConfig.model_fields for f in own)


def test_gate_and_canary_thresholds_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_GATE_MAX_KL", "0.5")
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_GATE_N_BOOT", "200")
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_GATE_SAMPLE_PROMPTS", "16")
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_GATE_ROLLOUTS", "64")
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_STEPS", "50,100")
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_MIN_STEP", "30s")
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_STEP_DEADLINE", "4m")
    cs = ControllerSettings()
    assert (cs.gate.max_kl, cs.gate.n_boot, cs.gate.sample_prompts) == (0.5, 200, 16)
    assert cs.gate.max_tokens == GateConfig().max_tokens  # the others keep their defaults
    assert cs.gate_rollouts == 64
    canary = cs.canary()
    assert (canary.steps, canary.min_step, canary.step_deadline) == ((50.0, 100.0), 30.0, 240.0)
    # a keyword (a CLI flag, a test) wins over the environment, the rest of `gate` stays as set
    cs = ControllerSettings(gate={"n_boot": 100}, min_step=1.0)
    assert (cs.gate.n_boot, cs.gate.max_kl, cs.min_step) == (100, 0.5, 1.0)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FLYWHEEL_CONTROLLER_GATE_REWARD_MARGIN", "abc"),
        ("FLYWHEEL_CONTROLLER_GATE_SAMPLE_PROMPTS", "-3"),
        ("FLYWHEEL_CONTROLLER_MIN_SAMPLES", "-1"),
        ("FLYWHEEL_CONTROLLER_MIN_STEP", "ten minutes"),
        ("FLYWHEEL_CONTROLLER_STEPS", "5,50"),
        ("FLYWHEEL_CONTROLLER_GATE_ROLLOUTS", "-1"),
    ],
)
def test_a_bad_value_names_its_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as err:
        ControllerSettings()
    [error] = err.value.errors()
    assert error["loc"][0].split()[0] == name, error
    assert name in str(err.value)


def test_the_controller_command_exits_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_GATE_REWARD_MARGIN", "abc")
    result = CliRunner().invoke(app, ["controller", "--port", "0"])
    assert result.exit_code == 2, result.output
    assert "FLYWHEEL_CONTROLLER_GATE_REWARD_MARGIN" in result.output
    assert "invalid configuration" in result.output


def test_a_bad_flag_names_the_variable_it_sets():
    result = CliRunner().invoke(app, ["controller", "--port", "-5"])
    assert result.exit_code == 2, result.output
    assert "FLYWHEEL_CONTROLLER_METRICS_PORT" in result.output
