"""`flywheel model import DIR` against a real MLflow server (tests/conftest.py `mlflow_server`) and
a real Kafka broker (`make_settings`: a fresh topic namespace per test).

The first test runs the CLI as a user runs it (`python -m app.cli model import`, a subprocess
with FLYWHEEL_* variables); the others invoke the same command in-process (typer's CliRunner,
the same variables, the settings cache cleared around each call), which spares each call the
4-5 CPU-seconds of importing torch, transformers and mlflow again. A tiny Qwen2-MoE directory (tests/hf_models.py, built offline) becomes v1 with
`champion` on it; a fresh cache directory filled from the version's artifacts alone
(`Registry.policy_config`) rebuilds a policy whose serving weights equal the source's bf16 weights
bit for bit, with the same tokenizer id; the anchor's checkpoint hash is those weights' hash; the
pyfunc generates; a replica's `VersionFetcher.policy_config` and the gate's `load_version` fill
their own caches the same way.
Every bad input exits 2 with one line naming the file or field, and registers
nothing; a second import is refused without --force and replaces the model with it.
The deployment log holds exactly one `version_registered` (source `import`) per registration, with
v1's checkpoint hash; a refused import publishes nothing, an import without the deployments topic
registers nothing, and `--resume` publishes a missing event once and never a duplicate.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/trainer/test_model_import.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(root, tokenizer, model) built once per test run for every worker (tests/shared.py
    `shared_artifact`); tests only read them."""
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer
    from tests.shared import shared_artifact

    def build(root: Path) -> None:
        tiny_qwen2_moe_dir(root / "tiny-moe", train_bpe_tokenizer(root / "tok"))

    root = shared_artifact(tmp_path_factory.getbasetemp(), "import-moe", build)
    return root, root / "tok", root / "tiny-moe"


@pytest.fixture()
def kafka_env(make_settings):
    """A fresh topic namespace on the test broker, topics created; the import's Kafka variables."""
    settings = make_settings()
    return settings, {
        "FLYWHEEL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "FLYWHEEL_TOPIC_NAMESPACE": settings.topic_namespace,
    }


def _env(mlflow_server, kafka_env, name: str, data_dir: Path) -> dict[str, str]:
    return {
        "FLYWHEEL_MLFLOW_URI": mlflow_server.uri,
        "FLYWHEEL_MODEL_NAME": name,
        "FLYWHEEL_DATA_DIR": str(data_dir),
        "COLUMNS": "400",
        **kafka_env[1],
    }


def _import_process(
    mlflow_server, kafka_env, name: str, model_dir: Path, data_dir: Path, *flags: str
) -> subprocess.CompletedProcess:
    """`python -m app.cli model import`, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **_env(mlflow_server, kafka_env, name, data_dir)}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "model", "import", str(model_dir), *flags],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@dataclass
class _Done:
    returncode: int
    stdout: str
    stderr: str


def _import(mlflow_server, kafka_env, name: str, model_dir: Path, data_dir: Path, *flags: str):
    """The same command in this process: exit code, stdout and stderr as `_import_process` gives
    them. FLYWHEEL_* variables of this process are set for the call only."""
    from typer.testing import CliRunner

    from app.cli import app
    from app.settings import get_settings

    env = _env(mlflow_server, kafka_env, name, data_dir)
    env.update({k: None for k in os.environ if k.startswith("FLYWHEEL_") and k not in env})
    get_settings.cache_clear()
    try:
        out = CliRunner().invoke(app, ["model", "import", str(model_dir), *flags], env=env)
    finally:
        get_settings.cache_clear()
    if out.exception is not None and not isinstance(out.exception, SystemExit):
        raise out.exception
    return _Done(out.exit_code, out.stdout, out.stderr)


def _nothing_registered(mlflow_server, name: str) -> bool:
    client = MlflowClient(mlflow_server.uri, mlflow_server.uri)
    try:
        client.get_registered_model(name)
    except MlflowException:
        return True
    return not client.search_model_versions(f"name='{name}'")


def _registered(settings, name: str) -> list:
    """The `version_registered` events of model `name` on the settings' deployments topic."""
    from app.contracts.deployments import DeploymentLog

    with DeploymentLog(settings) as dlog:
        return [
            e.event
            for e in dlog.read(stall_timeout_s=60)
            if e.event.type == "version_registered" and e.event.model == name
        ]


def _bits(sd: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in sd.items()}


def test_import_registers_v1_as_champion_and_the_artifacts_rebuild_the_model(
    mlflow_server, kafka_env, dirs, tmp_path, monkeypatch
):
    """The import as a user runs it (a subprocess), then v1 rebuilt from the registry's artifacts
    alone three ways (the registry, a replica's fetcher, the gate). Needs about a minute on a
    loaded machine: the subprocess imports torch, transformers and mlflow, and the model is
    built four times."""
    import mlflow

    from kernels.delta import hash_state_dict
    from policy import build_policy
    from trainer.registry import Registry

    _, _, model_dir = dirs
    name = f"import-{uuid.uuid4().hex[:8]}"
    out = _import_process(mlflow_server, kafka_env, name, model_dir, tmp_path / "importer")
    assert out.returncode == 0, out.stderr
    reg = Registry(mlflow_server.uri, name)
    assert [int(v.version) for v in reg.versions()] == [1]
    assert reg.alias_version("champion") == 1
    tags = reg.versions()[0].tags
    assert tags["kind"] == "import" and tags["parent_version"] == "none"
    delta = json.loads(tags["delta"])
    assert delta["anchor"] is True and delta["parent"] is None

    source = build_policy({"type": "hf", "model_dir": str(model_dir)}).eval()
    want = source.serving_state_dict()
    assert delta["checkpoint_sha256"] == hash_state_dict(want)[1]

    # the deployment log: one version_registered for v1, from the import, with v1's identity
    from app.contracts.hints import ArtifactHint, config_sha256

    v1 = reg.versions()[0]
    (event,) = _registered(kafka_env[0], name)
    assert (event.version, event.from_version, event.source) == ("1", None, "import")
    assert event.actor == "flywheel-model-import"
    assert event.event_id == f"vr-import-{v1.run_id}"
    assert event.details["run_id"] == v1.run_id
    assert event.details["rollouts_consumed"] == 0
    assert event.details["hf_files_sha256"] == tags["hf_files_sha256"]
    assert event.details["imported_from"] == str(model_dir.resolve())
    hint = ArtifactHint.from_details(event.details)
    assert hint is not None and hint.root == v1.source.rsplit("/model", 1)[0]
    assert hint.checkpoint_sha256 == hash_state_dict(want)[1]
    assert hint.delta_file is None and hint.parent_version is None  # a full anchor
    assert tags["deployment_event"].startswith(
        f"{event.event_id} {kafka_env[0].topic('deployments')}["
    )

    # another machine: a fresh data dir, nothing but the registry
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "reader"))
    cfg = reg.policy_config(1)
    assert cfg["model_dir"] is None and len(cfg["files_sha256"]) == 64
    assert (tmp_path / "reader" / "hf-models" / cfg["files_sha256"] / "config.json").is_file()
    rebuilt = build_policy(cfg).eval()
    rebuilt.load_serving_state_dict(reg.download_serving_state(1))
    assert _bits(rebuilt.serving_state_dict()) == _bits(want)
    assert rebuilt.tokenizer.name == source.tokenizer.name
    assert rebuilt.moe_spec == source.moe_spec
    assert hint.config_sha256 == config_sha256(cfg)  # the config a replica downloads
    # the importer's own cache is filled too (a trainer on that machine starts without a download)
    assert (tmp_path / "importer" / "hf-models" / cfg["files_sha256"] / "tokenizer.json").is_file()

    # a replica on a third machine: VersionFetcher.policy_config fills its own cache
    from app.replica.fetch import VersionFetcher
    from app.settings import Settings

    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "replica"))
    fetcher = VersionFetcher(Settings(mlflow_uri=mlflow_server.uri, model_name=name))
    try:
        assert fetcher.policy_config("1") == cfg
    finally:
        fetcher.close()
    cached = tmp_path / "replica" / "hf-models" / cfg["files_sha256"]
    assert sorted(p.name for p in cached.iterdir()) == sorted(
        p.name for p in (tmp_path / "reader" / "hf-models" / cfg["files_sha256"]).iterdir()
    )
    assert build_policy(cfg).tokenizer.name == source.tokenizer.name

    # the gate (app/controller/gate_io.py) on a fourth machine
    from app.controller.gate_io import load_version

    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "gate"))
    gated, state, _ = load_version(MlflowClient(mlflow_server.uri, mlflow_server.uri), name, "1")
    assert _bits(state) == _bits(want) and _bits(gated.serving_state_dict()) == _bits(want)

    mlflow.set_tracking_uri(mlflow_server.uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    texts = model.predict(["def add(a, b):"], params={"max_tokens": 4, "seed": 1})
    assert len(texts) == 1 and isinstance(texts[0], str)

    again = _import(mlflow_server, kafka_env, name, model_dir, tmp_path / "importer")
    assert again.returncode == 2
    assert "already holds versions [1]" in again.stderr and "--force" in again.stderr
    assert [int(v.version) for v in reg.versions()] == [1]
    assert len(_registered(kafka_env[0], name)) == 1, "a refused import publishes nothing"
    forced = _import(mlflow_server, kafka_env, name, model_dir, tmp_path / "importer", "--force")
    assert forced.returncode == 0, forced.stderr
    assert [int(v.version) for v in reg.versions()] == [1]
    assert reg.alias_version("champion") == 1
    # the new v1 is another registration (another run): its own event
    first, second = _registered(kafka_env[0], name)
    assert second.event_id == f"vr-import-{reg.versions()[0].run_id}" != first.event_id


def _copy(model_dir: Path, dst: Path) -> Path:
    shutil.copytree(model_dir, dst)
    return dst


def _bad_dirs(root: Path, tok: Path, model_dir: Path) -> dict[str, tuple[Path, str]]:
    """case -> (directory, what the one-line error must name)."""
    from transformers import BertConfig, BertModel, LlamaConfig

    from tests.hf_models import _save_model, _special_ids

    no_config = _copy(model_dir, root / "no-config")
    (no_config / "config.json").unlink()
    no_weights = _copy(model_dir, root / "no-weights")
    (no_weights / "model.safetensors").unlink()
    truncated = _copy(model_dir, root / "truncated")
    w = truncated / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    ids = _special_ids(tok)
    small = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **{**ids, "vocab_size": ids["vocab_size"] - 20},
    )
    vocab = _save_model(small, root / "small-vocab", tok, seed=0)
    bert = root / "bert"
    BertModel(
        BertConfig(
            vocab_size=ids["vocab_size"],
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        )
    ).save_pretrained(str(bert))
    for f in tok.iterdir():
        shutil.copy2(f, bert / f.name)
    return {
        "missing config.json": (no_config, "config.json: missing"),
        "missing weights": (no_weights, "no *.safetensors"),
        "truncated weights": (truncated, "model.safetensors: corrupt or truncated"),
        "tokenizer bigger than the embedding": (vocab, "embedding rows"),
        "not a causal LM": (bert, "architectures ['BertModel'] is not a causal LM"),
    }


def test_bad_input_exits_2_names_the_problem_and_registers_nothing(
    mlflow_server, kafka_env, dirs, tmp_path
):
    root, tok, model_dir = dirs
    cases = _bad_dirs(tmp_path, tok, model_dir)
    for case, (bad, needle) in cases.items():
        name = f"bad-{uuid.uuid4().hex[:8]}"
        out = _import(mlflow_server, kafka_env, name, bad, tmp_path / "data")
        assert out.returncode == 2, (case, out.returncode, out.stderr[-2000:])
        line = [x for x in out.stderr.splitlines() if x.startswith("model import refused:")]
        assert len(line) == 1 and needle in line[0], (case, out.stderr[-2000:])
        assert _nothing_registered(mlflow_server, name), case
    assert not (tmp_path / "data" / "hf-models").exists()
    from app.contracts.deployments import DeploymentLog

    with DeploymentLog(kafka_env[0]) as dlog:
        assert list(dlog.read()) == [], "a refused import publishes nothing"


def test_without_the_deployments_topic_nothing_is_registered(
    mlflow_server, make_settings, dirs, tmp_path
):
    """The deployment log must be able to record the import: a namespace whose topics do not exist
    (`flywheel kafka topics` not run) exits 1 naming the topic, and registers nothing; so does a
    broker that does not answer (a port of this test's range with nothing listening)."""
    _, _, model_dir = dirs
    settings = make_settings(create_topics=False)
    env = (
        settings,
        {
            "FLYWHEEL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "FLYWHEEL_TOPIC_NAMESPACE": settings.topic_namespace,
        },
    )
    name = f"nolog-{uuid.uuid4().hex[:8]}"
    out = _import(mlflow_server, env, name, model_dir, tmp_path / "data")
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    line = [x for x in text.splitlines() if x.startswith("model import failed:")]
    assert len(line) == 1, text
    assert f"topic {settings.topic('deployments')} does not exist" in line[0], line
    assert "nothing registered" in line[0], line
    assert _nothing_registered(mlflow_server, name)
    assert not (tmp_path / "data" / "hf-models").exists()

    down = (settings, {"FLYWHEEL_KAFKA_BOOTSTRAP": "127.0.0.1:9151"})
    out = _import(mlflow_server, down, name, model_dir, tmp_path / "data")
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    line = [x for x in text.splitlines() if x.startswith("model import failed:")]
    assert len(line) == 1 and "Kafka at 127.0.0.1:9151 does not answer" in line[0], text
    assert "nothing registered" in line[0]
    assert _nothing_registered(mlflow_server, name)


def test_resume_keeps_the_versions_of_the_same_model_and_refuses_other_weights(
    mlflow_server, kafka_env, make_settings, dirs, tmp_path
):
    """`--resume` (a deployment's import step, run on every start; `flywheel run --model`):
    version 1 imported from the same files and weights keeps the registry as it is and publishes
    no second event; the same config and tokenizer with other weights is another model, refused,
    nothing registered. A version whose `deployment_event` tag is missing (the broker failed
    between the registration and the event) gets its event from `--resume`, with the same id."""
    from tests.hf_models import tiny_qwen2_moe_dir
    from trainer.registry import Registry

    root, tok, model_dir = dirs
    name = f"import-resume-{uuid.uuid4().hex[:8]}"
    first = _import(mlflow_server, kafka_env, name, model_dir, tmp_path / "a", "--resume")
    assert first.returncode == 0, first.stdout + first.stderr
    reg = Registry(mlflow_server.uri, name)
    assert [int(v.version) for v in reg.versions()] == [1]
    (event,) = _registered(kafka_env[0], name)

    again = _import(mlflow_server, kafka_env, name, model_dir, tmp_path / "b", "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already imported: versions kept (--resume)" in again.stdout + again.stderr
    assert "event published" not in again.stdout + again.stderr
    assert [int(v.version) for v in reg.versions()] == [1]
    assert reg.alias_version("champion") == 1
    assert _registered(kafka_env[0], name) == [event], "resume published a duplicate"

    # v1 registered, its event never acknowledged (no tag): --resume publishes it, once
    reg.client.delete_model_version_tag(name, "1", "deployment_event")
    fresh = make_settings()  # a log that never got the event
    log_env = (
        fresh,
        {
            "FLYWHEEL_KAFKA_BOOTSTRAP": fresh.kafka_bootstrap,
            "FLYWHEEL_TOPIC_NAMESPACE": fresh.topic_namespace,
        },
    )
    healed = _import(mlflow_server, log_env, name, model_dir, tmp_path / "b", "--resume")
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "missing version_registered event published" in healed.stdout + healed.stderr
    (republished,) = _registered(fresh, name)
    assert republished.event_id == event.event_id and republished.details == event.details
    assert reg.versions()[0].tags["deployment_event"].startswith(event.event_id)
    again = _import(mlflow_server, log_env, name, model_dir, tmp_path / "b", "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(_registered(fresh, name)) == 1

    other = tiny_qwen2_moe_dir(tmp_path / "other-weights", tok, seed=1)
    refused = _import(mlflow_server, kafka_env, name, other, tmp_path / "c", "--resume")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    out = refused.stdout + refused.stderr
    assert "of another model" in out and "other weights" in out, out
    assert [int(v.version) for v in reg.versions()] == [1]
    assert _registered(kafka_env[0], name) == [event]


def test_flywheel_runs_import_step_imports_then_resumes_and_refuses_another_model(
    mlflow_server, kafka_env, dirs, tmp_path
):
    """`flywheel run --model DIR` runs `prepare_model` (app/run.py) before any role starts: the
    import into an empty registry, a resume on the next start (nothing imported again), and
    another model's directory refused with the import's one line (`flywheel run` prints it and
    exits 2, starting no role: run here as a user starts it). The whole stack's end-to-end test
    (tests/e2e/test_hf_loop.py) starts once. Needs about a minute on a loaded machine: four
    processes import torch, transformers and mlflow, and `flywheel run` starts its own broker."""
    from app.run import RunModelError, prepare_model
    from tests.hf_models import tiny_llama_dir
    from trainer.registry import Registry

    root, tok, model_dir = dirs
    name = f"import-run-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        **_env(mlflow_server, kafka_env, name, tmp_path / "data"),
    }
    settings = kafka_env[0].model_copy(update={"model_name": name, "mlflow_uri": mlflow_server.uri})
    logs = tmp_path / "logs"
    logs.mkdir()
    assert prepare_model(settings, model_dir, env, logs) == "imported"
    assert prepare_model(settings, model_dir, env, logs) == "resumed"
    reg = Registry(mlflow_server.uri, name)
    assert [(v.version, v.tags["kind"]) for v in reg.versions()] == [("1", "import")]

    other = tiny_llama_dir(tmp_path / "other-model", tok)
    with pytest.raises(RunModelError) as refused:
        prepare_model(settings, other, env, logs)
    message = str(refused.value)
    assert message.startswith("model import refused:") and "\n" not in message, message
    assert "of another model" in message and "other config or tokenizer files" in message
    assert f"(log: {logs / 'model-import.log'})" in message
    assert [v.version for v in reg.versions()] == ["1"]

    # `flywheel run --model OTHER` on that registry, as a user starts it: its own broker, this
    # session's MLflow server; the refusal is one line, exit 2, and no role starts
    from tests.e2e.stack import stack_env

    run_env, ports = stack_env(tmp_path / "run-data", FLYWHEEL_MODEL_NAME=name)
    run_env["FLYWHEEL_MLFLOW_URI"] = mlflow_server.uri
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "run", "--model", str(other), "--no-live"]
        + ["--replica-base-port", str(ports["replicas"])],
        env=run_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    refusal = [ln for ln in text.splitlines() if "model import refused" in ln]
    assert len(refusal) == 1 and "of another model" in refusal[0], text[-3000:]
    assert "✓ api" not in text and "✓ trainer" not in text, text[-3000:]
    assert [v.version for v in reg.versions()] == ["1"]
