"""Bit-level primitives of the delta codec: dtype table, ordered-integer keys, zigzag, planes.

Why: a lossless delta works on the *bit patterns* of tensors, never on their float values, so
NaN payloads, -0.0, +-inf and subnormals survive exactly. Floats are mapped to unsigned
"ordered keys" (a bijection on bit patterns that is monotonic in the float order), so that
nearby floats have nearby keys and the difference new - old, taken modulo 2**width, is a small
signed integer: its size in ULPs. Integers use their own bits as keys (wrapping difference).

Everything here is vectorised numpy on little-endian unsigned views; `varint_encode_ref` /
`varint_decode_ref` are the plain-loop versions the reference codec uses, the others are the
vectorised ones of the fast codec. Run the tests: `.venv/bin/pytest tests/unit/delta`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class DeltaFormatError(ValueError):
    """A delta, anchor or manifest is malformed or fails an integrity check."""


@dataclass(frozen=True)
class DTypeSpec:
    name: str  # canonical dtype name used in headers and hashes, e.g. "bfloat16"
    torch_dtype: torch.dtype
    width: int  # bytes per element
    exp_shift: int  # float: position of the exponent field (mantissa bits); -1 for integers
    exp_bits: int  # float: width of the exponent field; 0 for integers

    @property
    def is_float(self) -> bool:
        return self.exp_bits > 0

    @property
    def uint(self) -> np.dtype:
        return np.dtype(f"<u{self.width}")


_SPECS = [
    DTypeSpec("bfloat16", torch.bfloat16, 2, 7, 8),
    DTypeSpec("float16", torch.float16, 2, 10, 5),
    DTypeSpec("float32", torch.float32, 4, 23, 8),
    DTypeSpec("float64", torch.float64, 8, 52, 11),
    DTypeSpec("int8", torch.int8, 1, -1, 0),
    DTypeSpec("uint8", torch.uint8, 1, -1, 0),
    DTypeSpec("int16", torch.int16, 2, -1, 0),
    DTypeSpec("int32", torch.int32, 4, -1, 0),
    DTypeSpec("int64", torch.int64, 8, -1, 0),
    DTypeSpec("bool", torch.bool, 1, -1, 0),
]
SPEC_BY_NAME = {s.name: s for s in _SPECS}
SPEC_BY_TORCH = {s.torch_dtype: s for s in _SPECS}
_SIGNED_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def spec_of(t: torch.Tensor) -> DTypeSpec:
    spec = SPEC_BY_TORCH.get(t.dtype)
    if spec is None:
        raise DeltaFormatError(f"unsupported dtype {t.dtype}; supported: {sorted(SPEC_BY_NAME)}")
    return spec


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The raw bit patterns of `t` as a flat little-endian unsigned numpy array (a copy-free view
    when `t` is a contiguous CPU tensor)."""
    spec = spec_of(t)
    flat = t.detach().cpu().contiguous().reshape(-1)
    if spec.torch_dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif spec.torch_dtype != torch.uint8:
        flat = flat.view(_SIGNED_TORCH[spec.width])
    return flat.numpy().view(spec.uint)


def bits_to_tensor(
    bits: np.ndarray, spec: DTypeSpec, shape: tuple[int, ...], copy: bool = True
) -> torch.Tensor:
    """Inverse of `tensor_bits`: a CPU tensor of `spec` and `shape` holding exactly `bits`.

    copy=False: the tensor may share `bits`' memory (for a fresh array nobody else holds);
    a read-only array is copied anyway."""
    assert bits.dtype == spec.uint and bits.size == int(np.prod(shape, dtype=np.int64)), (
        f"bits {bits.dtype}[{bits.size}] do not fit {spec.name}{list(shape)}"
    )
    arr = np.ascontiguousarray(bits)
    if copy or not arr.flags.writeable:
        arr = arr.copy()
    if spec.torch_dtype == torch.uint8:
        out = torch.from_numpy(arr)
    elif spec.torch_dtype == torch.bool:
        out = torch.from_numpy(arr).view(torch.bool)
    else:
        out = torch.from_numpy(arr.view(f"<i{spec.width}")).view(spec.torch_dtype)
    return out.reshape(shape)


def ordered_key_formula(bits: np.ndarray, spec: DTypeSpec) -> np.ndarray:
    """Map bit patterns to unsigned keys whose order is the numeric order of the floats.

    Sign-magnitude floats: a non-negative float gets its sign bit set; a negative one has all
    bits inverted. -0.0 and +0.0 become adjacent keys, NaNs (any payload) land beyond +-inf.
    A bijection on all 2**width patterns, so decoding is exact for every input. Integers: identity.
    """
    if not spec.is_float:
        return bits
    sign = bits.dtype.type(1 << (8 * spec.width - 1))
    negative = (bits & sign) != 0
    return np.where(negative, ~bits, bits | sign)


def ordered_key_inverse_formula(key: np.ndarray, spec: DTypeSpec) -> np.ndarray:
    if not spec.is_float:
        return key
    sign = key.dtype.type(1 << (8 * spec.width - 1))
    was_nonnegative = (key & sign) != 0
    return np.where(was_nonnegative, key ^ sign, ~key)


# 16-bit floats: the same maps as 65536-entry tables (one gather instead of five passes)
_ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
_KEY16 = ordered_key_formula(_ALL16, SPEC_BY_NAME["bfloat16"])
_KEY16_INVERSE = ordered_key_inverse_formula(_ALL16, SPEC_BY_NAME["bfloat16"])


def ordered_key(bits: np.ndarray, spec: DTypeSpec) -> np.ndarray:
    """`ordered_key_formula`, by table lookup for 16-bit floats."""
    if spec.is_float and spec.width == 2:
        return np.take(_KEY16, bits)
    return ordered_key_formula(bits, spec)


def ordered_key_inverse(key: np.ndarray, spec: DTypeSpec) -> np.ndarray:
    """`ordered_key_inverse_formula`, by table lookup for 16-bit floats."""
    if spec.is_float and spec.width == 2:
        return np.take(_KEY16_INVERSE, key)
    return ordered_key_inverse_formula(key, spec)


def exponent_field(bits: np.ndarray, spec: DTypeSpec) -> np.ndarray:
    """The biased exponent of each float: the context that predicts the ULP size. uint8 when it
    fits (bf16, fp16, fp32: a stable argsort of uint8 is one radix pass), else uint16."""
    assert spec.is_float, f"{spec.name} has no exponent field"
    mask = (1 << spec.exp_bits) - 1
    return ((bits >> bits.dtype.type(spec.exp_shift)) & bits.dtype.type(mask)).astype(
        np.uint8 if spec.exp_bits <= 8 else np.uint16
    )


def zigzag(d: np.ndarray) -> np.ndarray:
    """Signed (two's complement, held in an unsigned array) -> unsigned, small |d| -> small value."""
    top = d.dtype.type(8 * d.dtype.itemsize - 1)
    return (d << d.dtype.type(1)) ^ (d.dtype.type(0) - (d >> top))


def unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> z.dtype.type(1)) ^ (z.dtype.type(0) - (z & z.dtype.type(1)))


def to_planes(values: np.ndarray) -> bytes:
    """Byte-plane shuffle: all low bytes, then all next bytes, ... (helps zstd on residuals)."""
    w = values.dtype.itemsize
    return np.ascontiguousarray(
        values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, w).T
    ).tobytes()


def from_planes(data: bytes, dtype: np.dtype, n: int) -> np.ndarray:
    w = np.dtype(dtype).itemsize
    if len(data) != n * w:
        raise DeltaFormatError(f"byte planes hold {len(data)} bytes, expected {n} x {w}")
    planes = np.frombuffer(data, dtype=np.uint8).reshape(w, n)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(n)


# ---- unsigned LEB128 varints (gap coding of change positions) ----


def varint_encode_ref(values: np.ndarray) -> bytes:
    """Reference: one value at a time, 7 bits per byte, high bit = more bytes follow."""
    out = bytearray()
    for v in values.tolist():
        assert v >= 0, f"varint of negative {v}"
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def varint_decode_ref(data: bytes, count: int) -> np.ndarray:
    out, v, shift = [], 0, 0
    for b in data:
        v |= (b & 0x7F) << shift
        shift += 7
        if shift > 63:
            raise DeltaFormatError("varint longer than 9 bytes")
        if b < 0x80:
            out.append(v)
            v, shift = 0, 0
    if shift != 0 or len(out) != count:
        raise DeltaFormatError(
            f"varint stream holds {len(out)} complete values (+{shift // 7} "
            f"dangling bytes), expected {count}"
        )
    return np.asarray(out, dtype=np.uint64)


def varint_encode(values: np.ndarray) -> bytes:
    """Vectorised LEB128 (same bytes as `varint_encode_ref`)."""
    v = values.astype(np.uint64, copy=False)
    if v.size == 0:
        return b""
    nbytes = np.ones(v.size, dtype=np.int64)
    for k in range(1, 10):
        nbytes += v >= np.uint64(1 << (7 * k))
    width = int(nbytes.max())
    cols = np.arange(width, dtype=np.uint64)
    grid = ((v[:, None] >> (cols * np.uint64(7))[None, :]) & np.uint64(0x7F)).astype(np.uint8)
    more = cols[None, :].astype(np.int64) < (nbytes[:, None] - 1)
    grid |= (more * 0x80).astype(np.uint8)
    keep = cols[None, :].astype(np.int64) < nbytes[:, None]
    return grid[keep].tobytes()


def varint_decode(data: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count or (b.size and ends[-1] != b.size - 1):
        raise DeltaFormatError(
            f"varint stream holds {ends.size} complete values in {b.size} bytes, "
            f"expected {count} ending at the last byte"
        )
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 9:
        raise DeltaFormatError("varint longer than 9 bytes")
    within = np.arange(b.size) - np.repeat(starts, lengths)
    parts = (b & 0x7F).astype(np.uint64) << (within.astype(np.uint64) * np.uint64(7))
    return np.add.reduceat(parts, starts)
