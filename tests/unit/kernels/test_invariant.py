"""Batch-invariant kernels: parity with the plain torch reference, and bit-identical results
whatever else is in the batch and however long the (zero-padded) reduction is."""

import math

import pytest
import torch

from kernels import invariant as inv


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_tree_sum_matches_sum_and_is_padding_invariant():
    x = _rand(5, 13)
    s = inv.tree_sum(x, -1)
    torch.testing.assert_close(s, x.sum(-1), rtol=1e-6, atol=1e-6)
    padded = torch.cat([x, torch.zeros(5, 51)], dim=1)  # 13 -> 64 leaves instead of 16
    assert torch.equal(inv.tree_sum(padded, -1), s)
    assert torch.equal(inv.tree_sum(x[2:3], -1)[0], s[2])


def test_exp_matches_torch_within_two_ulp():
    x = torch.linspace(-86.0, 88.0, 200_001)
    got, ref = inv.exp(x), torch.exp(x.double())
    rel = ((got.double() - ref) / ref).abs().max().item()
    assert rel < 2.5e-7, f"max relative error {rel}"
    special = inv.exp(torch.tensor([-math.inf, math.inf, math.nan, -200.0, 100.0, 0.0]))
    assert special[0] == 0 and special[1] == math.inf and math.isnan(special[2])
    assert special[3] == 0 and special[4] == math.inf and special[5] == 1.0


def test_log_matches_torch_within_two_ulp():
    x = torch.exp(torch.linspace(-80.0, 80.0, 200_001))
    got, ref = inv.log(x), torch.log(x.double())
    err = (got.double() - ref).abs() / ref.abs().clamp_min(1e-30)
    assert err.max().item() < 2.5e-7 or (got.double() - ref).abs().max().item() < 1e-7
    special = inv.log(torch.tensor([0.0, math.inf, -1.0, 1.0]))
    assert (
        special[0] == -math.inf
        and special[1] == math.inf
        and math.isnan(special[2])
        and special[3] == 0
    )


def test_exp_is_elementwise_independent_of_tensor_size():
    x = _rand(4099, scale=20.0)
    full = inv.exp(x)
    for start, n in [(0, 1), (3, 17), (100, 33), (4000, 99)]:
        assert torch.equal(inv.exp(x[start : start + n]), full[start : start + n])


def test_matmul_matches_reference_and_is_batch_invariant():
    x, w = _rand(37, 96, seed=1), _rand(96, 70, seed=2) / 10
    y = inv.matmul(x, w)
    torch.testing.assert_close(y, x @ w, rtol=1e-5, atol=1e-5)
    for rows in [slice(0, 1), slice(5, 6), slice(3, 10), slice(30, 37)]:
        assert torch.equal(inv.matmul(x[rows], w), y[rows])
    # a row inside a different batch of other rows
    mixed = torch.cat([_rand(9, 96, seed=3), x[4:5], _rand(2, 96, seed=4)])
    assert torch.equal(inv.matmul(mixed, w)[9], y[4])


def test_rms_norm_silu_log_softmax_match_reference_and_are_row_invariant():
    x, g = _rand(11, 64, seed=5, scale=3.0), _rand(64, seed=6)
    pairs = [
        (lambda t: inv.rms_norm(t, g, 1e-5), lambda t: inv.reference_rms_norm(t, g, 1e-5)),
        (inv.silu, torch.nn.functional.silu),
        (inv.log_softmax, inv.reference_log_softmax),
    ]
    for fn, ref in pairs:
        y = fn(x)
        torch.testing.assert_close(y, ref(x), rtol=2e-6, atol=2e-6)
        assert torch.equal(fn(x[6:7]), y[6:7])
        assert torch.equal(fn(x[2:9]), y[2:9])


def _qkv(b=3, h=2, t=21, d=16, seed=7):
    return (
        _rand(b, h, t, d, seed=seed),
        _rand(b, h, t, d, seed=seed + 1),
        _rand(b, h, t, d, seed=seed + 2),
    )


def test_attention_matches_reference():
    q, k, v = _qkv()
    pos = torch.arange(21).expand(3, 21)
    torch.testing.assert_close(
        inv.attention(q, k, v, pos), inv.reference_attention(q, k, v, pos), rtol=1e-5, atol=1e-5
    )


def test_attention_decode_step_over_padded_cache_equals_full_forward():
    q, k, v = _qkv()
    b, h, t, d = q.shape
    full = inv.attention(q, k, v, torch.arange(t).expand(b, t))
    cache_k, cache_v = torch.zeros(b, h, 64, d), torch.zeros(b, h, 64, d)
    for step in range(t):
        cache_k[:, :, step], cache_v[:, :, step] = k[:, :, step], v[:, :, step]
        n_keys = step + 1 + (step % 5)  # any cache length >= step + 1
        out = inv.attention(
            q[:, :, step : step + 1],
            cache_k[:, :, :n_keys],
            cache_v[:, :, :n_keys],
            torch.full((b, 1), step),
        )
        assert torch.equal(out[:, :, 0], full[:, :, step]), (
            f"decode step {step} differs from full forward"
        )


def test_attention_is_batch_invariant():
    q, k, v = _qkv(b=4)
    pos = torch.arange(21).expand(4, 21)
    full = inv.attention(q, k, v, pos)
    assert torch.equal(inv.attention(q[2:3], k[2:3], v[2:3], pos[2:3]), full[2:3])


@pytest.mark.parametrize("name", ["matmul", "rms_norm", "attention", "log_softmax"])
def test_invariant_ops_backward_equals_reference_backward(name):
    x, w, g = (
        _rand(6, 32, seed=8).requires_grad_(),
        _rand(32, 32, seed=9).requires_grad_(),
        _rand(32, seed=10).requires_grad_(),
    )
    q, k, v = (t.requires_grad_() for t in _qkv(b=1, t=6, d=8))
    pos = torch.arange(6).expand(1, 6)
    cases = {
        "matmul": (lambda: inv.matmul(x, w), lambda: inv.reference_matmul(x, w), [x, w]),
        "rms_norm": (
            lambda: inv.rms_norm(x, g, 1e-5),
            lambda: inv.reference_rms_norm(x, g, 1e-5),
            [x, g],
        ),
        "attention": (
            lambda: inv.attention(q, k, v, pos),
            lambda: inv.reference_attention(q, k, v, pos),
            [q, k, v],
        ),
        "log_softmax": (lambda: inv.log_softmax(x), lambda: inv.reference_log_softmax(x), [x]),
    }
    fn, ref, leaves = cases[name]
    upstream = _rand(*fn().shape, seed=11)
    got = torch.autograd.grad(fn(), leaves, upstream)
    want = torch.autograd.grad(ref(), leaves, upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert a.abs().sum() > 0


def test_get_ops_rejects_unknown_kernel_set():
    assert inv.get_ops("invariant").invariant and not inv.get_ops("default").invariant
    with pytest.raises(ValueError, match="unknown kernel set"):
        inv.get_ops("triton")
