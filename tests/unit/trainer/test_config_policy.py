"""FLYWHEEL_TRAINER_POLICY: JSON, and an `hf` policy must name a Hugging Face model directory.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/trainer/test_config_policy.py -q
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from trainer.config import TrainerConfig


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{bad", "must be a JSON object"),
        ('{"type": "hf"}', "model_dir None of the hf policy is not a Hugging Face model directory"),
        ('{"type": "hf", "model_dir": "/nonexistent/m"}', "'/nonexistent/m' of the hf policy"),
    ],
)
def test_a_bad_policy_config_is_refused_naming_the_variable(monkeypatch, value, message):
    monkeypatch.setenv("FLYWHEEL_TRAINER_POLICY", value)
    with pytest.raises(ValidationError) as exc:
        TrainerConfig()
    assert "FLYWHEEL_TRAINER_POLICY" in str(exc.value) and message in str(exc.value)


def test_an_hf_model_directory_is_accepted(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = {"type": "hf", "model_dir": str(tmp_path)}
    monkeypatch.setenv("FLYWHEEL_TRAINER_POLICY", json.dumps(cfg))
    assert TrainerConfig().policy == cfg
    monkeypatch.setenv("FLYWHEEL_TRAINER_POLICY", "")
    assert TrainerConfig().policy == {}
