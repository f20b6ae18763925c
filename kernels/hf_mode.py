"""`batch_invariant_mode()`: the batch-invariant fp32 kernels for any Hugging Face causal LM (CPU).

Inside `with batch_invariant_mode():` every aten op whose result can depend on the shape of the
tensor it sits in (BLAS matmuls, reductions, vectorised transcendental functions, fused
attention) is replaced by a batch-invariant kernel: matmuls with a weight (`mm`, `addmm`,
`_grouped_mm`) by kernels/exact_matmul.py (BLAS on integer slices whose float64 sums are exact, so
no order matters), the two products of attention (`bmm`, sdpa) and everything else by the
fixed-order trees and elementwise functions of kernels/invariant.py. So a model's logits
for a token have the same bits alone, in a padded batch (see below) and in an
incremental KV-cache decode step as in a full forward. No model code changes: the trainer and
the replica wrap `model(...)` / `model.generate(...)` in the mode.

How: a `TorchDispatchMode` (torch.utils._python_dispatch). It sees the aten ops below autograd,
after `F.linear` / `torch.matmul` / `F.scaled_dot_product_attention` have decomposed into
`mm` / `addmm` / `bmm` / `_scaled_dot_product_flash_attention_for_cpu`, so one table of aten
overrides covers every architecture built from them. It was chosen over `torch.library` impl
overrides (what batch-invariant libraries for vLLM/SGLang register on CUDA) because a dispatch
mode is *thread-local and scoped*: the replica's generation thread can run invariant while a
pretraining loop in another thread keeps BLAS, nothing global is patched, and leaving the block
restores the default kernels exactly. Entering is cheap (one object push; re-entering on a thread
already inside is a counter increment), so callers enter it per `generate()` / `logprobs()` call.

Every dispatched op falls in one of three classes (`classify`):
- covered (`COVERED_OPS`): computed by a fixed-order kernel (table in docs/NUMERICS.md);
- exact (`EXACT_OPS`): correctly rounded or exact whatever the shape (elementwise IEEE `+ - * /`,
  `sqrt`, comparisons, views, copies, indexing, integer counting), passed to the default kernel;
- anything else, and a covered op called with arguments its kernel does not handle (float64
  transcendental functions, `pow` with a non-integer exponent, attention dropout, sin/cos of
  |x| > 1e6), runs on the default kernel, is logged once and listed by `uncovered_ops()`;
  tests/unit/kernels/test_hf_mode.py fails when a supported model dispatches one.

Padding, right or left: masked keys get an exact zero weight; the exact matmul adds exact
zeros wherever they sit, and the halving tree over a zero-padded axis folds any zeros around a
contiguous block of real values down to a cyclic shift of the block, which it reduces with the
same (commutative) pairs. Left padding needs position_ids from the attention mask, as HF
generate() computes them.

Gradients: ops run by the autograd engine (`torch._C._current_autograd_node()` is set) are
passed to the default kernels. Autograd recorded each forward op's own derivative formula, so
backward is the reference backward evaluated at the invariant forward's values: correct, not
invariant, and as fast as without the mode (the built-in policy's "invariant forward +
reference backward"). A forward recomputed inside backward (gradient checkpointing) therefore
runs on default kernels.

Compute dtype float32. bf16/fp16 inputs are computed in fp32 and rounded back (deterministic,
so still invariant); float64 matmuls and sums use the trees in float64. Not covered: GPU
tensors (the ops pass through to the device kernels), `gelu`/`tanh`/`erf` and other ops no
supported model dispatches.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import exact_matmul, fixed_order
from kernels import invariant as inv
from kernels.exact_matmul import exact_bmm

logger = logging.getLogger(__name__)
aten = torch.ops.aten
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class NotCovered(Exception):
    """A covered op called with arguments its invariant kernel does not handle: the dispatcher
    runs the default kernel instead and reports the case in `uncovered_ops()`."""


# --- helpers --------------------------------------------------------------------------------------
def _is_float(x: torch.Tensor) -> bool:
    return x.is_floating_point() and x.device.type == "cpu"


def _f32(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Run an fp32-only elementwise kernel; 16-bit inputs upcast and round back; fp64 not covered."""

    def run(x: torch.Tensor, *rest) -> torch.Tensor:
        if not x.is_floating_point():  # integer input: torch computes in the default float dtype
            x = x.to(torch.float32)
        if x.dtype in _LOW_PRECISION:
            return fn(x.float(), *rest).to(x.dtype)
        if x.dtype != torch.float32:
            raise NotCovered(f"{x.dtype} input")
        return fn(x, *rest)

    run.__name__ = fn.__name__
    return run


def _reduce_dims(x: torch.Tensor, dims) -> tuple[torch.Tensor, list[int]]:
    """Move the reduced dims to the end and flatten them into one axis: [..., R]."""
    dims = list(range(x.dim())) if dims is None or len(dims) == 0 else [d % x.dim() for d in dims]
    keep = [d for d in range(x.dim()) if d not in dims]
    y = x.permute(*keep, *dims)
    return y.reshape(*[x.shape[d] for d in keep], -1), dims


def _tree_reduce(x: torch.Tensor, dims, keepdim: bool, dtype, mean: bool) -> torch.Tensor:
    if dtype is not None:
        x = x.to(dtype)
    if not _is_float(x):  # integer / bool sums are exact
        out = x.sum(dim=dims or None, keepdim=keepdim)
        return out.to(torch.float32) if mean else out
    low = x.dtype in _LOW_PRECISION
    flat, rdims = _reduce_dims(x.float() if low else x, dims)
    n = flat.shape[-1]
    out = inv.tree_sum(flat, -1) if n > 0 else flat.new_zeros(flat.shape[:-1])
    if mean:
        out = out / n
    if keepdim:
        for d in sorted(rdims):
            out = out.unsqueeze(d)
    return out.to(x.dtype) if low else out


def _exp(x: torch.Tensor) -> torch.Tensor:
    """`kernels.invariant.exp` (fp32): its one-pass C form where it is built (the same bits; the
    mode runs below autograd, which recorded exp's own derivative), else its torch form."""
    y = fixed_order.exp(x) if x.device.type == "cpu" else None
    return inv.exp_torch(x) if y is None else y


# --- matmuls: exact-integer BLAS (fp32), halving tree over K (float64, non-finite rows) ---------
def _bmm(a: torch.Tensor, b: torch.Tensor, weight=None, tag=None) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N]: kernels/exact_matmul.py's `exact_bmm` for fp32
    (16-bit inputs computed in fp32 and rounded back), the tree for float64. `weight` / `tag`:
    the parameter (view) `b` was taken from inside the mode, so its packed form is cached."""
    if not (_is_float(a) and _is_float(b)) or a.dtype != b.dtype:
        return aten.bmm.default(a, b)
    if a.dtype == torch.float64:
        return _tree_bmm(a, b)
    if a.dtype in _LOW_PRECISION:
        return exact_bmm(a.float(), b.float(), _tree_bmm).to(a.dtype)
    return exact_bmm(a, b, _tree_bmm, weight, tag)


def _activation_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`aten.bmm` / `baddbmm` and sdpa's q @ k^T and weights @ v: products of two activations
    (attention). On the fixed-order kernel (fp32, the default scheme) like a weight's: each element
    is its own K-ordered chain, and the zero weights of masked keys add nothing wherever they sit.
    The exact-integer schemes scale each K-row of b by its largest |value| over N; for q @ k^T
    that row spans every key of the call, future keys included in a full forward, so a KV-cache
    decode step would scale (and round the dropped low-order products) differently: measured on
    64-89M-parameter models, 1-7% of generated tokens' log-probs differed from logprobs()
    (bench/hf_invariance.py). Under those schemes these products take the tree, whose order is
    fixed and padding-invariant."""
    if not (_is_float(a) and _is_float(b)) or a.dtype != b.dtype:
        return aten.bmm.default(a, b)
    if a.dtype != torch.float64 and exact_matmul.active_scheme() == "fixed":
        return _bmm(a, b)
    return _tree_bmm(a, b)


def _tree_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N]; K zero-padded to a power of two and tree-reduced."""
    out_dtype = a.dtype
    if a.dtype in _LOW_PRECISION or b.dtype in _LOW_PRECISION:
        a, b = a.float(), b.float()
    nb, m, k = a.shape
    n = b.shape[2]
    p2 = inv._next_pow2(k)
    if p2 != k:
        a = torch.cat([a, a.new_zeros(nb, m, p2 - k)], dim=2)
        b = torch.cat([b, b.new_zeros(nb, p2 - k, n)], dim=1)
    out = a.new_empty(nb, m, n)
    per_row = p2 * n
    rows = max(1, inv._CHUNK_ELEMENTS // per_row)
    for i in range(nb):
        for j in range(0, m, rows):
            prod = a[i, j : j + rows, :, None] * b[i]  # [r, K, N]
            h = p2
            while h > 1:
                h //= 2
                prod[:, :h].add_(prod[:, h : 2 * h])
            out[i, j : j + rows] = prod[:, 0]
    return out.to(out_dtype)


def _mm(a: torch.Tensor, b: torch.Tensor, weight=None, tag=None) -> torch.Tensor:
    return _bmm(a[None], b[None], b if weight is None else weight, tag)[0]


def _scaled_add(prod: torch.Tensor, bias: torch.Tensor, beta, alpha) -> torch.Tensor:
    """alpha * prod + beta * bias, elementwise in that order (beta == 0 ignores bias, as torch)."""
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (bias if beta == 1 else bias * beta)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    return _scaled_add(_mm(a, b), bias, beta, alpha)


def _baddbmm(bias, a, b, *, beta=1, alpha=1):
    return _scaled_add(_activation_bmm(a, b), bias, beta, alpha)


def _mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _mm(a, v[:, None])[:, 0]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _mm(a[None], b[:, None])[0, 0]


def _grouped_mm(x, w, offs=None, bias=None, out_dtype=None):
    """x [S, K] with rows grouped by `offs` (cumulative ends, int32) @ w [G, K, N] -> [S, N].
    Rows past offs[-1] (expert-parallel sentinels) are zero, where the CPU kernel leaves garbage."""
    if x.dim() != 2 or w.dim() != 3 or offs is None or bias is not None:
        raise NotCovered(
            f"{tuple(x.shape)} x {tuple(w.shape)}, offs={offs is not None}, bias={bias is not None}"
        )
    out = x.new_zeros(x.shape[0], w.shape[2], dtype=out_dtype or x.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = _mm(x[start:end], w[g], w, g)
        start = end
    return out


# --- softmax family, reductions ------------------------------------------------------------------
def _softmax(x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    def fn(z):
        e = _exp(z - z.amax(dim=dim, keepdim=True))
        return e / inv.tree_sum(e, dim, keepdim=True)

    out = _f32(fn)(x.float() if half_to_float else x)
    return out.float() if half_to_float else out


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    def fn(z):
        shifted = z - z.amax(dim=dim, keepdim=True)
        return shifted - inv.log(inv.tree_sum(_exp(shifted), dim, keepdim=True))

    out = _f32(fn)(x.float() if half_to_float else x)
    return out.float() if half_to_float else out


def _sum_dim(x, dim=None, keepdim=False, *, dtype=None):
    return _tree_reduce(x, dim, keepdim, dtype, mean=False)


def _sum(x, *, dtype=None):
    return _tree_reduce(x, None, False, dtype, mean=False)


def _mean_dim(x, dim=None, keepdim=False, *, dtype=None):
    return _tree_reduce(x, dim, keepdim, dtype, mean=True)


def _mean(x, *, dtype=None):
    return _tree_reduce(x, None, False, dtype, mean=True)


# --- elementwise ---------------------------------------------------------------------------------
def _sigmoid(x):
    return 1.0 / (1.0 + _exp(-x))


def _silu(x):
    return x / (1.0 + _exp(-x))


def _rsqrt(x):
    return 1.0 / torch.sqrt(x)


def _pow_scalar(x: torch.Tensor, exponent) -> torch.Tensor:
    """x ** c for integer c (repeated multiplication, left to right) and c = +-0.5 (sqrt)."""
    if not _is_float(x):
        return aten.pow.Tensor_Scalar(x, exponent)
    if exponent == 0.5:
        return torch.sqrt(x)
    if exponent == -0.5:
        return 1.0 / torch.sqrt(x)
    if float(exponent).is_integer() and abs(exponent) <= 64:
        e = int(exponent)
        out = torch.ones_like(x)
        for _ in range(abs(e)):
            out = out * x
        return out if e >= 0 else 1.0 / out
    raise NotCovered(f"exponent {exponent}")


def _index_add(x, dim, index, source, *, alpha=1):
    """x.index_add(dim, index, source) in a fixed order: pass r adds the r-th occurrence of every
    index (unique targets, one correctly rounded add each), so a target receives its sources in
    their order in `index` whatever the kernel's threading."""
    if alpha != 1:
        source = source * alpha
    order = torch.sort(index, stable=True).indices
    sorted_idx = index[order]
    pos = torch.arange(index.numel())
    new_group = torch.ones_like(sorted_idx, dtype=torch.bool)
    new_group[1:] = sorted_idx[1:] != sorted_idx[:-1]
    group_start = torch.cummax(torch.where(new_group, pos, 0), 0).values
    rank = torch.empty_like(pos)
    rank[order] = pos - group_start
    out = x.clone()
    for r in range(int(rank.max()) + 1 if index.numel() else 0):
        now = (rank == r).nonzero()[:, 0]
        out = aten.index_add.default(out, dim, index[now], source.index_select(dim, now))
    return out


def _index_add_(x, dim, index, source, *, alpha=1):
    return x.copy_(_index_add(x, dim, index, source, alpha=alpha))


def _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """`_scaled_dot_product_flash_attention_for_cpu` -> (out [B,H,Tq,d], logsumexp [B,H,Tq])
    with tree matmuls, the invariant softmax and a padding-invariant key reduction."""
    if dropout_p != 0.0:
        raise NotCovered("dropout")
    b, h, tq, d = q.shape
    if k.shape[1] != h:  # grouped-query attention: repeat each kv head
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    tk = k.shape[2]
    s = scale if scale is not None else 1.0 / math.sqrt(d)
    scores = _activation_bmm(q.reshape(b * h, tq, d), k.reshape(b * h, tk, d).transpose(1, 2))
    scores = (scores * s).reshape(b, h, tq, tk)
    if is_causal:
        keep = torch.ones(tq, tk, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    e = _exp(scores - top)
    denom = inv.tree_sum(e, -1, keepdim=True)
    # a fully masked query row (a pad position) gets zero weights, as the CPU flash kernel does,
    # so no NaN reaches the real rows through the pad positions' values
    weights = torch.where(denom > 0, e / denom, torch.zeros_like(e))
    out = _activation_bmm(weights.reshape(b * h, tq, tk), v.reshape(b * h, tk, d))
    out = out.reshape(b, h, tq, d)
    return out, (top + inv.log(denom))[..., 0]


def _nll_loss(x, target, weight=None, reduction=1, ignore_index=-100):
    """`nll_loss_forward` -> (loss, total_weight); the mean is tree_sum(losses) / tree_sum(weights)."""
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    picked = -x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    w = (weight[safe] if weight is not None else torch.ones_like(picked)) * valid
    losses = torch.where(valid, picked * w, torch.zeros_like(picked))
    if reduction == 0:  # none
        return losses, x.new_zeros(())
    total_weight = _sum(w)
    total = _sum(losses)
    return (total / total_weight if reduction == 1 else total), total_weight


def _trig(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        if bool((torch.isfinite(x) & (x.abs() > inv._TRIG_LIMIT)).any()):
            raise NotCovered(f"{fn.__name__} of |x| > {inv._TRIG_LIMIT:g}")
        return fn(x)

    run.__name__ = fn.__name__
    return run


def _inplace(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return x.copy_(fn(x))

    return run


_ELEMENTWISE = {
    "exp": _f32(_exp),
    "log": _f32(inv.log),
    "sin": _f32(_trig(inv.sin)),
    "cos": _f32(_trig(inv.cos)),
    "sigmoid": _f32(_sigmoid),
    "silu": _f32(_silu),
    "rsqrt": _rsqrt,
}

# op -> invariant implementation (called with the op's args and kwargs)
_OVERRIDES: dict[torch._ops.OpOverload, Callable] = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _activation_bmm,
    aten.baddbmm.default: _baddbmm,
    aten.mv.default: _mv,
    aten.dot.default: _dot,
    aten._grouped_mm.default: _grouped_mm,
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _log_softmax,
    aten.sum.default: _sum,
    aten.sum.dim_IntList: _sum_dim,
    aten.mean.default: _mean,
    aten.mean.dim: _mean_dim,
    aten.pow.Tensor_Scalar: _pow_scalar,
    aten.index_add.default: _index_add,
    aten.index_add_.default: _index_add_,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_cpu,
    aten.nll_loss_forward.default: _nll_loss,
}
for _name, _fn in _ELEMENTWISE.items():
    _OVERRIDES[getattr(aten, _name).default] = _fn
    _OVERRIDES[getattr(aten, _name + "_").default] = _inplace(_fn)

COVERED_OPS: frozenset[str] = frozenset(op.name() for op in _OVERRIDES)

# Ops whose result is exact or correctly rounded per element whatever the tensor's shape, thread
# split or position in a buffer; they run on the default kernels. Keys are aten op names (all
# overloads), grouped by why they are exact.
EXACT_OPS_BY_REASON: dict[str, str] = {
    "IEEE elementwise arithmetic (correctly rounded, no fusion across kernels)": """
        add add_ sub sub_ rsub mul mul_ div div_ neg neg_ sqrt sqrt_ reciprocal reciprocal_ abs
        clamp clamp_ clamp_min clamp_max floor ceil round trunc floor_divide remainder fmod
        maximum minimum square _to_copy copy_ fill_ masked_fill masked_fill_ where lerp""",
    "comparisons, logic and selection (exact)": """
        eq ne lt le gt ge isin logical_not logical_and logical_or bitwise_and bitwise_or
        bitwise_not bitwise_xor isnan isinf isfinite equal allclose isclose amax amin max min
        aminmax argmax argmin topk sort argsort any all nonzero unique_consecutive _unique2""",
    "integer counting; float cumsum is one sequential double-accumulated scan per row": """
        cumsum histc bincount one_hot cummax cummin""",
    "views, copies and layout": """
        view _unsafe_view reshape _reshape_alias alias detach expand permute transpose t
        unsqueeze squeeze slice select split split_with_sizes chunk unbind narrow as_strided
        clone contiguous cat stack flip roll repeat repeat_interleave tril triu unfold
        constant_pad_nd lift_fresh lift_fresh_copy _local_scalar_dense item set_ resize_""",
    "indexing, gather and scatter without accumulation": """
        embedding index index_select gather index_put index_put_ scatter scatter_ index_copy
        index_copy_ index_fill index_fill_ masked_select masked_scatter take""",
    "factories and random sampling (own generator)": """
        arange zeros zeros_like ones ones_like full full_like empty empty_like empty_strided
        new_zeros new_ones new_full new_empty scalar_tensor linspace tensor multinomial uniform_
        normal_ bernoulli_ exponential_ rand randn randint randperm""",
}
# Non-aten ops a sharded forward (trainer/fsdp.py, FSDP2) dispatches: the parameter all-gather
# (whole-tensor copies in and out of one buffer, and gloo/NCCL's all-gather, which moves bytes) and
# the profiler's record-function markers (no tensor values). Keys are qualified op names.
EXACT_COMM_OPS: frozenset[str] = frozenset(
    {
        "fsdp::all_gather_copy_in",
        "fsdp::split_with_sizes_copy",
        "c10d::_allgather_base_",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
    }
)
EXACT_OPS: frozenset[str] = (
    frozenset(f"aten::{name}" for names in EXACT_OPS_BY_REASON.values() for name in names.split())
    | EXACT_COMM_OPS
)
_UNCOVERED: set[str] = set()


def classify(op: torch._ops.OpOverload) -> str | None:
    """'covered', 'exact', or None (the op runs on its default kernel: not batch-invariant)."""
    if op in _OVERRIDES:
        return "covered"
    if op.overloadpacket._qualified_op_name in EXACT_OPS:
        return "exact"
    return None


def uncovered_ops() -> frozenset[str]:
    """Ops dispatched inside the mode (forward) that are neither covered nor exact, so far."""
    return frozenset(_UNCOVERED)


def in_backward() -> bool:
    """True while the autograd engine runs a backward node (ops then use the default kernels)."""
    return torch._C._current_autograd_node() is not None


class _InvariantMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_backward():  # reference backward: autograd's formula on the default kernels
            return func(*args, **kwargs)
        impl = _OVERRIDES.get(func)
        if impl is None:
            if classify(func) is None:
                _report(func.name())
            return func(*args, **kwargs)
        if any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args):
            return func(*args, **kwargs)  # CPU kernels only
        try:
            return impl(*args, **kwargs)
        except NotCovered as e:
            _report(f"{func.name()} ({e})")
            return func(*args, **kwargs)


def _report(what: str) -> None:
    if what not in _UNCOVERED:
        _UNCOVERED.add(what)
        logger.warning("batch_invariant_mode: %s is not covered; default kernel used", what)


_local = threading.local()


@contextlib.contextmanager
def batch_invariant_mode() -> Iterator[None]:
    """Run the enclosed forward passes on the batch-invariant kernels (this thread only).

    Re-entrant: entering on a thread that is already inside only counts the depth. Each thread
    enters its own mode (dispatch modes are thread-local), so a generation thread and a trainer
    thread can both be inside at once.
    """
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        if depth:
            yield
        else:
            with _InvariantMode():
                yield
    finally:
        _local.depth = depth


def is_active() -> bool:
    """Whether the current thread is inside `batch_invariant_mode()`."""
    return getattr(_local, "depth", 0) > 0
