"""The continuous trainer trains a LoRA adapter on an imported Hugging Face model and ships it.

Real broker (make_settings), real MLflow server (mlflow_server), the real `flywheel model import`
CLI (a subprocess, as a user runs it) on a tiny Qwen2-MoE directory built offline
(tests/hf_models.py). `FLYWHEEL_TRAINER_LORA` is the only trainer setting about the model
(no FLYWHEEL_TRAINER_POLICY):

- the trainer continues from the imported v1 (full weights) with a fresh adapter on attention
  projections and the fused experts (`target_parameters`); its optimizer holds the adapter only;
- rollouts sampled from the champion v1 train it with the train/infer `mismatch` exactly 0.0;
- v2 (the first LoRA version) ships as an anchor (v1's tensors are another layout): the adapter
  alone, rebuilt from the registry's artifacts bit for bit; a replica's config for it carries the
  base weights by hash and `load_verified` gives a policy that generates;
- with v2 as champion, rollouts sampled by the replica's LoRA policy give `mismatch` exactly 0.0
  (the numerics contract with a non-zero adapter through the real loop);
- v3 ships as an adapter delta from v2: v2 + delta rebuilt by apply_chain equals the trainer's
  adapter bit for bit, a replica swaps it in sharing v2's base tensors, and the pyfunc generates;
  the base weights are stored once: v3's artifacts name v2's (`hf_ref.json`), and a replica with
  an empty cache and a fresh registry reader follow that reference;
- a restarted trainer resumes the same fp32 adapter and optimizer moments; its state file holds
  the adapter's masters alone (no base tensor: far smaller than the base weights), and a restart
  whose base model files are gone or changed fails naming them.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/trainer/test_lora_trainer.py -q
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from policy.hf_files import default_cache_root
from tests.integration.trainer.conftest import drain, produce, rollout_records
from trainer.config import TrainerConfig
from trainer.loop import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[3]
LORA = {
    "r": 4,
    "alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


# one better and one worse rollout per group, none alike: any batch of them has a non-zero
# advantage; and steps wait for full batches (on a loaded machine the fixture's 0.5 s wait
# stepped on single rollouts, whose advantage is 0, and moved no weight)
DISTINCT_REWARDS = (1.0, -1.0, 0.75, -0.75, 0.5, -0.5, 0.25, -0.25)
FULL_BATCHES = 60.0  # max_wait_s


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    diff = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        ):
            diff.append(k)
    return diff


def _import(settings, model_dir: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FLYWHEEL_MLFLOW_URI": settings.mlflow_uri,
        "FLYWHEEL_MODEL_NAME": settings.model_name,
        "FLYWHEEL_DATA_DIR": str(settings.data_dir),
        "FLYWHEEL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "FLYWHEEL_TOPIC_NAMESPACE": settings.topic_namespace,
        "COLUMNS": "400",
    }
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "model", "import", str(model_dir)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _mismatches(client, run_id: str) -> list[float]:
    return [m.value for m in client.get_metric_history(run_id, "mismatch")]


def test_the_trainer_trains_and_ships_a_lora_adapter_on_an_imported_model(
    trainer_env, tmp_path, monkeypatch
):
    """Steps below. Needs about a minute: an import, two rounds of training, two ships."""
    from app.contracts.artifacts import apply_chain, fetch_manifest
    from app.replica.fetch import VersionFetcher
    from app.replica.weights import load_verified
    from policy import build_policy
    from policy.lora import LoraPolicy
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer

    settings, cfg_kw = trainer_env
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(settings.data_dir))  # the model-files cache
    model_dir = tiny_qwen2_moe_dir(tmp_path / "moe", train_bpe_tokenizer(tmp_path / "tok"))
    _import(settings, model_dir)
    monkeypatch.setenv("FLYWHEEL_TRAINER_LORA", __import__("json").dumps(LORA))
    cfg_kw = {k: v for k, v in cfg_kw.items() if k != "policy"} | {"max_wait_s": FULL_BATCHES}
    cfg = TrainerConfig(**cfg_kw)  # FLYWHEEL_TRAINER_LORA from the environment, as a user sets it
    assert cfg.lora is not None and cfg.policy == {}
    client = MlflowClient(settings.mlflow_uri)
    fetcher = VersionFetcher(settings)
    trainer = Trainer(settings, cfg)
    try:
        assert trainer.last_shipped == 1 and isinstance(trainer.policy, LoraPolicy)
        adapter = {id(p) for p in trainer.policy.adapter_parameters()}
        opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        assert {id(p) for p in opt_params} == adapter, "the optimizer must hold the adapter only"

        # rollouts from the champion v1 (the full imported model, as a replica serves it)
        v1_state = trainer.registry.download_serving_state(1)
        champion = build_policy(trainer.registry.policy_config(1))
        champion.load_serving_state_dict(v1_state)
        champion.eval()
        rewards = itertools.cycle(DISTINCT_REWARDS)
        records = rollout_records(champion, 1, 8, lambda _t: next(rewards), group_size=2)
        for r in records:
            r["tokenizer"] = champion.tokenizer.name
        produce(settings, records)
        drain(trainer, len(records))
        assert trainer.step >= 2
        assert set(_mismatches(client, trainer.run_id)) == {0.0}

        # v2: the first LoRA version, an anchor holding the adapter alone
        assert trainer.maybe_ship(force=True) == 2
        serving2 = trainer.policy.serving_state_dict()
        assert all("lora_" in k for k in serving2)
        m2 = fetch_manifest(fetcher.fetch_file, "2")
        assert m2.parent_version is None and m2.anchor is not None and m2.delta is None
        v2_state, m2 = apply_chain("2", fetcher.fetch_file)
        assert _same_bits(v2_state, serving2) == []
        config2 = fetcher.policy_config("2")
        assert config2["lora"]["r"] == LORA["r"] and config2["files_sha256"]
        lv2 = load_verified(
            "2",
            v2_state,
            config2,
            m2.checkpoint_sha256,
            digests={t.name: t.sha256 for t in m2.tensors},
        )

        # champion -> v2: rollouts the replica's LoRA policy samples score with mismatch 0.0
        client.set_registered_model_alias(settings.model_name, "champion", "2")
        trainer._refresh_champion()
        assert trainer.ref_version == 2
        seen = len(_mismatches(client, trainer.run_id))
        records = rollout_records(lv2.policy, 2, 8, lambda _t: next(rewards), group_size=2)
        for r in records:
            r["tokenizer"] = lv2.policy.tokenizer.name
        produce(settings, records)
        drain(trainer, len(records))
        new = _mismatches(client, trainer.run_id)[seen:]
        assert new and set(new) == {0.0}, f"LoRA train/infer mismatch {new}"

        # v3: an adapter delta from v2, rebuilt bit for bit; the replica swaps the adapter only
        assert trainer.maybe_ship(force=True) == 3
        serving3 = trainer.policy.serving_state_dict()
        assert _same_bits(serving3, serving2), "the optimizer steps changed no adapter weight"
        m3 = fetch_manifest(fetcher.fetch_file, "3")
        assert m3.parent_version == "2" and m3.delta is not None and m3.anchor is None
        # the base is stored once: v2's artifacts hold it, v3's name v2's (hf_files.HF_REF)
        src2, src3 = (client.get_model_version(settings.model_name, v).source for v in ("2", "3"))
        assert _artifact_names(settings, f"{src2}/artifacts/hf") >= {"model.safetensors"}
        assert "hf" not in _artifact_names(settings, f"{src3}/artifacts")
        ref = json.loads(fetcher._get(f"{src3}/artifacts/hf_ref.json"))
        assert ref == {"files_sha256": config2["files_sha256"], "source": src2}, ref
        shutil.rmtree(default_cache_root() / config2["files_sha256"])  # the replica follows it
        v3_state, m3 = apply_chain("3", fetcher.fetch_file, held=("2", lv2.state))
        assert _same_bits(v3_state, serving3) == []
        config3 = fetcher.policy_config("3")
        assert (default_cache_root() / config3["files_sha256"] / "model.safetensors").is_file()
        lv3 = load_verified(
            "3",
            v3_state,
            config3,
            m3.checkpoint_sha256,
            template=lv2,
            digests={t.name: t.sha256 for t in m3.tensors},
        )
        base2 = {k: t.data_ptr() for k, t in lv2.policy.model.state_dict().items()}
        shared = [k for k, t in lv3.policy.model.state_dict().items() if t.data_ptr() == base2[k]]
        assert shared and all("lora_" not in k for k in shared)
        tok = lv3.policy.tokenizer
        samples = lv3.policy.generate(
            [tok.encode("def add(a, b):\n    ")], max_tokens=6, temperature=1.0, seed=1
        )
        assert samples[0].tokens and samples[0].routes is not None

        import mlflow

        mlflow.set_tracking_uri(settings.mlflow_uri)
        model = mlflow.pyfunc.load_model(f"models:/{settings.model_name}/3")
        out = model.predict(["def add(a, b):\n    "], params={"max_tokens": 6, "seed": 1})
        assert len(out) == 1 and isinstance(out[0], str)

        # the registry's reader (trainer restart, gate, evaluator: hf_files.ensure_from_artifacts)
        # fills a fresh cache with the base weights from v3's artifacts alone, verified
        fresh = tmp_path / "fresh-cache"
        config3 = trainer.registry.policy_config(3, cache_root=fresh)
        assert (fresh / config3["files_sha256"] / "model.safetensors").is_file()
        rebuilt = build_policy({**config3, "model_dir": str(fresh / config3["files_sha256"])})
        rebuilt.load_serving_state_dict(v3_state)
        with torch.no_grad():
            assert torch.equal(
                rebuilt.completion_logits([[5, 6]], [[7, 8]])[0],
                lv3.policy.completion_logits([[5, 6]], [[7, 8]])[0],
            )

        _check_export(settings, tmp_path, v3_state)

        # restart: the same fp32 adapter masters and optimizer moments
        trainer.save()
        masters = {k: v.clone() for k, v in trainer.policy.state_dict().items() if "lora_" in k}
        moments = trainer.optimizer.state_dict()["state"]
        assert moments, "the optimizer has no moments to resume"
    finally:
        trainer.close()
    again = Trainer(settings, cfg)
    try:
        assert isinstance(again.policy, LoraPolicy) and again.last_shipped == 3
        now = {k: v for k, v in again.policy.state_dict().items() if "lora_" in k}
        assert _same_bits(now, masters) == [] and next(iter(now.values())).dtype == torch.float32
        resumed = again.optimizer.state_dict()["state"]
        assert resumed.keys() == moments.keys()
        for i in moments:
            assert torch.equal(resumed[i]["exp_avg"], moments[i]["exp_avg"])
        base = again.policy.base_dir()
    finally:
        again.close()
        fetcher.close()
    _check_state_holds_the_adapter_only(settings, cfg, base, masters)


def _check_state_holds_the_adapter_only(settings, cfg, base: Path, masters: dict) -> None:
    """The trainer state keeps the adapter's fp32 masters and a reference to the base (the policy
    config's `files_sha256`); the base is rebuilt from its verified files, so a missing or
    different base directory stops the restart with the reason."""
    from trainer.checkpoint import load_state, state_path

    state_dir = cfg.resolved_state_dir(settings.data_dir)
    state = load_state(state_dir)
    keys = set(state["model"])
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), sorted(keys)[:5]
    assert {k.removeprefix("model.") for k in masters} == keys, "exactly the adapter's masters"
    assert all(v.dtype == torch.float32 for v in state["model"].values())
    assert state["policy_config"]["files_sha256"] == base.name, "the base, by its files' hash"
    base_bytes = (base / "model.safetensors").stat().st_size
    saved = state_path(state_dir).stat().st_size
    print(f"trainer state {saved} bytes; base weights {base_bytes} bytes (bf16)")
    assert saved < base_bytes / 2, (saved, base_bytes)

    moved = base.with_name(base.name + ".moved")
    base.rename(moved)
    try:
        with pytest.raises(RuntimeError, match="cannot be resumed") as gone:
            Trainer(settings, cfg)
        assert base.name in str(gone.value) and "no such directory" in str(gone.value)
        shutil.copytree(moved, base)
        weights = base / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x01  # one bit of the last tensor: another base
        weights.write_bytes(bytes(data))
        with pytest.raises(RuntimeError, match="cannot be resumed") as changed:
            Trainer(settings, cfg)
        assert f"the policy config says {base.name}" in str(changed.value)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        moved.rename(base)


def _artifact_names(settings, uri: str) -> set[str]:
    import mlflow

    return {
        Path(f.path).name
        for f in mlflow.artifacts.list_artifacts(artifact_uri=uri, tracking_uri=settings.mlflow_uri)
    }


def _check_export(settings, tmp_path: Path, v3_state: dict[str, torch.Tensor]) -> None:
    """`flywheel model export 3` (the real CLI, in process): base + adapter/ that peft loads with
    exactly v3's adapter, and --merged that transformers loads alone, with logits close to the
    base + adapter's (merging rounds W + s * B @ A once per weight: not bit-equal); bad input
    exits 2 with one line."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from app.cli import app

    env = {
        "FLYWHEEL_MLFLOW_URI": settings.mlflow_uri,
        "FLYWHEEL_MODEL_NAME": settings.model_name,
        "FLYWHEEL_DATA_DIR": str(settings.data_dir),
        "COLUMNS": "400",
    }
    runner = CliRunner()
    plain, merged = tmp_path / "export-plain", tmp_path / "export-merged"
    for args in (["3", "--out", str(plain)], ["3", "--out", str(merged), "--merged"]):
        done = runner.invoke(app, ["model", "export", *args], env=env)
        assert done.exit_code == 0, done.output
    adapter = load_file(str(plain / "adapter" / "adapter_model.safetensors"))
    assert adapter.keys() == v3_state.keys()
    assert all(torch.equal(adapter[k], v3_state[k].float()) for k in v3_state)
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    kwargs["experts_implementation"] = "eager"
    ids = torch.tensor([[0, 5, 17, 42, 9]])
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(plain), **kwargs), str(plain / "adapter")
        ).eval()
        want = peft_model(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(merged), **kwargs).eval()(input_ids=ids)
    torch.testing.assert_close(got.logits, want, rtol=1e-4, atol=1e-4)
    for args, error in (
        (["99", "--out", str(tmp_path / "x")], "has no version 99"),
        (["3", "--out", str(plain)], "exists and is not an empty directory"),
    ):
        done = runner.invoke(app, ["model", "export", *args], env=env)
        assert done.exit_code == 2 and error in done.output, done.output


def test_a_rejected_lora_version_rebases_onto_the_full_champion_with_a_fresh_adapter(
    trainer_env, tmp_path, monkeypatch
):
    """The gate finds the first LoRA version (v2) confidently worse than the imported champion v1:
    the trainer continues from v1, whose weights are another layout than its adapter, so it builds
    a fresh adapter on v1's base (the same logits as v1, bit for bit) with a fresh optimizer over
    the adapter alone, and its next version ships and rebuilds from the registry."""
    from app.contracts.artifacts import apply_chain
    from app.replica.fetch import VersionFetcher
    from policy import build_policy
    from policy.lora import LoraPolicy
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer

    settings, cfg_kw = trainer_env
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(settings.data_dir))
    model_dir = tiny_qwen2_moe_dir(tmp_path / "moe", train_bpe_tokenizer(tmp_path / "tok"))
    _import(settings, model_dir)
    monkeypatch.setenv("FLYWHEEL_TRAINER_LORA", __import__("json").dumps(LORA))
    cfg_kw = {k: v for k, v in cfg_kw.items() if k != "policy"}
    trainer = Trainer(settings, TrainerConfig(**cfg_kw, verdict_check_s=1.0))
    client = MlflowClient(settings.mlflow_uri)
    fetcher = VersionFetcher(settings)
    try:
        v1 = build_policy(trainer.registry.policy_config(1))
        v1.load_serving_state_dict(trainer.registry.download_serving_state(1))
        rewards = itertools.cycle([1.0, -1.0])

        def train_on_v1(seed: int) -> None:
            records = rollout_records(v1, 1, 4, lambda _t: next(rewards), group_size=2, seed=seed)
            for r in records:
                r["tokenizer"] = v1.tokenizer.name
            produce(settings, records)
            drain(trainer, len(records))

        train_on_v1(seed=0)
        assert trainer.maybe_ship(force=True) == 2
        client.set_model_version_tag(settings.model_name, "2", "flywheel.gate.status", "failed")
        client.set_model_version_tag(
            settings.model_name, "2", "flywheel.gate.reward_vs_champion", "fail -0.5"
        )
        assert trainer.maybe_rebase(now=1e9) == 1
        policy = trainer.policy
        assert isinstance(policy, LoraPolicy) and trainer.pending.rebased_on == 1
        assert all(not v.any() for k, v in policy.serving_state_dict().items() if "lora_B" in k)
        opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        assert {id(p) for p in opt_params} == {id(p) for p in policy.adapter_parameters()}
        assert not trainer.optimizer.state
        prompts, comps = [[5, 6, 7], []], [[8, 9], [10]]
        with torch.no_grad():
            assert torch.equal(
                policy.completion_logits(prompts, comps)[0], v1.completion_logits(prompts, comps)[0]
            ), "a fresh adapter on v1's base must compute exactly v1"

        train_on_v1(seed=1)
        assert trainer.maybe_ship(force=True) == 3
        state3, _ = apply_chain("3", fetcher.fetch_file)
        assert _same_bits(state3, trainer.policy.serving_state_dict()) == []
    finally:
        fetcher.close()
        trainer.close()
