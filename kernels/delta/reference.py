"""Reference per-tensor delta codec: the format's definition, written to be read, not to be fast.

Encoding one tensor whose bits change from `old` to `new` (flat unsigned arrays, n elements):

1. Order. Floats: the elements are stable-sorted by the exponent field of the OLD value (the
   decoder has it too, so the permutation costs nothing to transmit). Elements with the same
   exponent have the same ULP size and so a similar chance of changing and a similar residual
   size; grouping them is what lets zstd model them well. Integers keep their natural order.
2. Residual of every element, in that order: "ulp" = zigzag((key(new) - key(old)) mod 2**w)
   with `key` the monotonic ordered-integer map of bits.ordered_key, or "xor" = new ^ old.
3. Layout: "dense" = byte planes of all n residuals; "gaps" = LEB128 varints of the gaps
   (p[i] - p[i-1] - 1, p[-1] = -1) between changed positions, then byte planes of the changed
   residuals; "bitmap" = np.packbits (big bit order) of the changed mask, then the same planes;
   "ans" (ulp residual only) = positions and residuals entropy-coded with one model per
   exponent group of the base (one group for integers): side info, an ANS stream and the raw
   escaped residuals (entropy.py defines it).
4. Choice: each candidate's sections are compressed on their own (single-threaded zstd at the
   delta's level, or kept raw when that is not smaller); of the 7 candidates the one with the
   fewest bytes wins; ties go to the first in the order (gaps, bitmap, dense) x (ulp, xor),
   then (ans, ulp): the entropy-coded layout is chosen only when strictly smaller, and is tried
   only when at most ANS_MAX_CHANGED of the elements changed (`candidates`: decode speed).
5. The chosen raw sections are appended to the delta's streams (codec.py): all tensors' gaps
   in one stream, bitmaps in another, sparse residuals, dense residuals and whole tensors in
   three more, each stream one zstd frame. Pooling saves the per-frame overhead and Huffman
   tables that dominate a sparse delta of many small tensors.

The fast codec (`fast.py`) must produce the identical bytes; tests/unit/delta checks that.
"""

from __future__ import annotations

import numpy as np
import zstandard

import kernels.delta.entropy as entropy
from kernels.delta.bits import (
    DeltaFormatError,
    DTypeSpec,
    exponent_field,
    from_planes,
    ordered_key,
    ordered_key_inverse,
    to_planes,
    unzigzag,
    varint_decode_ref,
    varint_encode_ref,
    zigzag,
)
from kernels.delta.container import TensorEntry, store_section

KINDS = ("gaps", "bitmap", "dense")
RESIDUALS = ("ulp", "xor")
CANDIDATES = [(kind, residual) for kind in KINDS for residual in RESIDUALS] + [("ans", "ulp")]
ANS_MAX_CHANGED = 0.4  # the ans layout is tried only up to this fraction of changed elements


def candidates(n_changed: int, n: int) -> list[tuple[str, str]]:
    """The candidate layouts for a tensor. Decoding `ans` costs ~2 ANS symbols per changed
    element: past ANS_MAX_CHANGED it would decode > 1.5x slower than the zstd layouts, for a
    gain of ~10% (measured on the policy at lr 1e-4, 10 steps: 62% changed)."""
    return CANDIDATES if n_changed <= ANS_MAX_CHANGED * n else CANDIDATES[:-1]


def element_order(old: np.ndarray, spec: DTypeSpec) -> tuple[str, np.ndarray]:
    """(order name, permutation): stream position j holds element perm[j]."""
    if spec.is_float:
        return "exponent", np.argsort(exponent_field(old, spec), kind="stable")
    return "natural", np.arange(old.size)


def residual_of(old: np.ndarray, new: np.ndarray, spec: DTypeSpec, residual: str) -> np.ndarray:
    if residual == "xor":
        return new ^ old
    return zigzag(ordered_key(new, spec) - ordered_key(old, spec))  # unsigned: wraps mod 2**w


def apply_residual(old: np.ndarray, r: np.ndarray, spec: DTypeSpec, residual: str) -> np.ndarray:
    if residual == "xor":
        return old ^ r
    return ordered_key_inverse(ordered_key(old, spec) + unzigzag(r), spec)


def group_sizes(old: np.ndarray, spec: DTypeSpec, order: str) -> np.ndarray:
    """Sizes of the contiguous element groups of the stream order (per base exponent, or one)."""
    key = exponent_field(old, spec) if order == "exponent" else None
    return entropy.group_sizes(key, old.size, spec)


def raw_sections(
    old: np.ndarray,
    new: np.ndarray,
    spec: DTypeSpec,
    kind: str,
    residual: str,
    sizes: np.ndarray | None = None,
) -> list[bytes]:
    """The uncompressed sections of one candidate encoding (old/new already in stream order;
    `sizes`: the stream order's groups, for kind "ans")."""
    if kind == "ans":
        return entropy.encode(old, new, spec, residual, sizes, reference=True)
    r = residual_of(old, new, spec, residual)
    changed = new != old
    positions = np.flatnonzero(changed)
    if kind == "dense":
        return [to_planes(r)]
    if kind == "gaps":
        gaps = np.diff(positions, prepend=-1) - 1
        return [varint_encode_ref(gaps.astype(np.uint64)), to_planes(r[positions])]
    return [np.packbits(changed).tobytes(), to_planes(r[positions])]


def encode_tensor(
    old: np.ndarray, new: np.ndarray, spec: DTypeSpec, compressor: zstandard.ZstdCompressor
) -> tuple[dict, list[bytes]]:
    """Encode one changed tensor. Returns (entry fields, [raw section bytes, ...])."""
    order, perm = element_order(old, spec)
    old_s, new_s = old[perm], new[perm]
    sizes = group_sizes(old, spec, order)
    best = None
    for kind, residual in candidates(int(np.count_nonzero(new_s != old_s)), old.size):
        raws = raw_sections(old_s, new_s, spec, kind, residual, sizes)
        size = sum(len(store_section(raw, compressor).data) for raw in raws)
        if best is None or size < best[0]:
            best = (size, kind, residual, raws)
    _, kind, residual, raws = best
    fields = {
        "kind": kind,
        "residual": residual,
        "order": order,
        "n_changed": int(np.count_nonzero(new != old)),
    }
    return fields, raws


def decode_tensor(
    entry: TensorEntry, old: np.ndarray, spec: DTypeSpec, raws: list[bytes]
) -> np.ndarray:
    """Bits of the target tensor from the base bits and the entry's sections (not yet hash-checked)."""
    n, k = old.size, entry.n_changed
    if entry.order == "exponent":
        perm = np.argsort(exponent_field(old, spec), kind="stable")
    else:
        perm = np.arange(n)
    old_s = old[perm]
    if entry.kind == "dense":
        r = from_planes(raws[0], spec.uint, n)
        new_s = apply_residual(old_s, r, spec, entry.residual)
    elif entry.kind == "ans":
        positions, r = entropy.decode(spec, group_sizes(old, spec, entry.order), k, raws)
        new_s = old_s.copy()
        new_s[positions] = apply_residual(old_s[positions], r, spec, entry.residual)
    else:
        if entry.kind == "gaps":
            gaps = varint_decode_ref(raws[0], k)
            positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
        else:
            all_bits = np.unpackbits(np.frombuffer(raws[0], dtype=np.uint8))
            if all_bits[n:].any():
                raise DeltaFormatError(f"{entry.name}: bitmap padding bits are not zero")
            mask = all_bits[:n].astype(bool)
            positions = np.flatnonzero(mask)
        if positions.size != k or (k and (positions[-1] >= n or positions.min() < 0)):
            raise DeltaFormatError(f"{entry.name}: change positions do not fit {n} elements")
        r = from_planes(raws[1], spec.uint, k)
        new_s = old_s.copy()
        new_s[positions] = apply_residual(old_s[positions], r, spec, entry.residual)
    new = np.empty_like(old)
    new[perm] = new_s
    return new


def encode_full(new: np.ndarray) -> list[bytes]:
    return [to_planes(new)]


def decode_full(entry: TensorEntry, spec: DTypeSpec, raws: list[bytes]) -> np.ndarray:
    return from_planes(raws[0], spec.uint, entry.numel)
