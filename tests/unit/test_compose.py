"""docker-compose.yml is a real deployment description: every service it names runs a command
the CLI has (with options it accepts), every FLYWHEEL_* variable is read by some settings
class, secrets and the model directory have no defaults, and every role waits for the migrate
step and for the one-shot import of the user's model (mounted read-only)."""

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


@pytest.mark.parametrize(
    "service", [s for s in ROLE_SERVICES if s not in ("migrate", "topics", "model-import")]
)
def test_roles_start_after_the_migration_succeeded(service):
    deps = SERVICES[service].get("depends_on", {})
    assert deps.get("migrate", {}).get("condition") == "service_completed_successfully", service
    assert SERVICES[service]["environment"]["FLYWHEEL_PROFILE"] == "production"


# --- the user's model: a read-only mount, imported once by a one-shot service before the roles ---
MODEL_MOUNT = "/models/model"


def _mounts(service: dict) -> dict[str, str]:
    """{container path: "host-or-volume[:mode]"} of a service's short-syntax volumes."""
    out = {}
    for v in service.get("volumes", []):
        mode = v[-3:] if v.endswith((":ro", ":rw")) else ""
        src, _, dst = v.removesuffix(mode).rpartition(":")
        out[dst] = src + mode
    return out


def test_the_model_directory_is_required_and_mounted_read_only():
    text = (REPO / "docker-compose.yml").read_text()
    uses = re.findall(r"\$\{MODEL_DIR([^}]*)\}", text)
    assert uses and all(u.startswith(":?") for u in uses), f"MODEL_DIR must be required: {uses}"
    for name in ("model-import", "trainer"):
        mount = _mounts(SERVICES[name]).get(MODEL_MOUNT)
        assert mount is not None, f"{name} must mount the model at {MODEL_MOUNT}"
        assert mount.startswith("${MODEL_DIR:?") and mount.endswith(":ro"), (name, mount)


def test_model_import_is_a_one_shot_that_keeps_the_versions_on_restart():
    svc = SERVICES["model-import"]
    assert svc["restart"] == "no"
    assert svc["command"] == ["model", "import", MODEL_MOUNT, "--resume"]
    assert svc["depends_on"] == {"mlflow": {"condition": "service_healthy"}}
    assert _mounts(svc)["/var/lib/flywheel"] == "flywheel-data", "the HF files cache is shared"


@pytest.mark.parametrize(
    "service", [s for s in ROLE_SERVICES if s not in ("migrate", "topics", "model-import")]
)
def test_roles_start_after_the_model_import_succeeded(service):
    deps = SERVICES[service].get("depends_on", {})
    assert deps.get("model-import", {}).get("condition") == "service_completed_successfully", (
        service
    )


def test_the_trainer_trains_the_mounted_model():
    import json

    env = _env_of(SERVICES["trainer"])
    policy = json.loads(env["FLYWHEEL_TRAINER_POLICY"])
    assert policy == {"type": "hf", "model_dir": MODEL_MOUNT}, policy
    assert env["FLYWHEEL_PROFILE"] == "production" and "FLYWHEEL_WEBHOOK_SECRET" in env, (
        "the trainer's environment must extend the shared one, not replace it"
    )
