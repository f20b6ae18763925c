"""Batch-invariant fp32 matmul on BLAS: split into integers whose float64 products sum exactly.

`exact_bmm(a [B, M, K], b [B, K, N]) -> [B, M, N]` float32. The tree matmul of
kernels/invariant.py fixes the summation order by doing the arithmetic itself (elementwise
products, halving adds), 40-60x slower than BLAS. This kernel makes the order *irrelevant*
instead (the Ozaki scheme): it rewrites the operands as small integers times powers of two so
that every float64 product and every partial sum BLAS forms is an integer below 2^53, hence
exact, hence the same whatever order, blocking, thread split or instruction set `torch.bmm`
uses. Three float64 GEMMs cost about 6-14x one float32 GEMM.

Splitting, all elementwise and exact (power-of-two scalings, `trunc`, subtraction of the
integer part):
1. each K-row of b is scaled by 2^-f_k (f_k the exponent of its largest |value|), so the row
   lies in (-1, 1); a's column k is scaled by 2^f_k, which leaves a @ b unchanged;
2. each M-row of the scaled a is scaled by 2^(BETA - e_i) (e_i the exponent of its largest
   |value|) and cut into two integer slices a0 + a1 2^-BETA, |a0|, |a1| < 2^BETA (bits below
   2^(e_i - 2 BETA) are dropped); b likewise into b0 + b1 2^-BETA at the fixed exponent 0;
3. c = a0 @ b0 + (a0 @ b1 + a1 @ b0) 2^-BETA, scaled back by 2^(e_i - 2 BETA), rounded to float32
   (the a1 @ b1 term, 2^-2 BETA of the row scale, is dropped).

A product of two slices is below 2^(2 BETA) and a sum of K of them below K 2^(2 BETA) <= 2^53
for K <= K_MAX = 2^17 with BETA = 18 (fixed, not derived from K, so a longer zero-padded K gives
the same bits). Every scale depends only on a's own row and b's own K-rows, so a row's result
does not depend on the other rows of a (batch invariance), and zero columns of a contribute
exact zeros wherever they are (padding invariance, KV-cache decode == full forward). Accuracy:
error below 2^-36 of max|a_i| sum|b| per row, far inside float32 rounding (tests compare with
float64). Rows of a with inf/NaN, and any non-finite b, take the tree matmul (row-local too).
For a weight `b` that is a view of an `nn.Parameter`, its slices are cached (keyed by the
parameter's identity, storage, version counter and view geometry), so a decode step does not re-split
the weights. K > K_MAX is reduced in blocks of K_MAX added left to right.

Two integer forms of the scheme, chosen by `SCHEME` (different bits: the trainer and the replica
must use the same one). `float64` is the default:
- `float64`: the two 18-bit slices of steps 2-3 above, three float64 GEMMs (`torch.bmm`).
- `int8` (measured, not the default): int8 slices multiplied by `torch._int_mm` (int8 x int8 ->
  int32, exact on every CPU; oneDNN runs it on AMX / VNNI where the CPU has them: 20x a float32
  GEMM's rate on this CPU for 256 x 640 x 1792). Each scaled operand, in (-1, 1), is cut into
  S8 = 5 slices of 7 bits (|slice| <= 127); the products of slices s + t <= S8 - 1 are kept
  (15 of 25). The products of one diagonal d = s + t are one GEMM over a concatenated K,
  [a_d .. a_0] @ [b_0; ..; b_d], an int32 sum below 5 K 127^2 < 2^31 for K <= K_MAX_INT8 = 2^14;
  the diagonals are combined in int64 (Horner, exact) and rounded to float64 once. Invariant
  under the same conditions as `float64` (0 differing tokens on the models of bench/hf_models.py),
  but the step is bound by the elementwise splitting, not the GEMMs: per training step 1.15-1.9x
  faster than `float64` on the 63.6M dense model, 0.9-1.0x on the 89.2M MoE one
  (bench/hf_invariance.py), not enough to change the default.

Both forms are batch-invariant only when b's K-row scales do not depend on the call: true for a
weight, false for q @ k^T, whose K-rows span every key of the call (kernels/hf_mode.py routes the
products of two activations to the tree for that reason).
"""

from __future__ import annotations

import threading
import weakref

import torch

from kernels import fixed_order

BETA = 18
K_MAX = 1 << 17
_SCALE = 2.0**BETA
SCHEME = (
    "fixed"  # or "float64", "int8": see the module docstring (bench/hf_invariance.py compares them)
)
S8 = 5  # int8 slices per operand (7 bits each)
K_MAX_INT8 = 1 << 14  # S8 * K_MAX_INT8 * 127^2 < 2^31: every int32 sum is exact


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float64 2^e for integer-valued e in [-1022, 1023], built from the exponent bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _exponent(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Exponent e (float64) with max |x| along dim < 2^e (0 for an all-zero row), keepdim."""
    return torch.frexp(x.abs().amax(dim=dim, keepdim=True)).exponent.to(torch.float64)


def _slices(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float64, |x| < 2^BETA) -> integer-valued (x0, x1) with x ~ x0 + x1 2^-BETA."""
    x0 = torch.trunc(x)
    return x0, torch.trunc((x - x0) * _SCALE)


def _split_b(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """b [B, K, N] -> (b0, b1 float32 integer slices, f [B, K, 1] float64 row exponents)."""
    b64 = b.to(torch.float64)
    f = _exponent(b64, 2)
    b0, b1 = _slices(b64 * pow2(-f) * _SCALE)
    return b0.float(), b1.float(), f  # |slices| < 2^18: exact in float32, half the cache


DERIVED_FROM = "_flywheel_derived_from"


def mark_derived(t: torch.Tensor, source: torch.Tensor, how: str) -> torch.Tensor:
    """Declare `t` a pure function `how` of the parameter `source`'s current value (e.g. its bf16
    rounding, made afresh each forward), so `_ParamCache` keys `t`'s packed form by `source` and
    its version counter instead of repacking `t` on every call. Returns `t`."""
    setattr(t, DERIVED_FROM, (weakref.ref(source), how))
    return t


class _ParamCache:
    """b's slices for views of parameters, invalidated by in-place updates (version counter).

    `weight` names the parameter view that `b` was made from where `b` itself is not tracked as a
    view: views taken inside a dispatch mode (kernels/hf_mode.py's `b[None]`, an expert's `w[g]`)
    run below autograd, so they have no `_base`; `tag` tells apart several `b` from one `weight`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple, tuple] = {}

    def get(self, b: torch.Tensor, split=None, weight=None, tag=None) -> tuple[torch.Tensor, ...]:
        split = split or _split_b
        ref = b if weight is None else weight
        base = ref._base if ref._base is not None else ref
        how = None
        if not isinstance(base, torch.nn.Parameter):  # a tensor marked by `mark_derived`?
            derived = getattr(base, DERIVED_FROM, None)
            base = derived[0]() if derived is not None else None
            if base is None:
                return split(b)
            how = derived[1]
        key = (
            split.__name__,
            id(base),
            base.untyped_storage().data_ptr(),  # `param.data = t` swaps storage, keeps the version
            ref.storage_offset(),
            tuple(ref.shape),
            tuple(ref.stride()),
            ref.dtype,
            tag,
            how,
        )
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and hit[0]() is base and hit[1] == base._version:
            return hit[2]
        value = split(b)
        with self._lock:
            self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
            self._entries[key] = (weakref.ref(base), base._version, value)
        return value


_CACHE = _ParamCache()


def _exact_block(a: torch.Tensor, b: torch.Tensor, split) -> torch.Tensor:
    """float64 a @ b for K <= K_MAX, a [B, M, K] and b [B, K, N] finite float32."""
    b0, b1, f = split
    b0, b1 = b0.to(torch.float64), b1.to(torch.float64)
    scaled = a.to(torch.float64) * pow2(f.transpose(1, 2))
    e = _exponent(scaled, 2)
    a0, a1 = _slices(scaled * pow2(BETA - e))
    c = torch.bmm(a0, b0) + (torch.bmm(a0, b1) + torch.bmm(a1, b0)) * (1.0 / _SCALE)
    return c * pow2(e - 2 * BETA)


def _slices8(x: torch.Tensor) -> torch.Tensor:
    """x (float32, |x| < 1) -> int8 slices [S8, *x.shape], x = sum_s x_s 2^(-7 (s + 1)) exactly but
    for the bits below 2^-35 (x * 128, trunc and the fraction are exact in float32)."""
    out = x.new_empty(S8, *x.shape, dtype=torch.int8)
    for s in range(S8):
        x = x * 128.0
        xs = torch.trunc(x)
        x = x - xs
        out[s] = xs
    return out


def _unit_rows(x64: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float64) -> (x 2^-e in (-1, 1) as float32, e float64 keepdim), e per slice along `dim`.
    Elements below 2^-126 of their row's largest become float32 subnormals or zero: deterministic,
    and far below the 2^-35 the slices keep."""
    e = _exponent(x64, dim)
    return (x64 * pow2(-e)).float(), e


def _split_b8(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """b [B, K, N] -> (int8 slices [B, N, S8 K] = [b_0^T | .. | b_{S8-1}^T], f [B, K, 1] float64 row
    exponents, all finite). Transposed: `_int_mm` runs fastest on a [K, N] operand with N-stride K."""
    finite = bool(torch.isfinite(b).all())
    unit, f = _unit_rows(b.to(torch.float64), 2)
    sl = _slices8(unit.transpose(1, 2))  # [S8, B, N, K]
    return sl.permute(1, 2, 0, 3).flatten(2).contiguous(), f, finite


def _exact_block8(a: torch.Tensor, split) -> torch.Tensor:
    """float64 a @ b for K <= K_MAX_INT8 from int8 slice GEMMs, a [B, M, K] finite, b as split."""
    b_t, f, _ = split
    k = a.shape[2]
    unit, e = _unit_rows(a.to(torch.float64) * pow2(f.transpose(1, 2)), 2)
    # [a_{S8-1} | .. | a_0] along K: diagonal d's left operand [a_d .. a_0] is the last (d + 1) K
    a_rev = _slices8(unit).flip(0).permute(1, 2, 0, 3).flatten(2)  # [B, M, S8 K]
    out = a.new_empty(a.shape[0], a.shape[1], b_t.shape[1], dtype=torch.float64)
    for i in range(a.shape[0]):
        # sum_d C_d 2^(7 (S8 - 1 - d)) < 2^59: exact in int64, one rounding to float64 (Horner)
        acc = None
        for d in range(S8):
            c = torch._int_mm(a_rev[i, :, (S8 - 1 - d) * k :], b_t[i, :, : (d + 1) * k].t())
            acc = c.to(torch.int64) if acc is None else acc.mul_(128).add_(c)
        out[i] = acc
    return out * pow2(e - 7 * (S8 + 1))


def _pack(b: torch.Tensor) -> torch.Tensor:
    return fixed_order.pack(b)


def active_scheme() -> str:
    """The scheme `exact_bmm` runs: SCHEME, or `float64` where `fixed` cannot be built here."""
    assert SCHEME in ("fixed", "float64", "int8"), f"unknown exact_matmul.SCHEME {SCHEME!r}"
    if SCHEME == "fixed" and not fixed_order.available():
        return "float64"
    return SCHEME


def exact_bmm(
    a: torch.Tensor, b: torch.Tensor, tree_bmm, weight: torch.Tensor | None = None, tag=None
) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] float32 -> float32; `tree_bmm` serves non-finite rows (the
    integer schemes; the fixed-order kernel computes them as they come). `weight` / `tag`: the
    parameter view `b` was made from, for the cache of b's packed form (`_ParamCache`)."""
    assert a.dtype == b.dtype == torch.float32, (
        f"exact_bmm expects float32, got {a.dtype}, {b.dtype}"
    )
    k = a.shape[2]
    if k == 0:
        return a.new_zeros(a.shape[0], a.shape[1], b.shape[2])
    scheme = active_scheme()
    if scheme == "fixed":
        return fixed_order.bmm(a, _CACHE.get(b, _pack, weight, tag), b.shape[2])
    int8 = scheme == "int8"
    if not int8 and not bool(torch.isfinite(b).all()):
        return tree_bmm(a, b)
    k_max = K_MAX_INT8 if int8 else K_MAX
    out = None
    for start in range(0, k, k_max):  # blocks of k_max, summed left to right
        ab, bb = a[:, :, start : start + k_max], b[:, start : start + k_max]
        if int8:  # b's finiteness is cached with its slices
            split = _CACHE.get(bb, _split_b8, weight, tag) if k <= k_max else _split_b8(bb)
            if not split[2]:
                return tree_bmm(a, b)
            part = _exact_block8(ab, split)
        else:
            split = _CACHE.get(bb, None, weight, tag) if k <= k_max else _split_b(bb)
            part = _exact_block(ab, bb, split)
        out = part if out is None else out + part
    out = out.float()
    bad = ~torch.isfinite(a).all(dim=2)  # [B, M]
    if bool(bad.any()):
        for i in bad.any(dim=1).nonzero()[:, 0].tolist():
            rows = bad[i].nonzero()[:, 0]
            out[i, rows] = tree_bmm(a[i : i + 1, rows], b[i : i + 1])[0]
    return out
