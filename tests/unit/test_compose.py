"""docker-compose.yml is a real deployment description: every service it names runs a command
the CLI has (with options it accepts), every FLYWHEEL_* variable is read by some settings
class, secrets have no defaults, and every role waits for the migrate step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
import yaml

from app.cli import app as cli_app
from app.config_reference import known_env_names

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
ROLE_SERVICES = [
    n for n, s in SERVICES.items() if s.get("image") == "flywheel:latest" and "command" in s
]
SECRETS = ("POSTGRES_PASSWORD", "MLFLOW_ADMIN_PASSWORD", "FLYWHEEL_WEBHOOK_SECRET")


def test_compose_has_the_production_like_services():
    assert {
        "kafka",
        "postgres",
        "mlflow",
        "migrate",
        "api",
        "streams",
        "trainer",
        "controller",
    } <= set(SERVICES)
    replicas = [n for n in SERVICES if n.startswith("replica")]
    assert len(replicas) == 2, f"two replicas expected, got {replicas}"
    assert SERVICES["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller", (
        "Kafka must run in KRaft mode"
    )
    for name in ("kafka", "postgres", "mlflow", "api", *replicas):
        assert "healthcheck" in SERVICES[name], f"{name} needs a healthcheck"


@pytest.mark.parametrize("service", ROLE_SERVICES)
def test_every_role_command_exists_in_the_cli(service):
    args = list(SERVICES[service]["command"])
    group = typer.main.get_command(cli_app)
    ctx = group.make_context("flywheel", list(args), resilient_parsing=False)
    cmd_name, cmd, rest = group.resolve_command(ctx, args)
    assert cmd is not None, f"{service}: 'flywheel {args[0]}' is not a CLI command"
    while hasattr(cmd, "commands") and rest:  # sub-groups such as `db upgrade`
        sub_ctx = cmd.make_context(cmd_name, list(rest))
        cmd_name, cmd, rest = cmd.resolve_command(sub_ctx, rest)
        assert cmd is not None, f"{service}: {args} is not a CLI command"
    cmd.make_context(cmd_name, list(rest))  # raises on an unknown option or a bad value


def _env_of(service: dict) -> dict:
    return service.get("environment", {}) or {}


@pytest.mark.parametrize("service", ROLE_SERVICES)
def test_every_flywheel_variable_is_a_known_setting(service):
    known = known_env_names()
    unknown = sorted(
        k for k in _env_of(SERVICES[service]) if k.startswith("FLYWHEEL_") and k not in known
    )
    assert not unknown, f"{service} sets variables no settings class reads: {unknown}"


def test_secrets_have_no_defaults():
    text = (REPO / "docker-compose.yml").read_text()
    for secret in SECRETS:
        uses = re.findall(r"\$\{" + secret + r"([^}]*)\}", text)
        assert uses, f"{secret} is not used"
        assert all(u.startswith(":?") for u in uses), (
            f"{secret} must be required (${{{secret}:?...}}), got {uses}"
        )


@pytest.mark.parametrize("service", [s for s in ROLE_SERVICES if s not in ("migrate", "topics")])
def test_roles_start_after_the_migration_succeeded(service):
    deps = SERVICES[service].get("depends_on", {})
    assert deps.get("migrate", {}).get("condition") == "service_completed_successfully", service
    assert SERVICES[service]["environment"]["FLYWHEEL_PROFILE"] == "production"
