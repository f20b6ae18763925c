"""`flywheel run`'s demo cadence only sets variables some settings class reads, with valid values."""

from __future__ import annotations

from app.config_reference import known_env_names, settings_classes
from app.run import DEMO_ENV


def test_demo_env_names_are_known_settings():
    unknown = sorted({k for k in DEMO_ENV if k.startswith("FLYWHEEL_")} - known_env_names())
    assert not unknown, f"DEMO_ENV sets variables no settings class reads: {unknown}"


def test_demo_env_values_validate(monkeypatch):
    for name, value in DEMO_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLYWHEEL_PROFILE", "local")
    for cls in settings_classes():
        cls()  # raises a ValidationError naming the bad variable
