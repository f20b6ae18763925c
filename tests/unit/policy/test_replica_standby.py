"""The built-in engine's standby (app/replica/engines/base.py): a replica loads each new version in
place into the policy of a version it no longer serves, on HF models (dense, MoE, LoRA).

What must hold: the serving version is untouched until the swap; the standby is only a version
the store no longer serves and no request holds; what is swapped in equals the published weights
bit for bit and generates exactly what a policy built from scratch on them generates (tokens and
behaviour log-probs, so no cached rounded weight of the standby's old version survives the load).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.replica.config import ReplicaConfig
from app.replica.engines.base import BuiltinEngine
from app.replica.weights import LoadedVersion, VerificationError, WeightStore, load_verified
from kernels.delta.hashing import hash_state_dict
from policy import build_policy

PROMPTS = ["def add(a, b):", "import os\n", "class Flywheel:\n    def __init__(self"]


def versions(state: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """`state` and n - 1 versions after it, each with every floating tensor moved by seeded noise."""
    out = [state]
    g = torch.Generator().manual_seed(0)
    for _ in range(n - 1):
        prev = out[-1]
        out.append(
            {
                k: (v.float() + 0.02 * torch.randn(v.shape, generator=g)).to(v.dtype)
                if v.is_floating_point()
                else v.clone()
                for k, v in prev.items()
            }
        )
    return out


def bits(policy) -> dict[str, torch.Tensor]:
    return {k: v.view(torch.int16).clone() for k, v in policy.serving_state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def generated(policy) -> list[tuple[list[int], list[float]]]:
    prompts = [policy.tokenizer.encode(p) for p in PROMPTS]
    return [
        (s.tokens, s.logprobs)
        for s in policy.generate(prompts, max_tokens=5, temperature=0.9, seed=3)
    ]


class Replica:
    """A store and the built-in engine, loading versions as the sync agent does."""

    def __init__(self, config: dict, tmp: Path, standby: bool = True):
        self.config = config
        self.engine = BuiltinEngine(ReplicaConfig(cache_dir=tmp, standby=standby))
        self.store = WeightStore()

    def load(self, version: str, state: dict, sha: str | None = None) -> LoadedVersion:
        digests, real = hash_state_dict(state, 1)
        return self.engine.load(
            "champion",
            version,
            state,
            self.config,
            sha or real,
            store=self.store,
            digests=None if sha else digests,
        )


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_version_loads_into_the_retired_policy_and_generates_as_one_built_from_scratch(
    kind, hf_llama_dir, hf_moe_dir, tmp_path
):
    model_dir = hf_llama_dir if kind == "dense" else hf_moe_dir
    policy = build_policy({"type": "hf", "model_dir": str(model_dir)}).eval()
    config = policy.config_dict()
    states = versions(policy.serving_state_dict(), 3)
    r = Replica(config, tmp_path)
    v1 = r.load("1", states[0])
    r.store.swap(champion=v1)
    generated(v1.policy)  # fills v1's cache of bf16-rounded weights, which v3 must not reuse
    v2 = r.load("2", states[1])
    assert v2.policy is not v1.policy  # v1 is served: nothing to load into, a fresh shadow
    assert same(bits(v1.policy), states[0])  # built beside the served version, not over it
    r.store.swap(champion=v2)
    v3 = r.load("3", states[2])
    assert v3.policy is v1.policy  # retired, no request on it: loaded in place
    assert same(bits(v2.policy), states[1])  # the served version is untouched until the swap
    assert same(bits(v3.policy), states[2])
    scratch = load_verified("3", states[2], config, hash_state_dict(states[2], 1)[1])
    assert generated(v3.policy) == generated(scratch.policy)  # tokens and log-probs, exactly


def test_a_retired_version_a_request_still_holds_is_not_loaded_into(hf_llama_dir, tmp_path):
    policy = build_policy({"type": "hf", "model_dir": str(hf_llama_dir)}).eval()
    states = versions(policy.serving_state_dict(), 5)
    r = Replica(policy.config_dict(), tmp_path)
    v1 = r.load("1", states[0])
    r.store.swap(champion=v1)
    lease = r.store.hold(v1)  # a request generating on v1
    assert lease is not None
    v2 = r.load("2", states[1])
    r.store.swap(champion=v2)
    assert r.store.hold(v1) is None  # no new request can pick the retired version
    v3 = r.load("3", states[2])
    assert v3.policy is not v1.policy  # v1's request is still running: left alone
    assert same(bits(v1.policy), states[0])
    lease.release()
    r.store.swap(champion=v3)
    v4 = r.load("4", states[3])
    assert v4.policy is v2.policy and same(bits(v4.policy), states[3])


def test_two_versions_built_before_one_swap_never_share_a_policy(hf_llama_dir, tmp_path):
    """The sync agent builds the champion and the candidate in one reconcile, then swaps both: the
    champion just built is not retired, so the candidate is not loaded into it."""
    policy = build_policy({"type": "hf", "model_dir": str(hf_llama_dir)}).eval()
    states = versions(policy.serving_state_dict(), 4)
    r = Replica(policy.config_dict(), tmp_path)
    v1 = r.load("1", states[0])
    r.store.swap(champion=v1)
    v2 = r.load("2", states[1])
    r.store.swap(champion=v2)  # v1 retired and idle: one standby
    champion = r.load("3", states[2])
    candidate = r.load("4", states[3])
    assert champion.policy is v1.policy and candidate.policy is not champion.policy
    r.store.swap(champion=champion, candidate=candidate, traffic_pct=10.0)
    assert same(bits(champion.policy), states[2]) and same(bits(candidate.policy), states[3])


def test_a_standby_that_fails_verification_keeps_the_old_version_serving_and_is_dropped(
    hf_moe_dir, tmp_path
):
    policy = build_policy({"type": "hf", "model_dir": str(hf_moe_dir)}).eval()
    states = versions(policy.serving_state_dict(), 4)
    r = Replica(policy.config_dict(), tmp_path)
    v1 = r.load("1", states[0])
    r.store.swap(champion=v1)
    v2 = r.load("2", states[1])
    r.store.swap(champion=v2)
    with pytest.raises(VerificationError):
        r.load("3", states[2], sha="0" * 64)  # loaded into v1's policy, then refused
    assert r.store.snapshot().champion is v2 and same(bits(v2.policy), states[1])
    v3 = r.load("3", states[2])
    assert v3.policy is not v1.policy  # the refused standby is never used again
    assert same(bits(v3.policy), states[2])


def test_standby_off_builds_every_version_fresh(hf_llama_dir, tmp_path):
    policy = build_policy({"type": "hf", "model_dir": str(hf_llama_dir)}).eval()
    states = versions(policy.serving_state_dict(), 3)
    r = Replica(policy.config_dict(), tmp_path, standby=False)
    seen = []
    for i, st in enumerate(states):
        lv = r.load(str(i + 1), st)
        r.store.swap(champion=lv)
        seen.append(lv.policy)
    assert len({id(p) for p in seen}) == 3


def test_a_lora_version_loads_its_adapter_into_the_retired_policy(hf_moe_dir, tmp_path):
    from tests.unit.policy.test_lora import MOE_SPEC, lora_policy, randomize_adapter

    policy = lora_policy(hf_moe_dir, MOE_SPEC, tmp_path / "hf-models")
    states = []
    for seed in (1, 2, 3):
        randomize_adapter(policy, seed)
        states.append(policy.serving_state_dict())
    config = policy.config_dict()
    r = Replica(config, tmp_path / "replica")
    v1 = r.load("1", states[0])
    r.store.swap(champion=v1)
    generated(v1.policy)
    v2 = r.load("2", states[1])
    r.store.swap(champion=v2)
    v3 = r.load("3", states[2])
    assert v3.policy is v1.policy and same(bits(v2.policy), states[1])
    scratch = load_verified("3", states[2], config, hash_state_dict(states[2], 1)[1])
    assert generated(v3.policy) == generated(scratch.policy)
