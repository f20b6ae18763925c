"""MoE routing with replay and expert dispatch: replay reproduces outputs bit for bit, replayed ids
win over a changed router that still gets gradients, fast dispatch == reference dispatch."""

import pytest
import torch

from kernels.invariant import DEFAULT_OPS, INVARIANT_OPS
from kernels.moe import load_balance_loss, moe_ffn, reference_moe_ffn, route

N, D, F, E, K = 29, 16, 24, 4, 2


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    router = (torch.randn(D, E, generator=g) * 0.5).requires_grad_()
    w1 = torch.randn(E, D, F, generator=g) / 4
    w2 = torch.randn(E, F, D, generator=g) / 5
    return x, router, w1, w2


def _layer(x, router, w1, w2, ops, replay=None, mask=None, dispatch=moe_ffn):
    ids, gates = route(ops.matmul(x, router), K, ops, replay, mask)
    return dispatch(x, ids, gates, w1, w2, ops), ids, gates


def test_route_picks_topk_and_renormalises_gates():
    x, router, *_ = _setup()
    logits = x @ router.detach()
    ids, gates = route(logits, K, DEFAULT_OPS)
    assert torch.equal(ids, torch.topk(logits, K, dim=-1).indices)
    torch.testing.assert_close(gates, torch.softmax(logits.gather(1, ids), dim=-1))
    torch.testing.assert_close(gates.sum(-1), torch.ones(N))


@pytest.mark.parametrize("ops", [INVARIANT_OPS, DEFAULT_OPS], ids=lambda o: o.name)
def test_replaying_recorded_ids_reproduces_outputs_bit_for_bit(ops):
    x, router, w1, w2 = _setup()
    out, ids, _ = _layer(x, router, w1, w2, ops)
    replayed, ids2, _ = _layer(x, router, w1, w2, ops, replay=ids.to(torch.int32))
    assert torch.equal(ids2, ids)
    assert torch.equal(replayed, out)


def test_replay_with_changed_router_keeps_given_ids_and_router_gets_gradient():
    x, router, w1, w2 = _setup()
    _, ids, _ = _layer(x, router, w1, w2, INVARIANT_OPS)
    other = (torch.randn(D, E, generator=torch.Generator().manual_seed(99)) * 3).requires_grad_()
    own_ids = torch.topk(x @ other.detach(), K, dim=-1).indices
    assert not torch.equal(own_ids, ids), "test needs a router that would route differently"
    out, used, gates = _layer(x, other, w1, w2, INVARIANT_OPS, replay=ids)
    assert torch.equal(used, ids)
    # gates come from the *new* router's logits at the replayed ids
    torch.testing.assert_close(
        gates, torch.softmax((x @ other.detach()).gather(1, ids), dim=-1), rtol=1e-5, atol=1e-6
    )
    out.square().sum().backward()
    assert other.grad is not None and other.grad.abs().sum() > 0


def test_partial_replay_mask_only_overrides_masked_rows():
    x, router, w1, w2 = _setup()
    _, own, _ = _layer(x, router, w1, w2, INVARIANT_OPS)
    forced = (own + 1) % E
    mask = torch.arange(N) % 2 == 0
    _, used, _ = _layer(x, router, w1, w2, INVARIANT_OPS, replay=forced, mask=mask)
    assert torch.equal(used[mask], forced[mask]) and torch.equal(used[~mask], own[~mask])


def test_fast_dispatch_matches_reference_dispatch():
    x, router, w1, w2 = _setup()
    fast, _, _ = _layer(x, router, w1, w2, INVARIANT_OPS)
    ref, _, _ = _layer(x, router, w1, w2, INVARIANT_OPS, dispatch=reference_moe_ffn)
    assert torch.equal(fast, ref), "invariant kernels: dispatch order must not change bits"
    fast_d, _, _ = _layer(x, router, w1, w2, DEFAULT_OPS)
    ref_d, _, _ = _layer(x, router, w1, w2, DEFAULT_OPS, dispatch=reference_moe_ffn)
    torch.testing.assert_close(fast_d, ref_d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast, fast_d, rtol=1e-5, atol=1e-5)


def test_replay_rejects_out_of_range_ids():
    x, router, *_ = _setup()
    with pytest.raises(AssertionError, match="outside"):
        route(x @ router.detach(), K, DEFAULT_OPS, torch.full((N, K), E))


def test_load_balance_loss_is_one_when_balanced():
    logits = torch.zeros(8, 4)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balance_loss(logits, ids).item() == pytest.approx(1.0)
