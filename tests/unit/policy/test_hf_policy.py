"""The HF policy (policy/hf.py) on tiny Llama / Qwen2-MoE directories built offline.

The model directories are what a user hands over: `save_pretrained` output plus a BPE tokenizer
trained on this repo's text (tests/hf_models.py, built once per session in conftest.py).

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/policy/test_hf_policy.py -q
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from policy import build_policy
from policy.base import UNROUTED
from policy.hf import HFPolicy, tokenizer_files

PROMPTS = ["def f(x):\n    return", "import torch\n", "", "class Policy(ABC):"]


def hf_policy(model_dir: Path) -> HFPolicy:
    policy = build_policy({"type": "hf", "model_dir": str(model_dir)})
    assert isinstance(policy, HFPolicy)
    return policy.eval()


def encoded(policy: HFPolicy) -> list[list[int]]:
    return [policy.tokenizer.encode(p) for p in PROMPTS]


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
        for k in a
    )


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_id_is_the_name_and_a_hash_of_the_tokenizer_files(hf_moe_dir, tmp_path):
    policy = hf_policy(hf_moe_dir)
    tok = policy.tokenizer
    h = hashlib.sha256()
    for f in tokenizer_files(hf_moe_dir):
        data = f.read_bytes()
        h.update(f.name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    assert tok.name == f"tiny-qwen2-moe@{h.hexdigest()[:16]}"
    assert {f.name for f in tokenizer_files(hf_moe_dir)} >= {
        "tokenizer.json",
        "tokenizer_config.json",
    }

    other = tmp_path / "tiny-qwen2-moe"  # same name, one tokenizer file changed
    shutil.copytree(hf_moe_dir, other)
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    changed = hf_policy(other).tokenizer.name
    assert changed.split("@")[0] == tok.name.split("@")[0] and changed != tok.name

    long_dir = tmp_path / ("x" * 80)
    shutil.copytree(hf_moe_dir, long_dir)
    assert len(hf_policy(long_dir).tokenizer.name) == 64


def test_tokenizer_encodes_without_special_tokens_and_decodes_skipping_them(hf_llama_dir):
    tok = hf_policy(hf_llama_dir).tokenizer
    text = "def f(x):\n    return x + 1  # é"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.vocab_size == 300 and tok.start_id == tok.bos_id
    assert tok.has_chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == "system: Be brief.\nuser: hi\nassistant: "


# --- routes: capture and replay on the fused-expert layout --------------------------------------


def _serving_exact(policy: HFPolicy) -> HFPolicy:
    """Masters set to their bf16 values, so the model's own forward (fp32 parameters as they are)
    and the policy's (bf16-rounded) run on the same numbers."""
    policy.load_serving_state_dict(policy.serving_state_dict())
    return policy


def test_route_capture_matches_the_models_own_unreplayed_forward(hf_moe_dir):
    policy = _serving_exact(hf_policy(hf_moe_dir))
    seq = [policy.tokenizer.start_id, *policy.tokenizer.encode("def route(x):\n    return x")]
    tokens = torch.tensor([seq])
    own: list[torch.Tensor] = []
    handles = [
        r.register_forward_hook(lambda m, a, out: own.append(out[2].clone()))
        for r in policy.routers
    ]
    try:
        with torch.no_grad(), policy._mode():  # the policy's kernels, without its routing hooks
            ref_logits = policy.model(input_ids=tokens).logits
    finally:
        for h in handles:
            h.remove()
    assert policy.moe_spec == (2, 2, 4) and len(own) == 2
    with torch.no_grad():
        logits, routes = policy.forward_logits(
            tokens, torch.ones_like(tokens), torch.arange(len(seq))[None]
        )
    assert routes.shape == (1, len(seq), 2, 2)
    for li in range(2):
        assert torch.equal(routes[0, :, li], own[li])
    assert torch.equal(logits, ref_logits)


def test_replaying_captured_routes_reproduces_the_unreplayed_logits_and_other_routes_change_them(
    hf_moe_dir,
):
    policy = hf_policy(hf_moe_dir)
    prompts = encoded(policy)
    completions = [policy.tokenizer.encode(t) for t in [" x + 1", "\nimport numpy", "hi", " pass"]]
    b = len(prompts)
    seqs = [[policy.tokenizer.start_id, *p, *c] for p, c in zip(prompts, completions)]
    width = max(map(len, seqs))
    tokens = torch.full((b, width), policy.tokenizer.pad_id)
    mask = torch.zeros((b, width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        _, all_routes = policy.forward_logits(tokens, mask, torch.arange(width).expand(b, width))
        captured = [
            all_routes[i, len(p) : len(p) + len(c)].to(torch.int32).numpy()
            for i, (p, c) in enumerate(zip(prompts, completions))
        ]
        plain, _, valid = policy.completion_logits(prompts, completions)
        replayed, _, _ = policy.completion_logits(prompts, completions, captured)
        forced = [(r + 1) % 4 for r in captured]  # top-2 of 4: every slot moves to another expert
        moved, _, _ = policy.completion_logits(prompts, completions, forced)
    assert torch.equal(replayed, plain)
    changed = (moved - plain).abs().amax(-1)[valid]
    assert bool((changed > 0).all()), (
        f"forced routes left {int((changed == 0).sum())} rows unchanged"
    )


def test_unrouted_rows_are_routed_by_the_routers(hf_moe_dir):
    """Only the rows that are not UNROUTED are replayed: all UNROUTED is no replay; forced ids on
    rows 1.. leave token 0 (its position precedes every replayed one) as without replay."""
    policy = hf_policy(hf_moe_dir)
    prompts = encoded(policy)
    samples = policy.generate(prompts, max_tokens=4, temperature=1.0, seed=3)
    comps = [s.tokens for s in samples]
    forced = [(s.routes + 1) % 4 for s in samples]  # every slot off the router's own choice
    for r in forced:
        r[0] = UNROUTED
    with torch.no_grad():
        plain = policy.logprobs(prompts, comps)
        unrouted = policy.logprobs(prompts, comps, [np.full_like(r, UNROUTED) for r in forced])
        mixed = policy.logprobs(prompts, comps, forced)
    assert torch.equal(unrouted, plain)
    assert torch.equal(mixed[:, 0], plain[:, 0])
    long = [i for i, c in enumerate(comps) if len(c) > 1]
    assert long and not torch.equal(mixed[long, 1:], plain[long, 1:])


def test_replay_keeps_the_routers_gradient(hf_moe_dir):
    policy = hf_policy(hf_moe_dir).train()
    prompts = encoded(policy)
    samples = policy.generate(prompts, max_tokens=6, temperature=1.0, seed=1)
    routes = [(s.routes + 1) % 4 for s in samples]  # off the router's own choice: replay matters
    lp = policy.logprobs(prompts, [s.tokens for s in samples], routes, 1.0)
    lp.sum().backward()
    for router in policy.routers:
        assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)
    for name, p in policy.model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


# --- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_generate_logs_behaviour_logprobs_that_logprobs_reproduces_exactly(
    which, hf_llama_dir, hf_moe_dir
):
    """The numerics contract on HF models. Exact only inside kernels.hf_mode.batch_invariant_mode:
    the batched prefill, the KV-cache decode and the padded full forward reduce in other orders."""
    policy = hf_policy(hf_llama_dir if which == "dense" else hf_moe_dir)
    prompts = encoded(policy)
    for temperature in (0.0, 0.7):
        samples = policy.generate(prompts, max_tokens=10, temperature=temperature, seed=5)
        routes = [s.routes for s in samples]
        if which == "moe":
            assert all(s.routes.shape == (len(s.tokens), 2, 2) for s in samples)
            assert all(s.routes.dtype == np.int32 for s in samples)
        else:
            assert all(r is None for r in routes)
        with torch.no_grad():
            lp = policy.logprobs(prompts, [s.tokens for s in samples], routes, temperature)
        assert lp.dtype == torch.float32 and lp.shape == (len(prompts), 10)
        for i, s in enumerate(samples):
            behaviour = torch.tensor(s.logprobs, dtype=torch.float32)
            recomputed = lp[i, : len(s.tokens)]
            assert behaviour.shape == recomputed.shape
            diff = float((behaviour - recomputed).abs().max())
            assert torch.equal(behaviour, recomputed), (
                f"{which} T={temperature} row {i}: max |behaviour - logprobs()| = {diff:.3g}"
            )


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_a_generation_stopped_by_on_step_is_a_bit_exact_prefix(which, hf_llama_dir, hf_moe_dir):
    policy = hf_policy(hf_llama_dir if which == "dense" else hf_moe_dir)
    prompts = encoded(policy)
    full = policy.generate(prompts, max_tokens=12, temperature=1.0, seed=11)
    seen: list[list[int | None]] = []

    def stop_after_5(step: int, tokens: list[int | None]) -> bool:
        seen.append(tokens)
        return step < 4

    cut = policy.generate(prompts, max_tokens=12, temperature=1.0, seed=11, on_step=stop_after_5)
    assert len(seen) == 5
    for f, c in zip(full, cut):
        k = len(c.tokens)
        assert k == min(5, len(f.tokens))
        assert c.tokens == f.tokens[:k] and c.logprobs == f.logprobs[:k]
        if which == "moe":
            assert np.array_equal(c.routes, f.routes[:k])
        assert c.meta["finish_reason"] in ("stopped", "eos")
    assert [t[0] for t in seen] == full[0].tokens[:5]


def test_greedy_generation_is_deterministic_and_seeded_sampling_repeats(hf_moe_dir):
    policy = hf_policy(hf_moe_dir)
    prompts = encoded(policy)
    a = policy.generate(prompts, max_tokens=8, temperature=0.0, seed=1)
    b = policy.generate(prompts, max_tokens=8, temperature=0.0, seed=2)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    c = policy.generate(prompts, max_tokens=8, temperature=1.0, seed=3)
    d = policy.generate(prompts, max_tokens=8, temperature=1.0, seed=3)
    assert [s.tokens for s in c] == [s.tokens for s in d]
    assert [s.logprobs for s in c] == [s.logprobs for s in d]


def test_per_completion_temperatures_score_each_row_at_its_own(hf_llama_dir):
    policy = hf_policy(hf_llama_dir)
    prompts = encoded(policy)[:2]
    comps = [policy.tokenizer.encode(" return 1"), policy.tokenizer.encode(" os")]
    with torch.no_grad():
        both = policy.logprobs(prompts, comps, None, torch.tensor([0.5, 1.5]))
        at05 = policy.logprobs(prompts, comps, None, 0.5)
        at15 = policy.logprobs(prompts, comps, None, 1.5)
    assert torch.equal(both[0], at05[0]) and torch.equal(both[1], at15[1])
    assert not torch.equal(at05[0], at15[0])


# --- serving weights ----------------------------------------------------------------------------


def _perturb(policy: HFPolicy, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


@pytest.mark.parametrize("which", ["dense", "tied", "moe"])
def test_serving_state_dict_is_a_directory_that_from_pretrained_loads(
    which, hf_llama_dir, hf_llama_tied_dir, hf_moe_dir, tmp_path
):
    from transformers import AutoModelForCausalLM

    src = {"dense": hf_llama_dir, "tied": hf_llama_tied_dir, "moe": hf_moe_dir}[which]
    policy = hf_policy(src)
    _perturb(policy)
    state = policy.serving_state_dict()
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert set(state) == set(f.keys())  # exactly the names save_pretrained wrote
    assert ("lm_head.weight" in state) == (which != "tied")
    if which == "moe":
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in state

    out = tmp_path / "served"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    loaded = model.state_dict()
    for k, v in policy.model.state_dict().items():
        assert torch.equal(loaded[k], v.to(torch.bfloat16)), k
    if which == "tied":
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    again = hf_policy(out)  # the replica's path: build from the directory, then the weights
    assert bits_equal(again.serving_state_dict(), state)
    fresh = hf_policy(src)
    assert not bits_equal(fresh.serving_state_dict(), state)
    fresh.load_serving_state_dict(state)
    assert bits_equal(fresh.serving_state_dict(), state)


def test_a_serving_state_dict_of_another_architecture_is_refused(hf_moe_dir, hf_llama_dir):
    moe = hf_policy(hf_moe_dir)
    state = moe.serving_state_dict()
    with pytest.raises(ValueError, match="missing .*experts.0.gate_proj"):
        moe.load_serving_state_dict(hf_policy(hf_llama_dir).serving_state_dict())
    bad = dict(state)
    bad["model.layers.1.mlp.experts.2.down_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="experts.2.down_proj.weight: shape"):
        moe.load_serving_state_dict(bad)


def test_build_policy_round_trips_through_config_and_checkpoint(hf_moe_dir, tmp_path):
    from policy import load_policy, save_policy

    policy = hf_policy(hf_moe_dir)
    _perturb(policy, seed=3)
    config = policy.config_dict()
    assert config == {
        "type": "hf",
        "model_dir": str(hf_moe_dir),
        "max_context": 256,
        "kernels": "invariant",
    }
    assert json.loads(json.dumps(config)) == config
    rebuilt = build_policy(config)
    assert rebuilt.config_dict() == config
    save_policy(policy, tmp_path / "serve", serving=True)
    loaded = load_policy(tmp_path / "serve").eval()
    assert bits_equal(loaded.serving_state_dict(), policy.serving_state_dict())
    prompts = encoded(policy)
    samples = policy.generate(prompts, max_tokens=5, temperature=0.0, seed=0)
    again = loaded.generate(prompts, max_tokens=5, temperature=0.0, seed=0)
    assert [s.tokens for s in samples] == [s.tokens for s in again]
    with pytest.raises(ValueError, match="max_context 4096 > the model's max_position_embeddings"):
        build_policy({**config, "max_context": 4096})
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        build_policy({"type": "hf", "model_dir": str(tmp_path / "nothing")})


def test_a_replica_verifies_and_serves_an_hf_version(hf_moe_dir):
    from app.replica.weights import VerificationError, load_verified
    from kernels.delta.hashing import hash_state_dict

    policy = hf_policy(hf_moe_dir)
    state = policy.serving_state_dict()
    sha = hash_state_dict(state, 1)[1]
    first = load_verified("1", state, policy.config_dict(), sha)
    second = load_verified("2", state, policy.config_dict(), sha, template=first)
    prompts = encoded(policy)
    a = first.policy.generate(prompts, max_tokens=4, temperature=0.0, seed=0)
    b = second.policy.generate(prompts, max_tokens=4, temperature=0.0, seed=0)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    with pytest.raises(VerificationError):
        load_verified("3", state, policy.config_dict(), "0" * 64)


# --- the generation event and the trainer's check ------------------------------------------------


def test_a_generation_event_from_an_hf_sample_passes_the_ingest_contract(hf_moe_dir):
    from app.contracts.events import encode_routes, parse_event

    policy = hf_policy(hf_moe_dir)
    prompt = policy.tokenizer.encode("def f(x):")
    sample = policy.generate([prompt], max_tokens=6, temperature=0.8, seed=4)[0]
    routes, shape = encode_routes(sample.routes)
    event = {
        "event_id": "gen-r1",
        "type": "generation",
        "request_id": "r1",
        "session_id": "s1",
        "ts": "2026-01-01T00:00:00Z",
        "model_version": "1",
        "prompt_tokens": prompt,
        "completion_tokens": sample.tokens,
        "logprobs": sample.logprobs,
        "temperature": 0.8,
        "tokenizer": policy.tokenizer.name,
        "routes": routes,
        "route_shape": list(shape),
    }
    parsed = parse_event(event)
    assert parsed.tokenizer == policy.tokenizer.name and parsed.route_shape == (6, 2, 2)


def test_the_trainer_refuses_a_rollout_whose_tokenizer_has_the_same_name_but_other_files(
    hf_moe_dir,
):
    from app.contracts.events import encode_routes
    from trainer.rollouts import parse_rollout
    from trainer.validate import ModelSpec

    policy = hf_policy(hf_moe_dir)
    spec = ModelSpec.of(policy, replay_routes=True, max_abs_reward=1e6)
    assert spec.tokenizer == policy.tokenizer.name and spec.moe == (2, 2, 4)
    assert spec.max_context == 256 and spec.vocab_size == 300
    prompt = policy.tokenizer.encode("x = ")
    sample = policy.generate([prompt], max_tokens=3, temperature=1.0, seed=0)[0]
    routes, shape = encode_routes(sample.routes)
    record = {
        "request_id": "r1",
        "session_id": "s1",
        "model_version": "1",
        "prompt_tokens": prompt,
        "completion_tokens": sample.tokens,
        "logprobs": sample.logprobs,
        "routes": routes,
        "route_shape": list(shape),
        "reward": 1.0,
        "group_id": None,
        "components": None,
        "tool_errors": [],
        "reward_spec": "v1",
        "generated_at": "2026-01-01T00:00:00Z",
        "labelled_at": "2026-01-01T00:15:00Z",
        "closed_by": "window",
        "tokenizer": policy.tokenizer.name,
        "temperature": 1.0,
    }
    ok, refusal = parse_rollout(json.dumps(record).encode(), spec)
    assert refusal is None and ok is not None
    name, digest = policy.tokenizer.name.split("@")
    other = f"{name}@{'0' * 16 if digest != '0' * 16 else '1' * 16}"
    _, refusal = parse_rollout(json.dumps({**record, "tokenizer": other}).encode(), spec)
    assert refusal is not None and refusal.reason == "tokenizer_mismatch"
    assert other in refusal.message and policy.tokenizer.name in refusal.message
