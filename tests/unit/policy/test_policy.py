"""The built-in policy behind the Policy interface: factory, tokenizer, generation, log-probs,
serving weights and checkpoints."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from policy import build_policy, load_policy, save_policy
from policy.base import UNROUTED, replayed_rows
from policy.tokenizer import ByteTokenizer
from tests.unit.policy.conftest import make_prompts


def test_build_policy_rejects_unknown_type_and_bad_config(tiny_config):
    with pytest.raises(ValueError, match="unknown policy type 'gpt-9'"):
        build_policy({"type": "gpt-9"})
    with pytest.raises(ValidationError):
        build_policy({**tiny_config, "max_context": 100})
    with pytest.raises(ValidationError):
        build_policy({**tiny_config, "no_such_field": 1})


def test_build_policy_from_config_dict_rebuilds_the_same_architecture(tiny_policy):
    again = build_policy(tiny_policy.config_dict())
    assert again.config_dict() == tiny_policy.config_dict()
    assert {k: v.shape for k, v in again.state_dict().items()} == {
        k: v.shape for k, v in tiny_policy.state_dict().items()
    }


def test_byte_tokenizer_round_trips_text_and_has_specials():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # ünïcode ✓"
    assert tok.decode(tok.encode(text)) == text
    assert tok.name == "byte-v1" and tok.vocab_size <= 260
    assert (
        len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
        and min(tok.bos_id, tok.eos_id, tok.pad_id) >= 256
    )
    assert tok.decode([*tok.encode("ab"), tok.eos_id]) == "ab"


def test_seeded_generation_is_deterministic_and_seed_dependent(tiny_policy):
    prompts = make_prompts(3, seed=1)
    a = tiny_policy.generate(prompts, max_tokens=12, temperature=1.0, seed=42)
    b = tiny_policy.generate(prompts, max_tokens=12, temperature=1.0, seed=42)
    c = tiny_policy.generate(prompts, max_tokens=12, temperature=1.0, seed=43)
    assert [s.tokens for s in a] == [s.tokens for s in b] and [s.logprobs for s in a] == [
        s.logprobs for s in b
    ]
    assert [s.tokens for s in a] != [s.tokens for s in c]


def test_samples_carry_float32_logprobs_and_int32_routes(tiny_policy):
    samples = tiny_policy.generate(make_prompts(2), max_tokens=9, seed=0)
    for s in samples:
        assert 1 <= len(s.tokens) <= 9 and len(s.logprobs) == len(s.tokens)
        assert all(lp <= 0 and np.float32(lp) == lp for lp in s.logprobs)
        assert s.routes.dtype == np.int32 and s.routes.shape == (len(s.tokens), 2, 2)
        assert s.routes.min() >= 0 and s.routes.max() < 4
        assert s.text == tiny_policy.tokenizer.decode(s.tokens)


def test_generation_stops_at_eos(tiny_policy):
    eos = tiny_policy.tokenizer.eos_id
    head = tiny_policy.lm_logits
    bias = torch.zeros(259)
    bias[eos] = 4.0  # eos gets ~15% of the mass at every step
    tiny_policy.lm_logits = lambda h: head(h) + bias
    samples = tiny_policy.generate(make_prompts(4), max_tokens=40, temperature=1.0, seed=0)
    for s in samples:
        assert s.tokens[-1] == eos and eos not in s.tokens[:-1]
        assert s.meta["finish_reason"] == "eos"
    assert len({len(s.tokens) for s in samples}) > 1, "sequences should stop at different steps"
    long = tiny_policy.generate(make_prompts(1), max_tokens=3, temperature=0.0)[0]
    assert len(long.tokens) <= 3


def test_logprobs_are_right_padded_and_differentiable_through_replayed_routes(tiny_policy):
    prompts = make_prompts(3, seed=3)
    samples = tiny_policy.generate(prompts, max_tokens=10, seed=1)
    comps = [s.tokens[:n] for s, n in zip(samples, (10, 4, 7))]
    routes = [s.routes[: len(c)] for s, c in zip(samples, comps)]
    lp = tiny_policy.logprobs(prompts, comps, routes)
    assert lp.dtype == torch.float32 and lp.shape == (3, max(len(c) for c in comps))
    for i, c in enumerate(comps):
        assert torch.all(lp[i, len(c) :] == 0) and torch.all(lp[i, : len(c)] < 0)
    lp.sum().backward()
    for blk in tiny_policy.blocks:
        assert blk.router.grad is not None and blk.router.grad.abs().sum() > 0
    assert tiny_policy.tok_emb.grad.abs().sum() > 0


def test_unrouted_rows_are_routed_by_the_router_and_the_others_replayed(tiny_policy):
    """Routes rows of UNROUTED (-1) are not replayed: all of them is no replay at all; rows 2..4
    forced off the router's choice and the rest UNROUTED change the log-probs from token 2 on and
    leave tokens 0 and 1 (whose positions precede every replayed one) as without replay."""
    prompts = make_prompts(2, seed=5)
    samples = tiny_policy.generate(prompts, max_tokens=8, seed=2)
    comps = [s.tokens for s in samples]
    assert min(map(len, comps)) >= 5, comps
    forced = [(s.routes + 1) % 4 for s in samples]  # top-2 of 4: every slot on another expert
    partly = [np.full_like(r, UNROUTED) for r in forced]
    for r, p in zip(forced, partly):
        p[2:5] = r[2:5]
    with torch.no_grad():
        plain = tiny_policy.logprobs(prompts, comps)
        unrouted = tiny_policy.logprobs(prompts, comps, [np.full_like(r, UNROUTED) for r in forced])
        mixed = tiny_policy.logprobs(prompts, comps, partly)
    assert torch.equal(unrouted, plain)
    assert torch.equal(mixed[:, :2], plain[:, :2])
    assert bool((mixed[:, 2:5] != plain[:, 2:5]).all()), (mixed - plain)[:, 2:5]
    n = len(partly[0])
    assert replayed_rows(partly[0]).tolist() == [False] * 2 + [True] * 3 + [False] * (n - 5)


def test_logprobs_validate_route_shapes_and_context_length(tiny_policy):
    with pytest.raises(AssertionError, match="routes\\[0\\] has shape"):
        tiny_policy.logprobs([[65]], [[66, 67]], [np.zeros((3, 2, 2), np.int32)])
    with pytest.raises(ValueError, match="exceed max_context"):
        tiny_policy.generate([[65] * 120], max_tokens=10)


def test_completion_log_probs_gives_full_distributions_consistent_with_logprobs(tiny_policy):
    prompts, comps = [[65, 66], [67]], [[68, 69, 70], [71]]
    full, targets, valid = tiny_policy.completion_log_probs(prompts, comps)
    assert full.shape == (2, 3, 259) and valid.tolist() == [[True] * 3, [True, False, False]]
    lp = tiny_policy.logprobs(prompts, comps)
    assert torch.equal(full.gather(-1, targets[..., None])[..., 0][valid], lp[valid])


def test_serving_state_dict_is_bf16_and_loads_back(tiny_policy):
    state = tiny_policy.serving_state_dict()
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    other = build_policy(tiny_policy.config_dict())
    other.load_serving_state_dict(state)
    assert all(torch.equal(other.state_dict()[k], v.float()) for k, v in state.items())
    with pytest.raises(ValueError, match="missing"):
        other.load_serving_state_dict({k: v for k, v in state.items() if k != "ln_f"})


@pytest.mark.parametrize("serving", [False, True])
def test_checkpoint_round_trip_reproduces_logprobs(tiny_policy, tmp_path, serving):
    prompts = make_prompts(2, seed=9)
    samples = tiny_policy.generate(prompts, max_tokens=6, seed=0)
    save_policy(tiny_policy, tmp_path / "ckpt", serving=serving)
    loaded = load_policy(tmp_path / "ckpt")
    lp = loaded.logprobs(prompts, [s.tokens for s in samples], [s.routes for s in samples])
    for i, s in enumerate(samples):
        assert lp[i, : len(s.tokens)].tolist() == s.logprobs
    with pytest.raises(FileNotFoundError):
        load_policy(tmp_path / "nowhere")
