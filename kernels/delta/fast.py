"""Fast per-tensor delta codec: the same bytes as `reference.py`, computed with less work.

What differs from the reference (the format and the candidate choice are identical):
- keys, the permutation, the changed mask and positions are computed once per tensor and
  shared by all six candidates; the positions sections (gaps, bitmap) are compressed once and
  reused for both residuals instead of once per candidate;
- varints are encoded/decoded vectorised (bits.varint_encode / varint_decode), and so are the
  escape-expanded gap symbols of the "ans" layout (entropy.gap_symbols);
- the driver (`codec.py`) runs tensors on a thread pool: zstd, hashlib and most numpy kernels
  release the GIL, so tensors encode in parallel; the pooled streams are compressed by zstd's
  multi-threaded mode, whose bytes do not depend on the number of workers (the reference uses 1).
"""

from __future__ import annotations

import numpy as np
import zstandard

import kernels.delta.entropy as entropy
import kernels.delta.reference as reference
from kernels.delta.bits import (
    DeltaFormatError,
    DTypeSpec,
    exponent_field,
    from_planes,
    ordered_key,
    ordered_key_inverse,
    to_planes,
    unzigzag,
    varint_decode,
    varint_encode,
    zigzag,
)
from kernels.delta.container import TensorEntry, store_section
from kernels.delta.reference import decode_full, encode_full  # noqa: F401  (same code path)


def _order(old: np.ndarray, spec: DTypeSpec) -> tuple[str, np.ndarray | None, np.ndarray]:
    """(order name, permutation or None, group sizes in stream order)."""
    if spec.is_float:
        exp = exponent_field(old, spec)
        return "exponent", np.argsort(exp, kind="stable"), entropy.group_sizes(exp, old.size, spec)
    return "natural", None, entropy.group_sizes(None, old.size, spec)


def encode_tensor(
    old: np.ndarray, new: np.ndarray, spec: DTypeSpec, compressor: zstandard.ZstdCompressor
) -> tuple[dict, list[bytes]]:
    order, perm, groups = _order(old, spec)
    if perm is not None:
        old, new = old[perm], new[perm]
    changed = new != old
    positions = np.flatnonzero(changed)
    gaps = np.diff(positions, prepend=-1) - 1
    pos_raw = {
        "gaps": varint_encode(gaps.astype(np.uint64)),
        "bitmap": np.packbits(changed).tobytes(),
    }
    pos_size = {k: len(store_section(v, compressor).data) for k, v in pos_raw.items()}
    residuals = {
        "ulp": zigzag(ordered_key(new, spec) - ordered_key(old, spec)),
        "xor": new ^ old,
    }
    candidates: dict[tuple[str, str], list[bytes]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for residual, r in residuals.items():
        dense = to_planes(r)
        sparse = to_planes(r[positions])
        dense_size = len(store_section(dense, compressor).data)
        sparse_size = len(store_section(sparse, compressor).data)
        for kind in ("gaps", "bitmap"):
            candidates[(kind, residual)] = [pos_raw[kind], sparse]
            sizes[(kind, residual)] = pos_size[kind] + sparse_size
        candidates[("dense", residual)] = [dense]
        sizes[("dense", residual)] = dense_size
    allowed = reference.candidates(int(positions.size), old.size)
    if ("ans", "ulp") in allowed:
        candidates[("ans", "ulp")] = entropy.encode(
            old, new, spec, "ulp", groups, z_all=residuals["ulp"]
        )
        sizes[("ans", "ulp")] = sum(
            len(store_section(raw, compressor).data) for raw in candidates[("ans", "ulp")]
        )
    best = None
    for cand in allowed:  # the reference's tie-break order
        if best is None or sizes[cand] < sizes[best]:
            best = cand
    kind, residual = best
    return {
        "kind": kind,
        "residual": residual,
        "order": order,
        "n_changed": int(positions.size),
    }, candidates[best]


def decode_tensor(
    entry: TensorEntry, old: np.ndarray, spec: DTypeSpec, raws: list[bytes]
) -> np.ndarray:
    n, k = old.size, entry.n_changed
    if entry.order == "exponent":
        exp = exponent_field(old, spec)
        perm, groups = np.argsort(exp, kind="stable"), entropy.group_sizes(exp, n, spec)
    else:
        perm, groups = None, entropy.group_sizes(None, n, spec)
    if entry.kind == "ans":  # only the changed elements are gathered/scattered, in natural order
        positions, r = entropy.decode(spec, groups, k, raws)
        at = perm[positions] if perm is not None else positions
        new = old.copy()
        new[at] = entropy.apply(old[at], r, spec, entry.residual)
        return new
    old_s = old[perm] if perm is not None else old
    xor = entry.residual == "xor"
    if entry.kind == "dense":
        r = from_planes(raws[0], spec.uint, n)
        new_s = (
            old_s ^ r if xor else ordered_key_inverse(ordered_key(old_s, spec) + unzigzag(r), spec)
        )
    else:
        if entry.kind == "gaps":
            positions = np.cumsum(varint_decode(raws[0], k).astype(np.int64) + 1) - 1
        else:
            all_bits = np.unpackbits(np.frombuffer(raws[0], dtype=np.uint8))
            if all_bits[n:].any():
                raise DeltaFormatError(f"{entry.name}: bitmap padding bits are not zero")
            mask = all_bits[:n].view(bool)
            positions = np.flatnonzero(mask)
        if positions.size != k or (k and (positions[-1] >= n or positions.min() < 0)):
            raise DeltaFormatError(f"{entry.name}: change positions do not fit {n} elements")
        r = from_planes(raws[1], spec.uint, k)
        at = old_s[positions]
        new_s = old_s.copy()
        new_s[positions] = (
            at ^ r if xor else ordered_key_inverse(ordered_key(at, spec) + unzigzag(r), spec)
        )
    if perm is None:
        return new_s
    new = np.empty_like(old)
    new[perm] = new_s
    return new
