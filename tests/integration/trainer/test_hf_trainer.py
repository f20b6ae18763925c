"""The continuous trainer trains and ships a Hugging Face policy, delta-synced to a replica.

Real broker (make_settings) and real MLflow server (mlflow_server); the policy is a tiny Qwen2-MoE
directory or a tiny dense Llama built offline (tests/hf_models.py), named by the trainer's policy
config (`FLYWHEEL_TRAINER_POLICY={"type": "hf", "model_dir": DIR}`):

- first start on an empty registry: v1 is the directory's own weights (bf16), not pretrained even
  though `pretrain_steps` is set;
- rollouts sampled from the champion v1 (with their routed expert ids for the MoE model) go to
  `<ns>.rollouts`; the trainer takes optimizer steps on them replaying the routes, and the
  train/infer `mismatch` (champion log-probs in the trainer vs the logged behaviour log-probs) is
  exactly 0.0;
- v2 ships as a delta from v1: v1 + delta rebuilt by app/contracts/artifacts.apply_chain from the
  registry's artifacts equals the trainer's serving weights bit for bit, and a replica-side
  `load_verified` of it gives a policy that generates, and so does the `models:/<name>/2` pyfunc.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/trainer/test_hf_trainer.py -q
"""

from __future__ import annotations

import pytest
import torch
from mlflow import MlflowClient

from tests.integration.trainer.conftest import PROMPTS, drain, produce, rollout_records
from trainer.config import TrainerConfig
from trainer.loop import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in dtype, shape or any bit (and names only one side has)."""
    diff = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
            diff.append(k)
    return diff


@pytest.mark.parametrize("arch", ["qwen2-moe", "llama"])
def test_the_trainer_ships_an_hf_policy_as_a_delta_a_replica_loads(trainer_env, tmp_path, arch):
    from app.contracts.artifacts import apply_chain, fetch_manifest
    from app.replica.fetch import VersionFetcher
    from app.replica.weights import load_verified
    from policy import build_policy
    from tests.hf_models import tiny_llama_dir, tiny_qwen2_moe_dir, train_bpe_tokenizer

    settings, cfg_kw = trainer_env
    make_dir = tiny_qwen2_moe_dir if arch == "qwen2-moe" else tiny_llama_dir
    model_dir = make_dir(tmp_path / arch, train_bpe_tokenizer(tmp_path / "tok"))
    policy_cfg = {"type": "hf", "model_dir": str(model_dir)}
    # every step a full batch of 4 (the 8 rollouts are on the topic before the first poll): with
    # the fixture's 0.5 s wait a loaded machine stepped on one rollout at a time, whose advantage
    # is 0, and no weight moved (fresh-clone run 8)
    cfg_kw = dict(cfg_kw, policy=policy_cfg, pretrain_steps=300, max_wait_s=60.0)
    trainer = Trainer(settings, TrainerConfig(**cfg_kw))
    client = MlflowClient(settings.mlflow_uri)
    fetcher = VersionFetcher(settings)
    try:
        # v1: the directory's weights in bf16, no pretraining
        assert trainer.last_shipped == 1
        v1 = client.get_model_version(settings.model_name, "1")
        assert v1.tags["kind"] == "base" and v1.tags["parent_version"] == "none"
        assert client.get_model_version_by_alias(settings.model_name, "champion").version == "1"
        v1_state = trainer.registry.download_serving_state(1)
        from_dir = build_policy(policy_cfg).serving_state_dict()
        assert _same_bits(v1_state, from_dir) == [], "v1 must be the model directory's weights"

        # rollouts sampled by the champion (v1 as a replica holds it), routes included
        champion = build_policy(trainer.policy.config_dict())
        champion.load_serving_state_dict(v1_state)
        champion.eval()
        # each group of two: one better, one worse; no two rewards alike, so any batch of them
        # (a step's groups may be split across partitions) has a non-zero advantage
        rewards = iter([1.0, -1.0, 0.75, -0.75, 0.5, -0.5, 0.25, -0.25])
        records = rollout_records(champion, 1, 8, lambda _text: next(rewards), group_size=2)
        for r in records:
            if champion.moe_spec is None:  # dense: no routes
                assert r["routes"] is None and r["route_shape"] is None
            else:
                n_layers, top_k, _ = champion.moe_spec
                assert r["route_shape"] == [len(r["completion_tokens"]), n_layers, top_k]
            r["tokenizer"] = champion.tokenizer.name
        produce(settings, records)
        drain(trainer, len(records))
        assert trainer.pending.rollouts == len(records) and trainer.step >= 2
        mismatch = client.get_metric_history(trainer.run_id, "mismatch")
        assert mismatch and {m.value for m in mismatch} == {0.0}, (
            "trainer log-probs of the champion must equal the behaviour log-probs bit for bit"
        )

        # v2: a delta from v1, rebuilt from the registry's artifacts bit for bit
        assert trainer.maybe_ship(force=True) == 2
        serving = trainer.policy.serving_state_dict()
        assert _same_bits(serving, v1_state), "the optimizer steps changed no weight"
        fetch = fetcher.fetch_file
        m2 = fetch_manifest(fetch, "2")
        assert m2.parent_version == "1" and m2.delta is not None and m2.anchor is None
        held_v1, _ = apply_chain("1", fetch)
        assert _same_bits(held_v1, v1_state) == []
        v2_state, manifest = apply_chain("2", fetch, held=("1", held_v1))
        assert _same_bits(v2_state, serving) == [], "v1 + delta must be the trainer's v2"

        # a replica loads v2 verified and generates with it
        config = fetcher.policy_config("2")
        assert config["type"] == "hf"
        lv = load_verified(
            "2",
            v2_state,
            config,
            manifest.checkpoint_sha256,
            digests={t.name: t.sha256 for t in manifest.tensors},
        )
        tok = lv.policy.tokenizer
        samples = lv.policy.generate(
            [tok.encode(p) for p in PROMPTS[:2]], max_tokens=6, temperature=1.0, seed=1
        )
        assert [len(s.tokens) > 0 for s in samples] == [True, True]
        assert all((s.routes is not None) == (arch == "qwen2-moe") for s in samples)

        import mlflow

        mlflow.set_tracking_uri(settings.mlflow_uri)
        model = mlflow.pyfunc.load_model(f"models:/{settings.model_name}/2")
        out = model.predict(["def add(a, b):\n    ", "x = "], params={"max_tokens": 6, "seed": 1})
        assert len(out) == 2 and all(isinstance(t, str) for t in out)
    finally:
        fetcher.close()
        trainer.close()
