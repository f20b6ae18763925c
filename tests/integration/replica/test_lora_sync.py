"""A real replica (uvicorn, its sync agent on the real broker and MLflow server) follows LoRA versions:
the base model files (weights included, by `files_sha256`) are fetched once, the champion and the
candidate hold ONE copy of the base (the same storage) and their own adapters, a corrupt adapter
delta is refused and the held versions keep serving. Versions are registered the way the trainer
ships them (tests/integration/replica/conftest.py `Registered`) with the adapter of a tiny
Qwen2-MoE (tests/hf_models.py) as the serving state."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.integration.replica.conftest import (
    Registered,
    publish_deployment,
    read_topic,
    serving_equals,
    status,
    wait_for,
)

pytestmark = pytest.mark.integration
LORA = {
    "r": 4,
    "alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


def test_a_replica_keeps_one_base_swaps_adapters_and_refuses_a_corrupt_adapter_delta(
    registered, replica_factory, mlflow_server, tmp_path, monkeypatch
):
    from policy import build_policy
    from policy.lora import to_lora
    from policy.lora_spec import LoraSpec
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer

    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "trainer-data"))
    model_dir = tiny_qwen2_moe_dir(tmp_path / "moe", train_bpe_tokenizer(tmp_path / "tok"))
    torch.manual_seed(0)
    policy = to_lora(build_policy({"type": "hf", "model_dir": str(model_dir)}), LoraSpec(**LORA))
    states = []
    for seed in (1, 2, 3):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in policy.adapter_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        states.append(policy.serving_state_dict())
    settings, _ = registered
    reg = Registered(mlflow_server.uri, settings.model_name, policy.config_dict(), anchor_every=8)
    for st in states:
        reg.add(st)  # v1 the adapter's anchor, v2 and v3 adapter deltas
    assert reg.manifests["2"].delta is not None and reg.manifests["3"].anchor is None

    # the replica's own data dir: it fetches the base files from the registry, not from ours
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "replica-data"))
    publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
    srv = replica_factory(settings, id="replica-lora", retry_interval=0.5)
    wait_for(lambda: status(srv)["champion"] == "1", timeout_s=180, what="champion v1")
    base = tmp_path / "replica-data" / "hf-models" / policy.config.files_sha256
    assert (base / "model.safetensors").is_file(), "the base weights came with the model files"
    publish_deployment(settings, "canary_started", "2", from_version="1", traffic_pct=50.0)
    wait_for(lambda: status(srv)["candidate"] == "2", timeout_s=180, what="candidate v2")
    assert status(srv)["last_sync"]["path"] == "delta", status(srv)["last_sync"]
    assert serving_equals(srv, "champion", states[0]) and serving_equals(
        srv, "candidate", states[1]
    )

    serving = srv.replica.store.snapshot()
    one, two = serving.champion.policy, serving.candidate.policy
    adapter = set(one._adapter_keys.values())
    own1, own2 = one.model.state_dict(), two.model.state_dict()
    shared = [k for k in own1 if own1[k].data_ptr() == own2[k].data_ptr()]
    assert sorted(shared) == sorted(set(own1) - adapter), "the base must be resident once"
    assert all(own1[k].data_ptr() != own2[k].data_ptr() for k in adapter)

    publish_deployment(settings, "promoted", "2", traffic_pct=100.0)
    wait_for(
        lambda: status(srv)["champion"] == "2" and status(srv)["candidate"] is None,
        timeout_s=180,
        what="v2 promoted",
    )

    # v3's adapter delta corrupted in the artifact store: no verifiable path (no anchor after v1
    # without it); the sync fails and v2 keeps serving what was verified
    path = reg.artifact_file(mlflow_server.root / "artifacts", "3", "delta-from-2.fwd")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    publish_deployment(settings, "promoted", "3", traffic_pct=100.0)
    failed = wait_for(
        lambda: read_topic(
            settings, "deployments", 1, where=lambda e: e["type"] == "replica_sync_failed"
        ),
        timeout_s=180,
        what="replica_sync_failed",
    )
    assert failed[0]["version"] == "3" and "ChainError" in failed[0]["details"]["error"]
    assert status(srv)["champion"] == "2" and serving_equals(srv, "champion", states[1])
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "s", "prompt": "def f(x):", "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["model_version"] == "2", r.text
