"""The entropy-coded ("ans") layout of a per-tensor delta: change positions and residuals coded
with models whose contexts the decoder already has (the base tensor's exponent groups).

Why: in a sparse delta, each element's chance of changing is set mostly by its ULP size, i.e.
by the exponent of its base value (measured on the built-in policy at lr 1e-5: entropy of the
change mask 0.206 bits/element iid per tensor, 0.145 given the base exponent). Varint gaps +
zstd cannot use that context; an arithmetic-class coder with one model per exponent group can.
The coder is `constriction`'s ANS (a maintained Rust library); this module only builds models
and symbol streams.

How, per tensor (elements already in stream order: stable-sorted by base exponent for floats,
so each exponent group is contiguous; integers are one group). For each group, in order:

- side info ("model" section, LEB128 varints and bytes): k = changed elements of the group;
  if 0 < k < n and escapes are possible (L < n - k + 1), E = number of gap escapes; if k > 0,
  V = value alphabet size, then (V > 0) V + 1 quantized frequency bytes (`quant8`), the last
  the escape symbol's.
- gaps (positions): gap_i = zero-based distance from the previous change in the group (or
  the group start). Model: geometric with p = k / n, alphabet {0..L-1} plus (when
  L < n - k + 1) an escape symbol L meaning "add L, read another symbol"; exact for a
  geometric law, which is memoryless. L = min(n - k + 1, ceil(4 n / k), 4096). A group with
  k == n codes no gaps (all zero).
- values: s = z - 1 with z the residual (ulp: zigzag ordered-key difference; xor: new ^ old;
  z >= 1 for a changed element). Symbols s < V are coded with the group's categorical model;
  larger ones as the escape symbol V, their z stored raw in byte planes (the "values" section,
  all groups' escapes in order).

One ANS stream per tensor (the "ans" section, little-endian uint32 words); decoding order is
group by group, gaps then values. Probabilities are computed with exactly rounded IEEE
operations only (division, a sequential product), so every platform builds the same models.
"""

from __future__ import annotations

import constriction
import numpy as np

from kernels.delta.bits import (DTypeSpec, DeltaFormatError, from_planes, ordered_key,
                                ordered_key_inverse, to_planes, unzigzag, varint_encode, zigzag)

MAX_GAP_ALPHABET = 4096  # cap on L: escapes (memoryless) cover longer gaps at ~no cost
MAX_VALUES = 64  # cap on V: larger residuals are escaped and stored raw
_Categorical = constriction.stream.model.Categorical


# ---- side-info primitives ----

def quant8(c: np.ndarray) -> np.ndarray:
    """Counts (int64 >= 0) -> one byte each, ~6% relative precision: 0..15 exact, then a 3-bit
    mantissa and an exponent (up to 2**34). Only ratios matter, so larger counts are scaled
    down first. quant8(c) > 0 wherever c > 0."""
    c = np.asarray(c, dtype=np.int64)
    top = int(c.max(initial=0))
    if top >= 1 << 33:
        shift = top.bit_length() - 33
        c = np.where(c > 0, np.maximum(c >> shift, 1), 0)
    out = c.copy()
    big = c >= 16
    if big.any():
        b = np.frexp(c[big].astype(np.float64))[1].astype(np.int64)  # bit length (exact below 2**53)
        e = b - 4
        out[big] = 16 + (e - 1) * 8 + ((c[big] >> e) - 8)
    assert out.max(initial=0) <= 255, f"quantized count out of range: {out.max()}"
    return out.astype(np.uint8)


def dequant8(q: np.ndarray) -> np.ndarray:
    """Byte codes -> representative counts (float64, exact integers)."""
    q = np.asarray(q, dtype=np.int64)
    e = (q - 16) // 8 + 1
    m = (q - 16) % 8 + 8
    big = ((2 * m + 1) << np.maximum(e - 1, 0)).astype(np.float64)
    return np.where(q < 16, q.astype(np.float64), big)


class Reader:
    """Cursor over a side-info section: varints and raw bytes, bounds-checked."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def varint(self) -> int:
        v, shift = 0, 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise DeltaFormatError("entropy side info: truncated or overlong varint")
            b = self.data[self.pos]
            self.pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return v

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise DeltaFormatError("entropy side info: truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out


# ---- models ----

def gap_alphabet(n: int, k: int) -> tuple[int, bool]:
    """(L, escapes possible) for a group of n elements with 0 < k < n changes."""
    span = n - k + 1  # gaps lie in 0..n-k
    L = min(span, -(-4 * n // k), MAX_GAP_ALPHABET)
    return L, L < span


def gap_model(n: int, k: int, L: int, escape: bool):
    """Geometric(p = k/n) over 0..L-1 (+ escape with the tail mass (1-p)^L)."""
    p = k / n
    q = np.full(L + 1, 1.0 - p)
    q[0] = 1.0
    powers = np.multiply.accumulate(q)  # (1-p)^r, a sequential product: same bits everywhere
    probs = powers[:L] * p
    if escape:
        probs = np.append(probs, powers[L])
    return _Categorical(probs, perfect=False)


def value_model(freqs: np.ndarray):
    return _Categorical(freqs, perfect=False)


def group_sizes(order_key: np.ndarray | None, n: int, spec: DTypeSpec) -> np.ndarray:
    """Sizes of the contiguous groups in stream order (exponent groups, or one group)."""
    if order_key is None:
        return np.array([n] if n else [], dtype=np.int64)
    counts = np.bincount(order_key, minlength=1 << spec.exp_bits)
    return counts[counts > 0].astype(np.int64)


# ---- symbol streams ----

def gap_symbols_ref(gaps: list[int], L: int) -> list[int]:
    """Reference: each gap as (gap // L) escape symbols L, then gap % L."""
    out = []
    for g in gaps:
        out.extend([L] * (g // L))
        out.append(g % L)
    return out


def gap_symbols(gaps: np.ndarray, L: int) -> np.ndarray:
    """Vectorised `gap_symbols_ref`."""
    q, r = np.divmod(gaps.astype(np.int64), L)
    sym = np.full(int(q.sum()) + gaps.size, L, dtype=np.int32)
    sym[np.cumsum(q + 1) - 1] = r
    return sym


def symbols_to_gaps(sym: np.ndarray, L: int, k: int) -> np.ndarray:
    ends = np.flatnonzero(sym != L)
    if ends.size != k or (sym.size and ends[-1] != sym.size - 1):
        raise DeltaFormatError(f"gap symbols hold {ends.size} gaps, expected {k}")
    q = np.diff(ends, prepend=-1) - 1
    return q.astype(np.int64) * L + sym[ends]


def residuals(old: np.ndarray, new: np.ndarray, spec: DTypeSpec, residual: str) -> np.ndarray:
    return new ^ old if residual == "xor" else zigzag(ordered_key(new, spec) - ordered_key(old, spec))


def apply(old: np.ndarray, z: np.ndarray, spec: DTypeSpec, residual: str) -> np.ndarray:
    return old ^ z if residual == "xor" else ordered_key_inverse(ordered_key(old, spec) + unzigzag(z), spec)


def choose_values(s: np.ndarray, width: int) -> int:
    """The value alphabet V (0..MAX_VALUES) with the smallest estimated size: table bytes +
    ideal code length of the symbols + raw escapes. An encoder-side choice only."""
    k = s.size
    counts = np.bincount(np.minimum(s, MAX_VALUES), minlength=MAX_VALUES + 1).astype(np.float64)
    best_v, best = 0, 8.0 * width * k
    hi = int(min(s.max(initial=0) + 1, MAX_VALUES))
    for v in range(1, hi + 1):
        c = counts[:v]
        esc = k - c.sum()
        nz = c[c > 0]
        bits = float(-(nz * np.log2(nz / k)).sum()) + 8.0 * (v + 1)
        if esc:
            bits += esc * (8.0 * width - np.log2(esc / k))
        if bits < best:
            best_v, best = v, bits
    return best_v


def encode(old: np.ndarray, new: np.ndarray, spec: DTypeSpec, residual: str, sizes: np.ndarray,
           reference: bool = False) -> list[bytes]:
    """Sections [model, ans, values] of one tensor (old/new in stream order, `sizes` its groups)."""
    changed = new != old
    z_all = residuals(old, new, spec, residual)
    side: list[bytes] = []
    steps: list[tuple[np.ndarray, object]] = []  # (symbols, model) in decoding order
    escaped: list[np.ndarray] = []
    start = 0
    for n in sizes.tolist():
        mask = changed[start:start + n]
        pos = np.flatnonzero(mask)
        k = int(pos.size)
        side.append(varint_encode(np.array([k], dtype=np.uint64)))
        if k:
            if k < n:
                L, esc = gap_alphabet(n, k)
                gaps = np.diff(pos, prepend=-1) - 1
                sym = (np.array(gap_symbols_ref(gaps.tolist(), L), dtype=np.int32) if reference
                       else gap_symbols(gaps, L))
                if esc:
                    side.append(varint_encode(np.array([sym.size - k], dtype=np.uint64)))
                steps.append((sym, gap_model(n, k, L, esc)))
            z = z_all[start:start + n][pos]
            s = (z - z.dtype.type(1)).astype(np.uint64)
            s_small = np.minimum(s, np.uint64(MAX_VALUES + 1)).astype(np.int64)
            V = choose_values(s_small, spec.width)
            side.append(varint_encode(np.array([V], dtype=np.uint64)))
            if V:
                counts = np.bincount(np.minimum(s_small, V), minlength=V + 1)
                q = quant8(counts)
                side.append(q.tobytes())
                steps.append((np.minimum(s_small, V).astype(np.int32), value_model(dequant8(q))))
                escaped.append(z[s_small >= V])
            else:
                escaped.append(z)
        start += n
    coder = constriction.stream.stack.AnsCoder()
    for sym, model in reversed(steps):
        coder.encode_reverse(sym, model)
    words = coder.get_compressed().astype("<u4")
    esc = np.concatenate(escaped) if escaped else np.zeros(0, dtype=spec.uint)
    return [b"".join(side), words.tobytes(), to_planes(esc.astype(spec.uint))]


def decode(old: np.ndarray, spec: DTypeSpec, residual: str, sizes: np.ndarray, n_changed: int,
           raws: list[bytes]) -> np.ndarray:
    """Bits of the target in stream order from the base bits in stream order and [model, ans, values]."""
    side, payload, esc_raw = raws
    if len(payload) % 4:
        raise DeltaFormatError(f"ANS payload of {len(payload)} bytes is not whole 32-bit words")
    try:
        coder = constriction.stream.stack.AnsCoder(np.frombuffer(payload, dtype="<u4").astype(np.uint32))
    except Exception as e:  # constriction validates the words; report as a format error
        raise DeltaFormatError(f"corrupt ANS payload: {e}") from e
    rd = Reader(side)
    new = old.copy()
    pending: list[tuple[int, np.ndarray, np.ndarray, int]] = []  # (group start, positions, symbols, V)
    total, start = 0, 0
    try:
        for n in sizes.tolist():
            k = rd.varint()
            if k > n:
                raise DeltaFormatError(f"group of {n} elements claims {k} changes")
            if k:
                if k < n:
                    L, esc = gap_alphabet(n, k)
                    extra = rd.varint() if esc else 0
                    if extra > n:
                        raise DeltaFormatError(f"{extra} gap escapes in a group of {n}")
                    sym = coder.decode(gap_model(n, k, L, esc), k + extra)
                    pos = np.cumsum(symbols_to_gaps(sym, L, k) + 1) - 1
                    if pos[-1] >= n:
                        raise DeltaFormatError(f"change positions run past a group of {n}")
                else:
                    pos = np.arange(n)
                V = rd.varint()
                if V > MAX_VALUES:
                    raise DeltaFormatError(f"value alphabet {V} > {MAX_VALUES}")
                if V:
                    freqs = dequant8(np.frombuffer(rd.take(V + 1), dtype=np.uint8))
                    vs = coder.decode(value_model(freqs), k)
                else:
                    vs = np.zeros(k, dtype=np.int32)
                pending.append((start, pos, vs, V))
                total += k
            start += n
    except DeltaFormatError:
        raise
    except Exception as e:  # constriction refuses exhausted or inconsistent data
        raise DeltaFormatError(f"corrupt ANS payload: {e}") from e
    if rd.pos != len(side) or not coder.is_empty() or total != n_changed:
        raise DeltaFormatError(f"entropy sections inconsistent: {len(side) - rd.pos} side bytes left, "
                               f"ANS empty {coder.is_empty()}, {total} changes vs {n_changed}")
    n_esc = sum(int(np.count_nonzero(vs >= V)) if V else vs.size for _, _, vs, V in pending)
    esc = from_planes(esc_raw, spec.uint, n_esc)
    one, e_at = spec.uint.type(1), 0
    for start, pos, vs, V in pending:
        z = vs.astype(spec.uint) + one
        is_esc = vs >= V if V else np.ones(vs.size, dtype=bool)
        m = int(np.count_nonzero(is_esc))
        z[is_esc] = esc[e_at:e_at + m]
        e_at += m
        at = start + pos
        new[at] = apply(old[at], z, spec, residual)
    return new
