"""Batch-invariant fp32 kernels: every output element is a fixed sequence of IEEE-754 ops.

Why: CPU BLAS (and torch's vectorised transcendental functions) pick reduction orders and code
paths by tensor shape, thread split and position-in-buffer (gemv vs gemm, blocking, the scalar
tail of a vectorised loop), so the same token can get different bits alone, in a batch, or in
an incremental (KV-cache) step versus a full forward. The kernels here are built only from
elementwise `+ - * /`, `sqrt`, `floor`, `max`, comparisons and integer bit operations, which are
correctly rounded / exact whatever the vector width, so an element's value depends only on the
inputs of its own row, never on what else is in the tensor. Reductions use one fixed order: a
pairwise halving tree over the reduced axis zero-padded to a power of two. That tree is also
*padding invariant*: padding a vector with more zeros only adds `x + 0 == x` steps, so a
reduction over 13 keys gives the same bits padded to 16 or to 256 — which is what makes the
incremental and the full-forward attention agree.

Compute dtype: float32 throughout (`COMPUTE_DTYPE`). Gradients are not part of the contract:
each op's backward is the plain reference op's backward (autograd.Function below), so training
with the invariant forward costs one extra reference forward in backward, not a tree backward.

Reference implementations (plain torch) live next to each kernel as `reference_*`; the parity
tests are in tests/unit/kernels/. See docs/NUMERICS.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

COMPUTE_DTYPE = torch.float32
_CHUNK_ELEMENTS = (
    1 << 20
)  # product-tensor size per chunk (4 MiB fp32): bounds memory, stays in cache


# --- forward invariant, backward reference ------------------------------------------------------
class _InvariantForward(torch.autograd.Function):
    """Value from `inv_fn(*xs)`, gradient from autograd through `ref_fn(*xs)` (recomputed)."""

    @staticmethod
    def forward(ctx, inv_fn: Callable, ref_fn: Callable, *xs: torch.Tensor) -> torch.Tensor:
        ctx.ref_fn = ref_fn
        ctx.save_for_backward(*xs)
        with torch.no_grad():
            return inv_fn(*xs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xs = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(n) for x, n in zip(xs, needs)]
            out = ctx.ref_fn(*leaves)
            wanted = [leaf for leaf, n in zip(leaves, needs) if n]
            grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return (None, None, *[next(grads) if n else None for n in needs])


def invariant_op(inv_fn: Callable, ref_fn: Callable, *xs: torch.Tensor) -> torch.Tensor:
    """Apply `inv_fn` (no autograd graph) with `ref_fn`'s gradient when any input needs one."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return _InvariantForward.apply(inv_fn, ref_fn, *xs)
    with torch.no_grad():
        return inv_fn(*xs)


# --- fixed-order reductions ---------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over `dim` by pairwise halving (x[:h] + x[h:]) after zero-padding to a power of two."""
    dim = dim % x.dim()
    n = x.shape[dim]
    p = _next_pow2(n)
    if p != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = p - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    else:
        x = x.clone()
    h = p
    while h > 1:
        h //= 2
        x.narrow(dim, 0, h).add_(x.narrow(dim, h, h))
    out = x.narrow(dim, 0, 1)
    return out if keepdim else out.squeeze(dim)


# --- transcendental functions from correctly-rounded ops ----------------------------------------
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # few mantissa bits: n * _LN2_HI is exact for |n| < 2^11
_LN2_LO = 1.4286067653301870e-06
_EXP_COEF = [1.0 / math.factorial(i) for i in range(8)]  # Taylor to r^7 on |r| <= ln2/2: < 3e-9 rel
_LOG_COEF = [1.0 / (2 * i + 1) for i in range(7)]  # atanh series in s^2, |s| <= 0.1716


def exp(x: torch.Tensor) -> torch.Tensor:
    """float32 exp: Cody-Waite reduction x = n ln2 + r, Horner polynomial, 2^n via exponent bits.
    On CPU, outside autograd, the same operations run as one C pass (kernels/csrc/invariant_exp.c,
    the same bits); `exp_torch` is the form that defines them."""
    assert x.dtype == COMPUTE_DTYPE, f"exp expects {COMPUTE_DTYPE}, got {x.dtype}"
    if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
        from kernels import fixed_order

        y = fixed_order.exp(x)
        if y is not None:
            return y
    return exp_torch(x)


def exp_torch(x: torch.Tensor) -> torch.Tensor:
    """`exp` as torch operations, each a correctly rounded elementwise kernel."""
    assert x.dtype == COMPUTE_DTYPE, f"exp expects {COMPUTE_DTYPE}, got {x.dtype}"
    xc = x.clamp(-87.0, 88.0)
    n = torch.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEF[-1])
    for c in reversed(_EXP_COEF[:-1]):
        p = p * r + c
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    y = p * scale
    y = torch.where(x > 88.72, torch.full_like(y, math.inf), y)
    y = torch.where(x < -87.0, torch.zeros_like(y), y)  # flush the subnormal range (and -inf) to 0
    return torch.where(torch.isnan(x), x, y)


def log(x: torch.Tensor) -> torch.Tensor:
    """float32 natural log of positive normal numbers: exponent bits + atanh series on the mantissa."""
    assert x.dtype == COMPUTE_DTYPE, f"log expects {COMPUTE_DTYPE}, got {x.dtype}"
    bits = x.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x7FFFFF) | (127 << 23)).view(torch.float32)  # mantissa in [1, 2)
    big = m > math.sqrt(2.0)
    m = torch.where(big, m * 0.5, m)
    e = (e + big.to(torch.int32)).to(torch.float32)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, _LOG_COEF[-1])
    for c in reversed(_LOG_COEF[:-1]):
        p = p * s2 + c
    y = e * _LN2_HI + ((2.0 * s) * p + e * _LN2_LO)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x < 0, torch.full_like(y, math.nan), y)
    return torch.where(torch.isinf(x) & (x > 0), x, y)


# sin / cos: range reduction and polynomial in float64, one rounding to float32 at the end. Every
# float64 op is a separate correctly-rounded elementwise kernel, so the value of an element never
# depends on the tensor around it. pi/2 is split Cody-Waite style (fdlibm's 33-bit pieces): n * P1
# and n * P2 are exact for |n| < 2^20, so r = x - n pi/2 is accurate to ~1e-16 for |x| < 1e6.
_PIO2 = (1.57079632673412561417e00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)
_TRIG_LIMIT = 1.0e6
_SIN_COEF = [(-1.0) ** i / math.factorial(2 * i + 1) for i in range(10)]  # r^19 term < 1e-20
_COS_COEF = [(-1.0) ** i / math.factorial(2 * i) for i in range(10)]


def _sin_cos_reduced(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 x -> (sin r, cos r, quadrant) in float64 with x = n pi/2 + r, |r| <= pi/4."""
    assert x.dtype == COMPUTE_DTYPE, f"sin/cos expect {COMPUTE_DTYPE}, got {x.dtype}"
    big = torch.isfinite(x) & (x.abs() > _TRIG_LIMIT)
    assert not bool(big.any()), f"sin/cos arguments must satisfy |x| <= {_TRIG_LIMIT:g}"
    xd = x.to(torch.float64)
    n = torch.floor(xd * (2.0 / math.pi) + 0.5)
    r = ((xd - n * _PIO2[0]) - n * _PIO2[1]) - n * _PIO2[2]
    r2 = r * r
    s = torch.full_like(r, _SIN_COEF[-1])
    c = torch.full_like(r, _COS_COEF[-1])
    for cs, cc in zip(reversed(_SIN_COEF[:-1]), reversed(_COS_COEF[:-1])):
        s = s * r2 + cs
        c = c * r2 + cc
    quadrant = torch.remainder(torch.nan_to_num(n), 4.0).to(torch.int64)
    return s * r, c, quadrant


def sin(x: torch.Tensor) -> torch.Tensor:
    """float32 sin, elementwise from float64 correctly-rounded ops (|x| <= 1e6)."""
    s, c, q = _sin_cos_reduced(x)
    y = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    return y.to(COMPUTE_DTYPE)


def cos(x: torch.Tensor) -> torch.Tensor:
    """float32 cos, elementwise from float64 correctly-rounded ops (|x| <= 1e6)."""
    s, c, q = _sin_cos_reduced(x)
    y = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return y.to(COMPUTE_DTYPE)


# --- kernels: invariant forward + reference ------------------------------------------------------
def _matmul_inv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [K, N] with the exact-integer BLAS kernel (kernels/exact_matmul.py): every
    caller passes a weight as `w`, whose K-row scales are constants, so a row's bits depend on that
    row alone (batch invariance); rows with inf/NaN take the halving tree."""
    from kernels.exact_matmul import exact_bmm

    k, n = w.shape
    rows = x.reshape(-1, k)
    out = exact_bmm(rows[None], w[None], _tree_bmm)[0]
    return out.reshape(*x.shape[:-1], n)


def _tree_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([_matmul_tree(a[i], b[i]) for i in range(a.shape[0])])


def _matmul_tree(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k, n = w.shape
    rows = x.reshape(-1, k)
    p2 = _next_pow2(k)
    if p2 != k:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], p2 - k)], dim=1)
        w = torch.cat([w, w.new_zeros(p2 - k, n)], dim=0)
    out = rows.new_empty(rows.shape[0], n)
    chunk = max(1, _CHUNK_ELEMENTS // (p2 * n))
    for i in range(0, rows.shape[0], chunk):
        prod = rows[i : i + chunk, :, None] * w  # [r, K, N]
        h = p2
        while h > 1:
            h //= 2
            prod[:, :h].add_(prod[:, h : 2 * h])
        out[i : i + chunk] = prod[:, 0]
    return out.reshape(*x.shape[:-1], n)


def reference_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [K, N] -> [..., N] with BLAS."""
    return x @ w


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [K, N] -> [..., N] for a weight `w`; exact-integer BLAS (`_matmul_inv`)."""
    assert x.dtype == w.dtype == COMPUTE_DTYPE, (
        f"matmul expects {COMPUTE_DTYPE}, got {x.dtype}, {w.dtype}"
    )
    assert x.shape[-1] == w.shape[0], f"matmul shapes {tuple(x.shape)} @ {tuple(w.shape)}"
    return invariant_op(_matmul_inv, reference_matmul, x, w)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] * weight [D] / sqrt(mean(x^2) + eps)."""

    def inv(x_, w_):
        ms = tree_sum(x_ * x_, -1, keepdim=True) / x_.shape[-1]
        return x_ * (1.0 / torch.sqrt(ms + eps)) * w_

    return invariant_op(inv, lambda x_, w_: reference_rms_norm(x_, w_, eps), x, weight)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) computed as x / (1 + exp(-x)) with the invariant exp."""
    return invariant_op(lambda x_: x_ / (1.0 + exp(-x_)), F.silu, x)


def reference_log_softmax(z: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z, dim=-1)


def log_softmax(z: torch.Tensor) -> torch.Tensor:
    """log-softmax over the last axis: (z - max) - log(tree_sum(exp(z - max)))."""

    def inv(z_):
        shifted = z_ - z_.amax(dim=-1, keepdim=True)
        return shifted - log(tree_sum(exp(shifted), -1, keepdim=True))

    return invariant_op(inv, reference_log_softmax, z)


def _causal_mask(q_pos: torch.Tensor, n_keys: int) -> torch.Tensor:
    """[B, 1, Tq, n_keys] bool: key j visible to the query at position p iff j <= p."""
    keys = torch.arange(n_keys, device=q_pos.device)
    return (keys[None, None, :] <= q_pos[:, :, None])[:, None]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor
) -> torch.Tensor:
    """Softmax attention, q [B,H,Tq,d], k/v [B,H,Tk,d], q_pos [B,Tq] (key j visible iff j <= q_pos)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(q_pos, k.shape[2]))


def _attention_inv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor
) -> torch.Tensor:
    from kernels import exact_matmul, fixed_order

    if exact_matmul.active_scheme() != "fixed":
        return _attention_tree(q, k, v, q_pos)
    b, h, tq, d = q.shape
    tk = k.shape[2]
    qs = (q * (1.0 / math.sqrt(d))).reshape(b * h, tq, d)
    kt = k.reshape(b * h, tk, d).transpose(1, 2)  # each score: one FMA chain over d
    scores = fixed_order.bmm(qs, fixed_order.pack(kt), tk).reshape(b, h, tq, tk)
    scores = scores.masked_fill(~_causal_mask(q_pos, tk), -math.inf)
    e = exp(scores - scores.amax(dim=-1, keepdim=True))  # masked keys: exact zeros
    num = fixed_order.bmm(e.reshape(b * h, tq, tk), fixed_order.pack(v.reshape(b * h, tk, d)), d)
    return num.reshape(b, h, tq, d) / tree_sum(e, -1)[..., None]


def _attention_tree(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor
) -> torch.Tensor:
    b, h, tq, d = q.shape
    tk = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    out = q.new_empty(b, h, tq, d)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, b * h * _next_pow2(tk) * d))
    for i in range(0, tq, chunk):
        qc = q[:, :, i : i + chunk] * scale
        scores = tree_sum(qc[:, :, :, None, :] * k[:, :, None, :, :], -1)  # [B,H,c,Tk]
        mask = _causal_mask(q_pos[:, i : i + chunk], tk)
        scores = scores.masked_fill(~mask, -math.inf)
        e = exp(scores - scores.amax(dim=-1, keepdim=True))
        num = tree_sum(e[..., None] * v[:, :, None, :, :], -2)  # [B,H,c,d]
        out[:, :, i : i + chunk] = num / tree_sum(e, -1)[..., None]
    return out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor
) -> torch.Tensor:
    """Invariant causal attention; keys reduced by the padding-invariant tree, so a decode step
    over a KV cache of any length and a full forward give the same bits."""
    return invariant_op(
        lambda q_, k_, v_: _attention_inv(q_, k_, v_, q_pos),
        lambda q_, k_, v_: reference_attention(q_, k_, v_, q_pos),
        q,
        k,
        v,
    )


# --- kernel sets --------------------------------------------------------------------------------
class Ops:
    """The kernels a model calls, as one switchable set: `invariant` or `default` (plain torch)."""

    def __init__(self, name: str, matmul, rms_norm, silu, log_softmax, attention, exp) -> None:
        self.name, self.matmul, self.rms_norm, self.silu = name, matmul, rms_norm, silu
        self.log_softmax, self.attention, self.exp = log_softmax, attention, exp

    @property
    def invariant(self) -> bool:
        return self.name == "invariant"


INVARIANT_OPS = Ops(
    "invariant",
    matmul,
    rms_norm,
    silu,
    log_softmax,
    attention,
    lambda x: invariant_op(exp, torch.exp, x),
)
DEFAULT_OPS = Ops(
    "default",
    reference_matmul,
    reference_rms_norm,
    F.silu,
    reference_log_softmax,
    reference_attention,
    torch.exp,
)
KERNEL_SETS = {"invariant": INVARIANT_OPS, "default": DEFAULT_OPS}


def get_ops(name: str) -> Ops:
    """The kernel set called `name`; raises on an unknown name."""
    if name not in KERNEL_SETS:
        raise ValueError(f"unknown kernel set {name!r}; choose one of {sorted(KERNEL_SETS)}")
    return KERNEL_SETS[name]
