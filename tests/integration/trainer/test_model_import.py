"""`flywheel model import DIR` against a real MLflow server (tests/conftest.py `mlflow_server`).

The CLI runs as a user runs it (`python -m app.cli model import`, a subprocess with FLYWHEEL_*
variables). A tiny Qwen2-MoE directory (tests/hf_models.py, built offline) becomes v1 with
`champion` on it; a fresh cache directory filled from the version's artifacts alone
(`Registry.policy_config`) rebuilds a policy whose serving weights equal the source's bf16 weights
bit for bit, with the same tokenizer id; the anchor's checkpoint hash is those weights' hash; the
pyfunc generates; a replica's `VersionFetcher.policy_config` and the gate's `load_version` fill
their own caches the same way.
Every bad input exits 2 with one line naming the file or field, and registers
nothing; a second import is refused without --force and replaces the model with it.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/trainer/test_model_import.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("import")
    tok = train_bpe_tokenizer(root / "tok")
    return root, tok, tiny_qwen2_moe_dir(root / "tiny-moe", tok)


def _import(mlflow_server, name: str, model_dir: Path, data_dir: Path, *flags: str):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FLYWHEEL_MLFLOW_URI": mlflow_server.uri,
        "FLYWHEEL_MODEL_NAME": name,
        "FLYWHEEL_DATA_DIR": str(data_dir),
        "COLUMNS": "400",
    }
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "model", "import", str(model_dir), *flags],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _nothing_registered(mlflow_server, name: str) -> bool:
    client = MlflowClient(mlflow_server.uri, mlflow_server.uri)
    try:
        client.get_registered_model(name)
    except MlflowException:
        return True
    return not client.search_model_versions(f"name='{name}'")


def _bits(sd: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in sd.items()}


def test_import_registers_v1_as_champion_and_the_artifacts_rebuild_the_model(
    mlflow_server, dirs, tmp_path, monkeypatch
):
    import mlflow

    from kernels.delta import hash_state_dict
    from trainer.policy import build_policy
    from trainer.registry import Registry

    _, _, model_dir = dirs
    name = f"import-{uuid.uuid4().hex[:8]}"
    out = _import(mlflow_server, name, model_dir, tmp_path / "importer")
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

    again = _import(mlflow_server, name, model_dir, tmp_path / "importer")
    assert again.returncode == 2
    assert "already holds versions [1]" in again.stderr and "--force" in again.stderr
    assert [int(v.version) for v in reg.versions()] == [1]
    forced = _import(mlflow_server, name, model_dir, tmp_path / "importer", "--force")
    assert forced.returncode == 0, forced.stderr
    assert [int(v.version) for v in reg.versions()] == [1]
    assert reg.alias_version("champion") == 1


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


def test_bad_input_exits_2_names_the_problem_and_registers_nothing(mlflow_server, dirs, tmp_path):
    root, tok, model_dir = dirs
    cases = _bad_dirs(tmp_path, tok, model_dir)
    for case, (bad, needle) in cases.items():
        name = f"bad-{uuid.uuid4().hex[:8]}"
        out = _import(mlflow_server, name, bad, tmp_path / "data")
        assert out.returncode == 2, (case, out.returncode, out.stderr[-2000:])
        line = [x for x in out.stderr.splitlines() if x.startswith("model import refused:")]
        assert len(line) == 1 and needle in line[0], (case, out.stderr[-2000:])
        assert _nothing_registered(mlflow_server, name), case
    assert not (tmp_path / "data" / "hf-models").exists()


def test_resume_keeps_the_versions_of_the_same_model_and_refuses_other_weights(
    mlflow_server, dirs, tmp_path
):
    """`--resume` (a deployment's import step, run on every start; `flywheel run --model`):
    version 1 imported from the same files and weights keeps the registry as it is; the same
    config and tokenizer with other weights is another model, refused, nothing registered."""
    from tests.hf_models import tiny_qwen2_moe_dir
    from trainer.registry import Registry

    root, tok, model_dir = dirs
    name = f"import-resume-{uuid.uuid4().hex[:8]}"
    first = _import(mlflow_server, name, model_dir, tmp_path / "a", "--resume")
    assert first.returncode == 0, first.stdout + first.stderr
    reg = Registry(mlflow_server.uri, name)
    assert [int(v.version) for v in reg.versions()] == [1]

    again = _import(mlflow_server, name, model_dir, tmp_path / "b", "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already imported: versions kept (--resume)" in again.stdout + again.stderr
    assert [int(v.version) for v in reg.versions()] == [1]
    assert reg.alias_version("champion") == 1

    other = tiny_qwen2_moe_dir(root / "other-weights", tok, seed=1)
    refused = _import(mlflow_server, name, other, tmp_path / "c", "--resume")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    out = refused.stdout + refused.stderr
    assert "of another model" in out and "other weights" in out, out
    assert [int(v.version) for v in reg.versions()] == [1]
