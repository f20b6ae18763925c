"""policy/sampling.py: the shared sampling loop's `mask_logits` hook."""

import pytest
import torch

from policy.sampling import generate
from tests.unit.policy.conftest import make_prompts


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_mask_forcing_one_token_samples_it_with_log_prob_zero(tiny_policy, temperature):
    forced, max_tokens = ord("A"), 6
    steps: list[int] = []

    def force(step: int, logits: torch.Tensor) -> torch.Tensor:
        steps.append(step)
        out = torch.full_like(logits, -torch.inf)
        out[:, forced] = logits[:, forced]
        return out

    prompts = make_prompts(3)
    samples = generate(tiny_policy, prompts, max_tokens, temperature, seed=0, mask_logits=force)
    assert steps == list(range(max_tokens))
    for s in samples:
        assert s.tokens == [forced] * max_tokens
        assert s.logprobs == [0.0] * max_tokens  # log-probs of the distribution sampled from
        assert s.routes.shape == (max_tokens, *tiny_policy.route_shape)
        assert s.text == "A" * max_tokens and s.meta["finish_reason"] == "length"


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_top_logprobs_are_the_most_likely_tokens_of_the_distribution_sampled_from(
    tiny_policy, temperature
):
    """k alternatives per token, most likely first, from the same log-softmax the sampled token's
    behaviour log-prob comes from; asking for them changes nothing that is sampled."""
    k, prompts = 5, make_prompts(3)
    plain = generate(tiny_policy, prompts, 8, temperature, seed=4)
    rich = generate(tiny_policy, prompts, 8, temperature, seed=4, top_logprobs=k)
    for a, b in zip(plain, rich):
        assert (a.tokens, a.logprobs) == (b.tokens, b.logprobs) and a.top_logprobs is None
        assert len(b.top_logprobs) == len(b.tokens)
        for tok, lp, top in zip(b.tokens, b.logprobs, b.top_logprobs):
            ids, lps = [i for i, _ in top], [v for _, v in top]
            assert len(top) == k and len(set(ids)) == k
            assert lps == sorted(lps, reverse=True) and sum(torch.tensor(lps).exp()) <= 1.0 + 1e-5
            if tok in ids:  # the sampled token's entry is its behaviour log-prob, exactly
                assert lps[ids.index(tok)] == lp
            else:  # else it was less likely than every alternative
                assert lp <= lps[-1]
            if temperature == 0.0:  # greedy samples the most likely token
                assert ids[0] == tok


def test_top_logprobs_under_a_mask_rank_the_masked_distribution(tiny_policy):
    allowed = [ord(c) for c in "abc"]

    def only_abc(step: int, logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, -torch.inf)
        out[:, allowed] = logits[:, allowed]
        return out

    (s,) = generate(
        tiny_policy, make_prompts(1), 4, 1.0, seed=1, mask_logits=only_abc, top_logprobs=5
    )
    for top in s.top_logprobs:
        assert {i for i, _ in top[:3]} == set(allowed) and all(v > -torch.inf for _, v in top[:3])
        assert [v for _, v in top[3:]] == [-torch.inf, -torch.inf]
        assert abs(sum(torch.tensor([v for _, v in top[:3]]).exp()) - 1.0) < 1e-5
