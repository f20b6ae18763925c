"""Top-k MoE routing that records expert ids and can replay given ids, plus expert dispatch.

Routing: router logits [N, E] -> top-k expert ids [N, k] (int64, descending logit order) ->
gate weights = softmax over the k selected logits (the renormalised top-k). With replay, the
ids come from the caller (e.g. logged at inference) for the rows in `replay_mask`, but the gate
weights are still computed from the *current* router's logits at those ids, so the router keeps
its gradient. Expert outputs are combined in slot order (slot 0 first), a fixed per-row order.

Dispatch: `moe_ffn` (fast: gather the rows of each expert, run it once per expert) and
`reference_moe_ffn` (plain: run every expert on every row, pick by id). With the invariant
kernel set (kernels/invariant.py) both give identical bits, because the matmul result of a row
does not depend on which other rows are in the call. Tests: tests/unit/kernels/test_moe.py.
"""

from __future__ import annotations

import torch

from kernels.invariant import Ops


def route(
    router_logits: torch.Tensor,
    top_k: int,
    ops: Ops,
    replay_ids: torch.Tensor | None = None,
    replay_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] fp32 -> (ids [N, k] int64, gates [N, k] fp32).

    replay_ids [N, k] (any int dtype) are used for the rows where replay_mask [N] is True (all
    rows when replay_mask is None); the other rows take the router's own top-k.
    """
    n, n_experts = router_logits.shape
    assert 1 <= top_k <= n_experts, f"top_k={top_k} with {n_experts} experts"
    ids = torch.topk(router_logits.detach(), top_k, dim=-1).indices
    if replay_ids is not None:
        replay_ids = replay_ids.to(torch.int64).reshape(n, top_k)
        bad = (replay_ids < 0) | (replay_ids >= n_experts)
        if replay_mask is not None:
            bad = bad & replay_mask[:, None]
        assert not bool(bad.any()), f"replayed expert ids outside [0, {n_experts})"
        ids = (
            replay_ids
            if replay_mask is None
            else torch.where(replay_mask[:, None], replay_ids, ids)
        )
    selected = router_logits.gather(1, ids)  # [N, k], differentiable wrt the router
    shifted = selected - selected.amax(dim=-1, keepdim=True)
    e = ops.exp(shifted)
    denom = e[:, 0:1]
    for j in range(1, top_k):  # fixed left-to-right order
        denom = denom + e[:, j : j + 1]
    return ids, e / denom


def _expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ops: Ops) -> torch.Tensor:
    """One expert MLP: silu(x @ w1) @ w2, x [n, D], w1 [D, F], w2 [F, D]."""
    return ops.matmul(ops.silu(ops.matmul(x, w1)), w2)


def _combine(y: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """y [N, k, D] expert outputs per slot, gates [N, k] -> [N, D], summed in slot order."""
    out = y[:, 0] * gates[:, 0:1]
    for j in range(1, y.shape[1]):
        out = out + y[:, j] * gates[:, j : j + 1]
    return out


def moe_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    gates: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    ops: Ops,
) -> torch.Tensor:
    """Fast dispatch. x [N, D], ids/gates [N, k], w1 [E, D, F], w2 [E, F, D] -> [N, D]."""
    n, k = ids.shape
    y = x.new_zeros(n, k, w2.shape[-1])
    for e in range(w1.shape[0]):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        y = y.index_put((rows, slots), _expert(x[rows], w1[e], w2[e], ops))
    return _combine(y, gates)


def reference_moe_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    gates: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    ops: Ops,
) -> torch.Tensor:
    """Plain dispatch: every expert on every row, then pick each slot's expert. Same shapes as moe_ffn."""
    all_y = torch.stack([_expert(x, w1[e], w2[e], ops) for e in range(w1.shape[0])])  # [E, N, D]
    y = all_y[ids, torch.arange(x.shape[0])[:, None]]  # [N, k, D]
    return _combine(y, gates)


def load_balance_loss(router_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Switch-style auxiliary loss E * sum_e f_e * P_e (1.0 when perfectly balanced); training only."""
    n_experts = router_logits.shape[-1]
    probs = torch.softmax(router_logits, dim=-1).mean(0)
    frac = torch.bincount(ids.reshape(-1), minlength=n_experts).to(probs.dtype) / ids.numel()
    return n_experts * (frac * probs).sum()
