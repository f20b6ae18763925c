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
