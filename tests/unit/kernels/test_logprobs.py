"""Token log-probs: invariant == reference to tight tolerance; a position's bits do not depend
on the batch or sequence it sits in; temperature 0 is scored at T = 1."""

import torch

from kernels.invariant import DEFAULT_OPS, INVARIANT_OPS
from kernels.logprobs import log_probs, reference_token_logprobs, token_logprobs


def _logits(b=3, t=7, v=259, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, v, generator=g) * 4, torch.randint(0, v, (b, t), generator=g)


def test_invariant_token_logprobs_match_reference():
    z, y = _logits()
    for temp in (1.0, 0.7):
        got = token_logprobs(z, y, temp, INVARIANT_OPS)
        torch.testing.assert_close(got, reference_token_logprobs(z, y, temp), rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(
            token_logprobs(z, y, temp, DEFAULT_OPS), reference_token_logprobs(z, y, temp)
        )


def test_token_logprobs_bits_do_not_depend_on_batch():
    z, y = _logits()
    full = token_logprobs(z, y, 0.8, INVARIANT_OPS)
    assert torch.equal(token_logprobs(z[1, 3:4], y[1, 3:4], 0.8, INVARIANT_OPS), full[1, 3:4])
    assert torch.equal(token_logprobs(z[:, 2], y[:, 2], 0.8, INVARIANT_OPS), full[:, 2])


def test_temperature_zero_is_scored_at_one():
    z, y = _logits()
    assert torch.equal(
        token_logprobs(z, y, 0.0, INVARIANT_OPS), token_logprobs(z, y, 1.0, INVARIANT_OPS)
    )
    torch.testing.assert_close(log_probs(z, 1.0, INVARIANT_OPS).exp().sum(-1), torch.ones(3, 7))


def test_per_row_temperatures_equal_each_row_at_its_own_temperature():
    z, y = _logits()
    temps = (0.7, 1.3, 0.0)  # one per batch row; 0 = greedy, scored at T = 1
    for ops in (INVARIANT_OPS, DEFAULT_OPS):
        rows = token_logprobs(z, y, torch.tensor(temps), ops)
        for i, t in enumerate(temps):
            assert torch.equal(rows[i], token_logprobs(z[i : i + 1], y[i : i + 1], t, ops)[0])
    torch.testing.assert_close(
        reference_token_logprobs(z, y, torch.tensor(temps)),
        token_logprobs(z, y, torch.tensor(temps), INVARIANT_OPS),
        rtol=1e-6,
        atol=2e-6,
    )
