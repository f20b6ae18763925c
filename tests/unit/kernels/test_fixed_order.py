"""The fixed-order fp32 GEMM (kernels/fixed_order.py, kernels/csrc/fixed_order_gemm.c), built here.

Its contract: C[i, j] is the FMA chain over K in order, so its bits depend only on row i of A and
column j of B. The tests check the bits against that definition, then every way a caller could
change the shape around an element: rows alone or in any batch, columns alone, zero-padded K (front
or back, any values of B in the padding), threads, strides, batch broadcasting.
"""

from __future__ import annotations

import pytest
import torch

from kernels import fixed_order


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return fixed_order.bmm(a, fixed_order.pack(b), b.shape[2])


def _fma_chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition: acc = fp32(a_k b_k + acc) for k in order. a_k b_k is exact in float64 (48
    bits); the float64 sum is rounded twice (to 53 bits, then 24), which differs from one fused
    rounding only when the first rounding lands on a float32 tie: about 2^-29 per step."""
    acc = torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)
    for k in range(a.shape[2]):
        prod = a[:, :, k, None].double() * b[:, None, k, :].double()
        acc = (prod + acc.double()).float()
    return acc


def test_the_kernel_builds_here():
    assert fixed_order.available(), fixed_order.unavailable_reason()
    assert fixed_order.nr() % 4 == 0


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 40, 70), (13, 64, 129), (6, 3, 64)])
def test_bits_are_the_fma_chain_over_k_in_order(m, k, n):
    a, b = _rand(2, m, k, seed=1), _rand(2, k, n, seed=2)
    assert torch.equal(_bmm(a, b), _fma_chain(a, b))


def test_a_row_or_column_has_the_same_bits_alone_and_in_any_batch():
    a, b = _rand(1, 50, 96, seed=3), _rand(1, 96, 150, seed=4)
    full = _bmm(a, b)
    for i in (0, 5, 6, 11, 49):  # inside and at the edges of 6-row micro-tiles
        assert torch.equal(_bmm(a[:, i : i + 1], b), full[:, i : i + 1])
    assert torch.equal(_bmm(a[:, 3:41], b), full[:, 3:41])
    assert torch.equal(_bmm(a[:, :, :], b[:, :, 60:131]), full[:, :, 60:131])
    stacked = _bmm(torch.cat([a[:, 10:20], a[:, :10]], 0), torch.cat([b, b], 0))
    assert torch.equal(stacked[0], full[0, 10:20]) and torch.equal(stacked[1], full[0, :10])


def test_zero_padding_k_anywhere_changes_nothing():
    """Masked keys in attention: exact-zero weights against any finite values."""
    a, b = _rand(1, 20, 48, seed=5), _rand(1, 48, 33, seed=6)
    full = _bmm(a, b)
    garbage = _rand(1, 30, 33, seed=7, scale=1e4)
    zeros = torch.zeros(1, 20, 30)
    assert torch.equal(_bmm(torch.cat([a, zeros], 2), torch.cat([b, garbage], 1)), full)
    assert torch.equal(_bmm(torch.cat([zeros, a], 2), torch.cat([garbage, b], 1)), full)
    mid = torch.cat([a[:, :, :20], zeros, a[:, :, 20:]], 2)
    assert torch.equal(_bmm(mid, torch.cat([b[:, :20], garbage, b[:, 20:]], 1)), full)


def test_threads_strides_and_broadcast_weights_do_not_change_bits():
    a, b = _rand(3, 200, 128, seed=8), _rand(1, 128, 300, seed=9)
    packed = fixed_order.pack(b)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fixed_order.bmm(a, packed, 300)
        torch.set_num_threads(2)  # panels split over two workers
        two = fixed_order.bmm(a, packed, 300)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    per_batch = torch.stack([fixed_order.bmm(a[i : i + 1], packed, 300)[0] for i in range(3)])
    assert torch.equal(one, per_batch)
    strided = _rand(3, 128, 200, seed=8).transpose(1, 2)  # column-major rows: copied, same bits
    assert torch.equal(
        fixed_order.bmm(strided, packed, 300), fixed_order.bmm(strided.contiguous(), packed, 300)
    )


def test_close_to_float64_and_non_finite_values_propagate():
    a, b = _rand(2, 37, 256, seed=10), _rand(2, 256, 96, seed=11, scale=1 / 16)
    want = (a.double() @ b.double()).float()
    torch.testing.assert_close(_bmm(a, b), want, rtol=1e-5, atol=1e-5)
    a[0, 2, 3] = float("inf")
    got = _bmm(a, b)
    assert not torch.isfinite(got[0, 2]).all() and torch.isfinite(got[0, :2]).all()


def test_empty_shapes():
    assert _bmm(torch.zeros(1, 0, 4), torch.zeros(1, 4, 3)).shape == (1, 0, 3)
    assert torch.equal(_bmm(torch.ones(1, 2, 0), torch.ones(1, 0, 3)), torch.zeros(1, 2, 3))


def test_the_compiled_exp_has_the_bits_of_the_torch_form():
    """kernels/csrc/invariant_exp.c runs kernels.invariant.exp_torch's operations in one pass; it
    is a speed-up only, so every float32 must come out the same, specials included."""
    from kernels import invariant as inv

    g = torch.Generator().manual_seed(12)
    bits = torch.randint(-(2**31), 2**31 - 1, (2_000_000,), generator=g).to(torch.int32)
    sweep = torch.cat(
        [
            bits.view(torch.float32),  # every exponent, NaNs with payloads
            torch.randn(1_000_000, generator=g) * 30,  # the range softmax and silu use
            torch.tensor([0.0, -0.0, 88.0, 88.72, 88.7201, 89.0, -87.0, -87.0001, -100.0]),
            torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-30, -1e-30]),
        ]
    )
    got = fixed_order.exp(sweep)
    assert got is not None, fixed_order._exp_error
    want = inv.exp_torch(sweep)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values differ, e.g. x = {sweep[~same][:5]}"
    assert torch.equal(inv.exp(sweep[-14:-5]), want[-14:-5])  # the public entry takes it
