"""LoRA on Hugging Face policies (policy/lora.py): the setting, what trains, what is served,
the numerics contract with a non-zero adapter, the replica's adapter swap and the export."""

from __future__ import annotations

import json

import pytest
import torch

from policy import build_policy
from policy.lora import LoraPolicy, LoraTargetError, export_dir, to_lora
from policy.lora_spec import LoraSpec

DENSE_SPEC = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
MOE_SPEC = LoraSpec(
    r=4,
    alpha=8,
    target_modules=["q_proj", "v_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
)
PROMPTS = ["def add(a, b):", "import os\n", "", "class Flywheel:\n    def __init__(self"]


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hf-models"


def lora_policy(model_dir, spec: LoraSpec, cache_root, seed: int = 0) -> LoraPolicy:
    torch.manual_seed(seed)
    return to_lora(build_policy({"type": "hf", "model_dir": str(model_dir)}), spec, cache_root)


def randomize_adapter(policy: LoraPolicy, seed: int, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.adapter_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def encoded(policy) -> list[list[int]]:
    return [policy.tokenizer.encode(p) for p in PROMPTS]


def full_logits(policy, prompts) -> torch.Tensor:
    comps = [[5, 6, 7]] * len(prompts)
    with torch.no_grad():
        return policy.completion_logits(prompts, comps)[0]


# --- the setting ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ('{"r": 0}', "FLYWHEEL_TRAINER_LORA: r: Input should be greater than 0"),
        ("{r: 8}", "FLYWHEEL_TRAINER_LORA must be a JSON object"),
        ('{"r": 8, "rank": 4}', "FLYWHEEL_TRAINER_LORA: rank: Extra inputs"),
        (
            '{"r": 8, "dropout": 0.1, "target_parameters": ["mlp.experts.down_proj"]}',
            "FLYWHEEL_TRAINER_LORA: .*dropout must be 0 with target_parameters",
        ),
        ('{"r": 8, "target_modules": []}', "at least one of target_modules / target_parameters"),
    ],
)
def test_a_bad_lora_setting_is_an_error_naming_the_variable(monkeypatch, value, error):
    from pydantic import ValidationError

    from trainer.config import TrainerConfig

    monkeypatch.setenv("FLYWHEEL_TRAINER_LORA", value)
    with pytest.raises(ValidationError, match=error):
        TrainerConfig()


def test_the_lora_setting_parses_defaults_and_needs_an_hf_policy(monkeypatch):
    from pydantic import ValidationError

    from trainer.config import TrainerConfig

    monkeypatch.setenv("FLYWHEEL_TRAINER_LORA", "")
    assert TrainerConfig().lora is None
    monkeypatch.setenv("FLYWHEEL_TRAINER_LORA", '{"r": 8}')
    lora = TrainerConfig().lora
    assert lora == {
        "r": 8,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": [],
    }
    monkeypatch.setenv("FLYWHEEL_TRAINER_POLICY", '{"d_model": 32}')
    with pytest.raises(ValidationError, match="FLYWHEEL_TRAINER_LORA needs a Hugging Face policy"):
        TrainerConfig()


def test_targets_the_model_does_not_have_are_refused_naming_them(hf_moe_dir, cache):
    bad = LoraSpec(
        r=2,
        target_modules=["q_proj", "qkv_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.w1"],
    )
    with pytest.raises(LoraTargetError) as err:
        lora_policy(hf_moe_dir, bad, cache)
    msg = str(err.value)
    assert "target_modules ['qkv_proj']" in msg and "target_parameters ['mlp.experts.w1']" in msg
    assert "q_proj" in msg.split("Linear modules:")[1]  # what it has, to pick from
    assert "experts.gate_up_proj" in msg.split("fused 3-d parameters:")[1]


def test_the_trainer_setting_converts_a_full_policy_and_refuses_another_adapter(
    hf_moe_dir, tmp_path, monkeypatch
):
    """trainer/loop.py applies FLYWHEEL_TRAINER_LORA with `with_lora_setting` to the policy it starts
    from (a registered version, its own state, the base) and to a rebase's champion."""
    from policy.lora import with_lora_setting

    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path))  # to_lora's default cache
    want = MOE_SPEC.model_dump()
    full = build_policy({"type": "hf", "model_dir": str(hf_moe_dir)})
    assert with_lora_setting(full, None, "v1") is full
    lora = with_lora_setting(full, want, "registered v1")
    assert isinstance(lora, LoraPolicy) and lora.config.lora == MOE_SPEC
    assert (tmp_path / "hf-models" / lora.config.files_sha256 / "model.safetensors").is_file()
    assert with_lora_setting(lora, want, "registered v2") is lora
    with pytest.raises(
        ValueError, match="registered v2 is a LoRA policy .* FLYWHEEL_TRAINER_LORA is"
    ):
        with_lora_setting(lora, None, "registered v2")
    with pytest.raises(
        ValueError, match='FLYWHEEL_TRAINER_LORA .*"r": 8.* differs from the adapter'
    ):
        with_lora_setting(lora, {**want, "r": 8}, "registered v2")
    with pytest.raises(ValueError, match="is a full fine-tuning state"):
        with_lora_setting(full, want, "the trainer state", convert=False)
    with pytest.raises(ValueError, match="FLYWHEEL_TRAINER_LORA: LoRA targets not in the model"):
        with_lora_setting(full, {"r": 2, "target_modules": ["w_qkv"]}, "registered v1")
    builtin = build_policy({"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 32})
    with pytest.raises(
        ValueError, match="needs a Hugging Face policy; built-in is type 'moe-byte'"
    ):
        with_lora_setting(builtin, want, "built-in")


# --- what trains, what is served ------------------------------------------------------------------


def test_a_fresh_adapter_is_exactly_the_base_and_only_the_adapter_trains(hf_moe_dir, cache):
    full = build_policy({"type": "hf", "model_dir": str(hf_moe_dir)})
    torch.manual_seed(0)
    policy = to_lora(full, MOE_SPEC, cache)
    prompts = encoded(policy)
    assert policy.tokenizer.name == full.tokenizer.name  # rollouts of either are one tokenizer's
    # peft's init (B = 0): the same logits as the full policy it was made from, bit for bit
    assert torch.equal(full_logits(policy, prompts), full_logits(full, prompts))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    base_before = {
        n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad
    }
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    samples = policy.generate(prompts, max_tokens=6, temperature=1.0, seed=1)
    comps, routes = [s.tokens for s in samples], [s.routes for s in samples]
    for _ in range(3):
        opt.zero_grad()
        loss = -policy.logprobs(prompts, comps, routes).sum()
        loss.backward()
        assert all(p.grad is None for n, p in policy.named_parameters() if n not in trainable)
        opt.step()
    after = dict(policy.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base_before.items()), "the base moved"
    assert not torch.equal(full_logits(policy, prompts), full_logits(full, prompts))
    # the serving state: the adapter alone, bf16, under peft's adapter_model names
    state = policy.serving_state_dict()
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    assert len(state) == len(trainable)
    assert any("experts" in k for k in state) and any("q_proj" in k for k in state)
    # any role rebuilds it from the config alone (+ the base files in the cache) and the adapter
    config = policy.config_dict()
    assert config["lora"] == MOE_SPEC.model_dump() and config["files_sha256"]
    again = build_policy(json.loads(json.dumps(config)))
    again.load_serving_state_dict(state)
    assert torch.equal(full_logits(again, prompts), full_logits(policy, prompts))
    with pytest.raises(ValueError, match="not this LoRA adapter"):
        again.load_serving_state_dict(full.serving_state_dict())


def test_the_base_weights_are_model_files_covered_by_files_sha256(hf_moe_dir, cache):
    from policy.hf_files import HFFilesError

    policy = lora_policy(hf_moe_dir, MOE_SPEC, cache)
    base = policy.base_dir()
    assert (base / "model.safetensors").is_file()
    data = bytearray((base / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (base / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(HFFilesError, match="model files hash to"):
        build_policy(policy.config_dict())


def test_the_train_state_is_the_adapter_masters_and_the_base_comes_from_its_files(
    hf_moe_dir, cache
):
    """`train_state_dict` (what the trainer's local state keeps): the fp32 adapter masters only;
    a policy built from the config alone, with them loaded, computes the same logits bit for bit."""
    policy = lora_policy(hf_moe_dir, MOE_SPEC, cache)
    randomize_adapter(policy, seed=7)
    with torch.no_grad():
        for p in policy.adapter_parameters():
            p.add_(1e-4)  # fp32 masters that bf16 cannot hold: the state keeps them exactly
    state = policy.train_state_dict()
    adapter = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert set(state) == adapter and all(".lora_A." in k or ".lora_B." in k for k in state)
    assert all(v.dtype == torch.float32 for v in state.values())
    base_numel = sum(p.numel() for p in policy.parameters() if not p.requires_grad)
    assert sum(v.numel() for v in state.values()) < base_numel / 10
    again = build_policy(json.loads(json.dumps(policy.config_dict())))
    again.load_train_state_dict(state)
    own = again.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items())
    prompts = encoded(policy)
    assert torch.equal(full_logits(again, prompts), full_logits(policy, prompts))
    with pytest.raises(ValueError, match="not this LoRA adapter's masters"):
        again.load_train_state_dict(policy.state_dict())  # a state that holds the base too


# --- the numerics contract with LoRA --------------------------------------------------------------


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_generate_logprobs_equal_logprobs_bit_for_bit_with_a_nonzero_adapter(
    which, hf_llama_dir, hf_moe_dir, cache
):
    from kernels.hf_mode import uncovered_ops

    before = uncovered_ops()
    spec = DENSE_SPEC if which == "dense" else MOE_SPEC
    policy = lora_policy(hf_llama_dir if which == "dense" else hf_moe_dir, spec, cache)
    prompts = encoded(policy)
    base = full_logits(policy, prompts)
    randomize_adapter(policy, seed=3)
    assert not torch.equal(full_logits(policy, prompts), base), "the adapter does not act"
    for temperature in (0.0, 0.7):
        samples = policy.generate(prompts, max_tokens=10, temperature=temperature, seed=5)
        with torch.no_grad():
            lp = policy.logprobs(
                prompts, [s.tokens for s in samples], [s.routes for s in samples], temperature
            )
        for i, s in enumerate(samples):
            behaviour = torch.tensor(s.logprobs, dtype=torch.float32)
            got = lp[i, : len(s.tokens)]
            assert torch.equal(behaviour, got), (
                f"{which} T={temperature} row {i}: max diff {float((behaviour - got).abs().max())}"
            )
    assert uncovered_ops() == before, f"LoRA dispatched uncovered ops {uncovered_ops() - before}"


def test_the_fused_expert_adapter_acts_through_the_forward(hf_moe_dir, cache):
    """target_parameters alone (peft's ParamWrapper on experts.gate_up_proj / down_proj) changes the
    logits: the adapter is applied inside the policy's functional forward, not bypassed."""
    spec = LoraSpec(r=2, target_modules=[], target_parameters=["mlp.experts.down_proj"])
    policy = lora_policy(hf_moe_dir, spec, cache)
    prompts = encoded(policy)
    base = full_logits(policy, prompts)
    randomize_adapter(policy, seed=4)
    assert not torch.equal(full_logits(policy, prompts), base)


# --- the replica: base resident, adapter swapped ---------------------------------------------------


def test_held_lora_versions_share_the_base_and_a_corrupt_adapter_delta_is_refused(
    hf_moe_dir, cache, tmp_path
):
    from app.contracts.artifacts import ChainError, apply_chain, publish_version
    from app.replica.weights import WeightStore, load_verified
    from kernels.delta.hashing import hash_state_dict

    policy = lora_policy(hf_moe_dir, MOE_SPEC, cache)
    config = policy.config_dict()
    states = []
    for seed in (1, 2, 3):
        randomize_adapter(policy, seed)
        states.append(policy.serving_state_dict())
    out = tmp_path / "artifacts"
    manifests = [publish_version(out / "1", "1", states[0], None, None, None)]
    for v in (2, 3):
        manifests.append(
            publish_version(
                out / str(v), str(v), states[v - 1], states[v - 2], str(v - 1), manifests[-1]
            )
        )

    def fetch(version: str, name: str) -> bytes:
        return (out / version / name).read_bytes()

    v1 = load_verified("1", states[0], config, hash_state_dict(states[0], 1)[1])
    sd2, m2 = apply_chain("2", fetch, held=("1", v1.state))
    v2 = load_verified("2", sd2, config, m2.checkpoint_sha256, template=v1)
    store = WeightStore()
    store.swap(champion=v1, candidate=v2, traffic_pct=50.0)
    # the base is resident once: the same storage in both held versions; the adapters are their own
    own1, own2 = v1.policy.model.state_dict(), v2.policy.model.state_dict()
    adapter_keys = set(v1.policy._adapter_keys.values())
    for k, t in own1.items():
        if k in adapter_keys:
            assert t.data_ptr() != own2[k].data_ptr(), k
        else:
            assert t.data_ptr() == own2[k].data_ptr(), k
    assert not torch.equal(full_logits(v1.policy, [[1, 2]]), full_logits(v2.policy, [[1, 2]]))
    # v3's delta corrupted in transit: no verifiable path (the anchor path needs it too)
    delta = out / "3" / manifests[2].delta.file
    data = bytearray(delta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    delta.write_bytes(bytes(data))
    with pytest.raises(ChainError):
        apply_chain("3", fetch, held=("2", v2.state))
    serving = store.snapshot()  # nothing was swapped: v2 keeps serving its verified adapter
    assert serving.candidate is v2
    assert all(torch.equal(v2.policy.serving_state_dict()[k], sd2[k]) for k in sd2)
    samples = serving.candidate.policy.generate([[1, 2, 3]], max_tokens=4, temperature=0.0)
    assert len(samples[0].tokens) >= 1


# --- export ---------------------------------------------------------------------------------------


def test_export_loads_with_transformers_and_peft_and_gives_the_policys_logits(
    hf_moe_dir, cache, tmp_path
):
    """Without --merged: base + adapter dir; peft computes base(x) + B(A(x)) * s with the same
    values in the same order as the policy, so the logits are equal bit for bit (default kernels).
    Merged: (W + s * B @ A) x rounds differently from W x + s * B(A x): close, not equal."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = lora_policy(hf_moe_dir, MOE_SPEC, cache)
    randomize_adapter(policy, seed=7, std=0.05)
    served = build_policy(policy.config_dict())  # what a registered version gives: bf16 adapter
    served.load_serving_state_dict(policy.serving_state_dict())
    served.set_kernels("default")
    ids = torch.tensor([[served.tokenizer.start_id, *served.tokenizer.encode("def f(x):")]])
    mask = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        want = served.forward_logits(ids, mask, pos)[0]
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    kwargs["experts_implementation"] = "eager"

    plain = export_dir(served, tmp_path / "plain")
    assert (plain / "adapter" / "adapter_config.json").is_file()
    assert (plain / "adapter" / "adapter_model.safetensors").is_file()
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(plain), **kwargs), str(plain / "adapter")
    ).eval()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    assert torch.equal(got, want), f"max diff {float((got - want).abs().max())}"

    merged = export_dir(served, tmp_path / "merged", merged=True)
    assert not (merged / "adapter").exists()
    model = AutoModelForCausalLM.from_pretrained(str(merged), **kwargs).eval()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    assert not torch.equal(got, full_logits_of_base(served, ids, mask, pos))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def full_logits_of_base(policy: LoraPolicy, ids, mask, pos) -> torch.Tensor:
    with torch.no_grad(), policy.model.disable_adapter():
        return policy.forward_logits(ids, mask, pos)[0]


def test_a_shadow_taken_while_another_thread_generates_is_a_clean_copy(hf_moe_dir, cache):
    """A replica's sync thread makes the next version's shadow while the generation thread runs
    the held one; peft's ParamWrapper holds a parametrization on the experts during each forward.
    `shadow()` waits for the forward to end, so the copy carries no trace of it: loaded with an
    adapter, it computes exactly what a policy built from scratch computes."""
    import threading

    policy = lora_policy(hf_moe_dir, MOE_SPEC, cache)
    randomize_adapter(policy, seed=8)
    prompts = encoded(policy)
    inside, release = threading.Event(), threading.Event()
    wrapper = next(m for n, m in policy.model.named_modules() if n.endswith("mlp.experts"))
    experts = wrapper.get_base_layer()  # runs while both wrappers' parametrizations are on it

    def hold(_module, _args):
        if not inside.is_set():
            inside.set()
            assert release.wait(60), "the test never released the forward"

    handle = experts.register_forward_pre_hook(hold)
    gen = threading.Thread(target=policy.generate, args=(prompts, 3), kwargs={"seed": 0})
    gen.start()
    assert inside.wait(60), "the generation never reached the experts"
    result: dict = {}
    taker = threading.Thread(target=lambda: result.setdefault("shadow", policy.shadow()))
    taker.start()
    taker.join(0.5)
    assert taker.is_alive(), "shadow() copied the policy in the middle of a forward"
    release.set()
    gen.join(60)
    taker.join(60)
    handle.remove()
    shadow = result["shadow"]
    randomize_adapter(policy, seed=9)  # the held version is untouched by loading the shadow
    state = policy.serving_state_dict()
    shadow.load_serving_state_dict(state)
    fresh = build_policy(policy.config_dict())
    fresh.load_serving_state_dict(state)
    assert torch.equal(full_logits(shadow, prompts), full_logits(fresh, prompts))


def test_the_gate_compares_a_lora_version_with_a_full_parent_by_its_merged_weights(
    hf_moe_dir, cache
):
    """The gate's weight check (app/controller/monitors.py) needs the same tensors on both sides:
    a LoRA version's effective weights are the adapter merged into the base, under the names the
    full base version serves; a zero adapter gives the base's serving state exactly, a small one
    changes only targeted tensors and passes, a blown-up one fails on its change, not its names."""
    from app.controller.gate import GateConfig
    from app.controller.monitors import weight_sanity

    full = build_policy({"type": "hf", "model_dir": str(hf_moe_dir)})
    base = full.serving_state_dict()
    assert full.effective_state_dict() is None, "a full policy's serving state is every weight"
    policy = lora_policy(hf_moe_dir, MOE_SPEC, cache)
    fresh = policy.effective_state_dict()
    assert set(fresh) == set(base)
    assert all(torch.equal(fresh[k], base[k]) for k in base), "a zero adapter is the base"

    cfg = GateConfig()

    def weight_change(state):
        checks = weight_sanity(state, base, cfg.max_global_rel_change, cfg.max_tensor_rel_change)
        return next(c for c in checks if c.name == "weight_change")

    randomize_adapter(policy, 1, std=0.01)
    small = policy.effective_state_dict()
    changed = {k for k in base if not torch.equal(small[k], base[k])}
    assert changed and all(any(t in k for t in ("q_proj", "v_proj", "experts")) for k in changed), (
        sorted(changed)[:5]
    )
    assert weight_change(small).status == "pass", weight_change(small)
    randomize_adapter(policy, 1, std=3.0)
    blown = weight_change(policy.effective_state_dict())
    assert blown.status == "fail" and "names differ" not in (blown.detail or ""), blown
