"""The numerics contract (docs/DESIGN.md §Invariants): with routes replayed and the invariant kernels on, the
trainer's recomputed log-probs equal the generation's behaviour log-probs bit for bit, whatever
batch they are in and whether computed incrementally (KV cache) or in one full forward."""

import numpy as np
import pytest
import torch

from policy import build_policy
from tests.unit.policy.conftest import TINY, make_prompts


def _mismatch(policy, prompts, samples, replay: bool) -> tuple[float, float]:
    """(max |delta logprob|, fraction of tokens whose bits differ) of logprobs() vs generate()."""
    routes = [s.routes for s in samples] if replay else None
    with torch.no_grad():
        lp = policy.logprobs(prompts, [s.tokens for s in samples], routes=routes, temperature=0.9)
    diffs = np.concatenate(
        [
            np.abs(lp[i, : len(s.tokens)].numpy() - np.asarray(s.logprobs, np.float32))
            for i, s in enumerate(samples)
        ]
    )
    return float(diffs.max()), float((diffs > 0).mean())


def test_train_infer_mismatch_is_exactly_zero_with_replay_and_invariant_kernels(tiny_policy):
    prompts = make_prompts(8, seed=1)
    samples = tiny_policy.generate(prompts, max_tokens=24, temperature=0.9, seed=3)
    assert sum(len(s.tokens) for s in samples) > 8 * 5
    max_diff, frac = _mismatch(tiny_policy, prompts, samples, replay=True)
    print(
        f"\ninvariant kernels + replay: max |dlogprob| = {max_diff!r}, differing fraction = {frac}"
    )
    assert max_diff == 0.0 and frac == 0.0


def test_mismatch_is_nonzero_with_default_kernels():
    policy = build_policy({**TINY, "kernels": "default"}).eval()
    prompts = make_prompts(8, seed=1)
    samples = policy.generate(prompts, max_tokens=24, temperature=0.9, seed=3)
    with_replay = _mismatch(policy, prompts, samples, replay=True)
    without = _mismatch(policy, prompts, samples, replay=False)
    print(
        f"\ndefault kernels: with replay max={with_replay[0]:.3g} frac={with_replay[1]:.3f}; "
        f"without replay max={without[0]:.3g} frac={without[1]:.3f}"
    )
    assert with_replay[0] > 0 and without[0] > 0


def test_same_sequence_alone_or_in_mixed_batch_of_seven_others_gives_identical_bits(tiny_policy):
    prompts = make_prompts(8, seed=2)
    samples = tiny_policy.generate(prompts, max_tokens=16, temperature=1.0, seed=5)
    comps, routes = [s.tokens for s in samples], [s.routes for s in samples]
    with torch.no_grad():
        batch = tiny_policy.logprobs(prompts, comps, routes)
        for i in (0, 5):
            alone = tiny_policy.logprobs([prompts[i]], [comps[i]], [routes[i]])
            n = len(comps[i])
            assert torch.equal(alone[0, :n], batch[i, :n]), (
                f"sequence {i} changed bits inside the batch"
            )
        # and in a different order, with the sequence last
        order = [3, 1, 7, 2, 6, 4, 0, 5]
        shuffled = tiny_policy.logprobs(
            [prompts[j] for j in order], [comps[j] for j in order], [routes[j] for j in order]
        )
        assert torch.equal(shuffled[7, : len(comps[5])], batch[5, : len(comps[5])])


def test_greedy_generation_alone_equals_generation_in_a_batch(tiny_policy):
    prompts = make_prompts(6, seed=4)
    batch = tiny_policy.generate(prompts, max_tokens=12, temperature=0.0)
    alone = tiny_policy.generate([prompts[3]], max_tokens=12, temperature=0.0)[0]
    assert alone.tokens == batch[3].tokens
    assert alone.logprobs == batch[3].logprobs
    assert np.array_equal(alone.routes, batch[3].routes)


def test_kv_cache_decode_equals_full_forward_hidden_states(tiny_policy):
    tokens = torch.tensor([[256, *b"def add(a, b):\n    return a + b"]])
    t = tokens.shape[1]
    with torch.no_grad():
        full, full_routes = tiny_policy.forward_hidden(tokens, torch.arange(t)[None])
        cache = tiny_policy.new_cache(1)
        steps = [tiny_policy.forward_hidden(tokens[:, :5], torch.arange(5)[None], cache)]
        for j in range(5, t):
            steps.append(
                tiny_policy.forward_hidden(tokens[:, j : j + 1], torch.tensor([[j]]), cache)
            )
    inc = torch.cat([h for h, _ in steps], dim=1)
    inc_routes = torch.cat([r for _, r in steps], dim=1)
    assert torch.equal(inc, full)
    assert torch.equal(inc_routes, full_routes)


def test_bf16_serving_weights_reproduce_master_weight_logprobs_bit_for_bit(tiny_policy):
    with torch.no_grad():  # move the fp32 masters off the bf16 grid, as training does
        for p in tiny_policy.parameters():
            p.add_(torch.randn_like(p) * 1e-4)
    prompts = make_prompts(4, seed=6)
    samples = tiny_policy.generate(prompts, max_tokens=10, seed=1)
    replica = build_policy(tiny_policy.config_dict()).eval()
    replica.load_serving_state_dict(tiny_policy.serving_state_dict())
    replica_samples = replica.generate(prompts, max_tokens=10, seed=1)
    assert [s.tokens for s in replica_samples] == [s.tokens for s in samples]
    assert [s.logprobs for s in replica_samples] == [s.logprobs for s in samples]
    # the trainer (fp32 masters) scores the replica's generation bit-exactly
    lp = tiny_policy.logprobs(
        prompts, [s.tokens for s in replica_samples], [s.routes for s in replica_samples]
    )
    for i, s in enumerate(replica_samples):
        assert lp[i, : len(s.tokens)].tolist() == s.logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.3])
def test_logged_logprobs_follow_the_temperature_convention(tiny_policy, temperature):
    prompts = make_prompts(3, seed=7)
    samples = tiny_policy.generate(prompts, max_tokens=8, temperature=temperature, seed=2)
    with torch.no_grad():
        lp = tiny_policy.logprobs(
            prompts,
            [s.tokens for s in samples],
            [s.routes for s in samples],
            temperature=temperature,
        )
    for i, s in enumerate(samples):
        assert lp[i, : len(s.tokens)].tolist() == s.logprobs
