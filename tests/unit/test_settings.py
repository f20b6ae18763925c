"""Settings: durations, validation messages a user can act on, profiles, bootstrap checks.

.venv/bin/pytest tests/unit/test_settings.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings, parse_duration


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FLYWHEEL_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("30s", 30.0),
        ("15m", 900.0),
        ("5h", 18000.0),
        ("1h30m", 5400.0),
        ("1d", 86400.0),
        ("250ms", 0.25),
        ("90", 90.0),
        ("1.5", 1.5),
        ("2m30s", 150.0),
        (" 5H ", 18000.0),
        ("0", 0.0),
        (45, 45.0),
        (0.5, 0.5),
    ],
)
def test_parse_duration_accepts_units_combinations_and_numbers(
    text: object, seconds: float
) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "bad", ["", "abc", "5x", "h5", "1h-30m", "-5s", "5 hours", True, None, [1]]
)
def test_parse_duration_rejects_garbage_with_a_hint(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(bad)
    message = str(info.value)
    assert "duration" in message and (
        "15m" in message or "'30s'" in message or ">= 0" in message
    ), message


def test_duration_env_vars_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_SHIP_INTERVAL", "1h30m")
    monkeypatch.setenv("FLYWHEEL_WAIT_WINDOW", "30s")
    monkeypatch.setenv("FLYWHEEL_KAFKA_PRODUCE_TIMEOUT", "2")
    s = Settings()
    assert (s.ship_interval, s.wait_window, s.kafka_produce_timeout) == (5400.0, 30.0, 2.0)


def test_defaults_match_the_design_contract() -> None:
    s = Settings()
    assert s.kafka_bootstrap == "localhost:9092"
    assert s.mlflow_uri == "http://127.0.0.1:5000"
    assert s.model_name == "flywheel-policy"
    assert s.ship_interval == 5 * 3600.0 and s.wait_window == 15 * 60.0
    assert s.topic("deployments") == "flywheel.deployments"
    assert s.db_url == f"sqlite:///{(Path('.flywheel') / 'flywheel.db').resolve()}"


@pytest.mark.parametrize(
    "var, value, field, hint",
    [
        ("FLYWHEEL_SHIP_INTERVAL", "soon", "ship_interval", "15m"),
        ("FLYWHEEL_WAIT_WINDOW", "-3m", "wait_window", "duration"),
        ("FLYWHEEL_KAFKA_BOOTSTRAP", "localhost", "kafka_bootstrap", "FLYWHEEL_KAFKA_BOOTSTRAP"),
        ("FLYWHEEL_KAFKA_BOOTSTRAP", "a:9092,b", "kafka_bootstrap", "host:port"),
        ("FLYWHEEL_TOPIC_NAMESPACE", "bad ns!", "topic_namespace", "FLYWHEEL_TOPIC_NAMESPACE"),
        (
            "FLYWHEEL_INTERACTIONS_PARTITIONS",
            "0",
            "interactions_partitions",
            "greater than or equal to 1",
        ),
        ("FLYWHEEL_PROFILE", "staging", "profile", "'local' or 'production'"),
        ("FLYWHEEL_API_PORT", "http", "api_port", "integer"),
    ],
)
def test_bad_values_fail_with_a_message_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, field: str, hint: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    message = str(info.value)
    assert field in message, f"the error does not name {field} ({var}): {message}"
    assert hint in message, f"the error does not say how to fix it ({hint!r}): {message}"


def test_production_profile_without_webhook_secret_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLYWHEEL_PROFILE", "production")
    with pytest.raises(ValidationError, match="FLYWHEEL_WEBHOOK_SECRET must be set"):
        Settings()
    monkeypatch.setenv("FLYWHEEL_WEBHOOK_SECRET", "s3cret")
    s = Settings()
    assert s.profile == "production" and s.effective_webhook_secret == "s3cret"


def test_local_profile_has_a_development_webhook_secret() -> None:
    s = Settings()
    assert s.webhook_secret is None and s.effective_webhook_secret


@pytest.mark.parametrize(
    "bootstrap", ["localhost:9092", "k1:9092,k2:9093", "10.0.0.1:19092", "[::1]:9092"]
)
def test_bootstrap_accepts_host_port_lists(bootstrap: str) -> None:
    assert Settings(kafka_bootstrap=bootstrap).kafka_bootstrap == bootstrap


@pytest.mark.parametrize("bootstrap", ["localhost", ":9092", "host:", "host:port", "a:1,"])
def test_bootstrap_rejects_entries_without_host_and_port(bootstrap: str) -> None:
    with pytest.raises(ValidationError, match="must be host:port"):
        Settings(kafka_bootstrap=bootstrap)


def test_database_url_overrides_the_sqlite_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path))
    assert Settings().db_url == f"sqlite:///{(tmp_path / 'flywheel.db').resolve()}"
    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", "postgresql+psycopg://u:p@db/flywheel")
    assert Settings().db_url == "postgresql+psycopg://u:p@db/flywheel"


def test_topic_names_use_the_namespace_and_unknown_topics_fail() -> None:
    s = Settings(topic_namespace="staging")
    assert s.topic("interactions") == "staging.interactions"
    with pytest.raises(AssertionError, match="unknown topic"):
        s.topic("nope")
