"""The entropy-coded ("ans") layout of a per-tensor delta: change positions and residuals coded
with models whose contexts the decoder already has (the base tensor's exponent groups).

Why: in a sparse delta, each element's chance of changing is set mostly by its ULP size, i.e.
by the exponent of its base value (measured on the built-in policy at lr 1e-5: entropy of the
change mask 0.206 bits/element iid per tensor, 0.145 given the base exponent). Varint gaps +
zstd cannot use that context; an arithmetic-class coder with one model per exponent group can.
The coder is `constriction`'s ANS (a maintained Rust library); this module only builds models
and symbol streams.

How, per tensor (elements already in stream order: stable-sorted by base exponent for floats,
so each exponent group is contiguous; exponent groups under MIN_GROUP elements merge with the
next; integers are one group). For each group, in order:

- side info ("model" section, LEB128 varints and bytes): k = changed elements of the group;
  if 0 < k < n and escapes are possible (L < n - k + 1), E = number of gap escapes; if k > 0,
  2 T + flat, with T the token alphabet size, then (T > 1 and not flat) T quantized count
  bytes (`quant8`).
- gaps (positions): gap_i = zero-based distance from the previous change in the group (or
  the group start). Model: geometric with p = k / n, alphabet {0..L-1} plus (when
  L < n - k + 1) an escape symbol L meaning "add L, read another symbol"; exact for a
  geometric law, which is memoryless. L = min(n - k + 1, ceil(8 n / k), 4096). A group with
  k == n codes no gaps (all zero).
- values: s = z - 1 with z the residual (ulp: zigzag ordered-key difference; xor: new ^ old;
  z >= 1 for a changed element), as a token (`to_tokens`: s < 16 exactly, above one token per
  half-octave) coded with the group's categorical table (or a flat model over 0..T-1 when the
  encoder estimates that cheaper; nothing when T == 1), then each token's extra bits, coded
  uniformly in chunks of up to 16 bits, after all groups (chunk 0 of every value of the
  tensor that has extra bits, then chunk 1, ...).

One ANS stream per tensor (the "ans" section, little-endian uint32 words); decoding order is
group by group (gaps, tokens), then the extra-bit chunks. Probabilities are computed with exactly rounded
IEEE operations only (division, a sequential product), so every platform builds the same models.
"""

from __future__ import annotations

import constriction
import numpy as np

from kernels.delta.bits import (
    DeltaFormatError,
    DTypeSpec,
    ordered_key,
    ordered_key_inverse,
    unzigzag,
    zigzag,
)

MAX_GAP_ALPHABET = 4096  # cap on L: escapes (memoryless) cover longer gaps at ~no cost
MIN_GROUP = 64  # exponent groups smaller than this merge with their neighbours
EXACT_TOKENS = 16  # residuals (z - 1) below this are their own token; above, one per half-octave
N_TOKENS = EXACT_TOKENS + 2 * (64 - 4)  # up to 64-bit residuals: 136
CHUNK_BITS = 16  # extra bits are coded uniformly in chunks of at most this many bits
_Categorical = constriction.stream.model.Categorical
_Uniform = constriction.stream.model.Uniform


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
        b = np.frexp(c[big].astype(np.float64))[1].astype(
            np.int64
        )  # bit length (exact below 2**53)
        e = b - 4
        out[big] = 16 + (e - 1) * 8 + ((c[big] >> e) - 8)
    assert out.max(initial=0) <= 255, f"quantized count out of range: {out.max()}"
    return out.astype(np.uint8)


def _dequant8(q: np.ndarray) -> np.ndarray:
    """Byte codes -> representative counts (float64, exact integers)."""
    q = np.asarray(q, dtype=np.int64)
    e = (q - 16) // 8 + 1
    m = (q - 16) % 8 + 8
    big = ((2 * m + 1) << np.maximum(e - 1, 0)).astype(np.float64)
    return np.where(q < 16, q.astype(np.float64), big)


DEQUANT8 = _dequant8(np.arange(256))  # byte code -> representative count (float64, exact integers)


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
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


# ---- models ----


def gap_alphabet(n: int, k: int) -> tuple[int, bool]:
    """(L, escapes possible) for a group of n elements with 0 < k < n changes."""
    span = n - k + 1  # gaps lie in 0..n-k
    L = min(span, -(-8 * n // k), MAX_GAP_ALPHABET)
    return L, L < span


def gap_model(n: int, k: int, L: int, escape: bool):
    """Geometric(p = k/n) over 0..L-1 (+ escape with the tail mass (1-p)^L)."""
    p = k / n
    q = np.full(L + 1, 1.0 - p)
    q[0] = 1.0
    probs = np.multiply.accumulate(q)  # (1-p)^r: a sequential product, the same bits everywhere
    tail = probs[L]
    probs *= p
    if not escape:
        return _Categorical(probs[:L], perfect=False)
    probs[L] = tail
    return _Categorical(probs, perfect=False)


def value_model(freqs: np.ndarray):
    return _Categorical(freqs, perfect=False)


def group_sizes(order_key: np.ndarray | None, n: int, spec: DTypeSpec) -> np.ndarray:
    """Sizes of the contiguous groups in stream order: the exponent groups (one group for
    integers), where consecutive groups under MIN_GROUP elements merge until they reach it
    (a left-over tail joins the last group). Fewer tiny groups: less side info, fewer calls."""
    if order_key is None:
        return np.array([n] if n else [], dtype=np.int64)
    counts = np.bincount(order_key, minlength=1 << spec.exp_bits)
    counts = counts[counts > 0].astype(np.int64)
    if MIN_GROUP <= 1 or counts.size <= 1:
        return counts
    out, acc = [], 0
    for c in counts.tolist():
        acc += c
        if acc >= MIN_GROUP:
            out.append(acc)
            acc = 0
    if acc:
        if out:
            out[-1] += acc
        else:
            out.append(acc)
    return np.array(out, dtype=np.int64)


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
    return (
        new ^ old if residual == "xor" else zigzag(ordered_key(new, spec) - ordered_key(old, spec))
    )


def apply(old: np.ndarray, z: np.ndarray, spec: DTypeSpec, residual: str) -> np.ndarray:
    return (
        old ^ z
        if residual == "xor"
        else ordered_key_inverse(ordered_key(old, spec) + unzigzag(z), spec)
    )


def bit_length(x: np.ndarray) -> np.ndarray:
    """Exact bit length of each uint64 (0 for 0), by binary search on shifts."""
    x = x.astype(np.uint64)
    b = np.zeros(x.shape, dtype=np.int64)
    for sh in (32, 16, 8, 4, 2, 1):
        m = x >= np.uint64(1 << sh)
        b += m * sh
        x = np.where(m, x >> np.uint64(sh), x)
    return b + (x > 0)


def to_tokens(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values s >= 0 (uint64) -> (token, extra bit count, extra bits): s < 16 is its own token;
    above, a token per half-octave (bit length b and the bit below the leading one) and the
    b - 2 bits under those two, coded uniformly."""
    s = s.astype(np.uint64)
    b = bit_length(s)
    big = s >= np.uint64(EXACT_TOKENS)
    nbits = np.where(big, b - 2, 0)
    half = (s >> np.maximum(b - 2, 0).astype(np.uint64)) & np.uint64(1)
    t = np.where(big, EXACT_TOKENS + 2 * (b - 5) + half.astype(np.int64), s.astype(np.int64))
    extra = s & ((np.uint64(1) << nbits.astype(np.uint64)) - np.uint64(1))
    return t, nbits, extra


def token_bits(t: np.ndarray) -> np.ndarray:
    """Extra bit count of each token (inverse side of `to_tokens`)."""
    t = t.astype(np.int64)
    return np.where(t >= EXACT_TOKENS, ((t - EXACT_TOKENS) >> 1) + 3, 0)


def from_tokens(t: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """Inverse of `to_tokens` (uint64)."""
    s = t.astype(np.uint64)
    big = np.flatnonzero(t >= EXACT_TOKENS)
    tb = t[big].astype(np.int64) - EXACT_TOKENS
    b = (tb // 2 + 5).astype(np.uint64)
    half = (tb % 2).astype(np.uint64)
    s[big] = (np.uint64(1) << b - np.uint64(1)) | (half << b - np.uint64(2)) | extra[big]
    return s


def choose_tokens(t: np.ndarray) -> tuple[int, bool]:
    """(T, flat): the token alphabet 0..T-1 (T = largest token + 1) and whether a flat model
    (no table) beats a table of T quantized counts. An encoder-side estimate only."""
    k = t.size
    T = int(t.max()) + 1
    if T == 1:
        return 1, True
    c = np.bincount(t, minlength=T)
    nz = c[c > 0].astype(np.float64)
    table = 8.0 * (T + 1) + float((nz * np.log2(k / nz)).sum())
    return T, bool(k * np.log2(T) <= table)


def _chunks(nbits: np.ndarray) -> int:
    return int(-(-int(nbits.max(initial=0)) // CHUNK_BITS))


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def encode(
    old: np.ndarray,
    new: np.ndarray,
    spec: DTypeSpec,
    residual: str,
    sizes: np.ndarray,
    reference: bool = False,
    z_all: np.ndarray | None = None,
) -> list[bytes]:
    """Sections [model, ans] of one tensor (old/new in stream order, `sizes` its groups;
    `z_all`: the residuals of every element when the caller has them already)."""
    changed = new != old
    if z_all is None:
        z_all = residuals(old, new, spec, residual)
    positions = np.flatnonzero(changed)
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    cuts = np.searchsorted(positions, bounds)  # changes of group g: positions[cuts[g]:cuts[g+1]]
    z_changed = z_all[positions]
    tok, nbits, extra = to_tokens(z_changed - z_changed.dtype.type(1))
    side: list[bytes] = []
    steps: list[tuple] = []  # (symbols, model[, params]) in decoding order
    for g, n in enumerate(sizes.tolist()):
        a, b = int(cuts[g]), int(cuts[g + 1])
        k = b - a
        side.append(_varint(k))
        if not k:
            continue
        if k < n:
            pos = positions[a:b] - bounds[g]
            L, esc = gap_alphabet(n, k)
            gaps = np.diff(pos, prepend=-1) - 1
            sym = (
                np.array(gap_symbols_ref(gaps.tolist(), L), dtype=np.int32)
                if reference
                else gap_symbols(gaps, L)
            )
            if esc:
                side.append(_varint(sym.size - k))
            steps.append((sym, gap_model(n, k, L, esc)))
        t = tok[a:b]
        T, flat = choose_tokens(t)
        side.append(_varint(2 * T + flat))
        if T > 1:
            if flat:
                model = _Categorical(np.ones(T), perfect=False)
            else:
                q = quant8(np.bincount(t, minlength=T))
                side.append(q.tobytes())
                model = value_model(DEQUANT8[q])
            steps.append((t.astype(np.int32), model))
    big = np.flatnonzero(nbits)  # the tensor's values with extra bits, after all groups
    nb, ex = nbits[big], extra[big]
    for j in range(_chunks(nb)):
        has = nb > CHUNK_BITS * j
        width = np.minimum(nb[has] - CHUNK_BITS * j, CHUNK_BITS)
        sym = (ex[has] >> np.uint64(CHUNK_BITS * j)) & (
            (np.uint64(1) << width.astype(np.uint64)) - np.uint64(1)
        )
        steps.append((sym.astype(np.int32), _Uniform(), np.int32(1) << width.astype(np.int32)))
    coder = constriction.stream.stack.AnsCoder()
    for step in reversed(steps):
        coder.encode_reverse(*step)
    return [b"".join(side), coder.get_compressed().astype("<u4").tobytes()]


def decode(
    spec: DTypeSpec, sizes: np.ndarray, n_changed: int, raws: list[bytes]
) -> tuple[np.ndarray, np.ndarray]:
    """(positions in stream order (int64), their residuals z (spec.uint)) from [model, ans];
    the caller applies them to the base (`apply`)."""
    side, payload = raws
    if len(payload) % 4:
        raise DeltaFormatError(f"ANS payload of {len(payload)} bytes is not whole 32-bit words")
    rd = Reader(side)
    gap_parts: list[np.ndarray] = []  # per group with changes: its gaps
    starts: list[int] = []  # ... its first element in stream order
    ns: list[int] = []  # ... and its size
    tok_parts: list[np.ndarray] = []  # value tokens
    k_of_group: list[int] = []
    start = 0
    try:
        coder = constriction.stream.stack.AnsCoder(
            np.frombuffer(payload, dtype="<u4").astype(np.uint32)
        )
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
                    gap_parts.append(symbols_to_gaps(sym, L, k) if extra else sym)
                else:
                    gap_parts.append(np.zeros(n, dtype=np.int32))
                starts.append(start)
                ns.append(n)
                v = rd.varint()
                T, flat = v >> 1, v & 1
                if not 1 <= T <= N_TOKENS or (T == 1 and not flat):
                    raise DeltaFormatError(
                        f"token alphabet {T} (flat {flat}) outside 1..{N_TOKENS}"
                    )
                if T == 1:
                    t = np.zeros(k, dtype=np.int32)
                else:
                    model = (
                        _Categorical(np.ones(T), perfect=False)
                        if flat
                        else value_model(DEQUANT8[np.frombuffer(rd.take(T), dtype=np.uint8)])
                    )
                    t = coder.decode(model, k)
                tok_parts.append(t)
                k_of_group.append(k)
            start += n
        t = np.concatenate(tok_parts) if tok_parts else np.zeros(0, dtype=np.int32)
        big = np.flatnonzero(t >= EXACT_TOKENS)  # values with extra bits, decoded after all groups
        nb = token_bits(t[big])
        ex = np.zeros(big.size, dtype=np.uint64)
        for j in range(_chunks(nb)):
            has = nb > CHUNK_BITS * j
            width = np.minimum(nb[has] - CHUNK_BITS * j, CHUNK_BITS)
            chunk = coder.decode(_Uniform(), np.int32(1) << width.astype(np.int32))
            ex[has] |= chunk.astype(np.uint64) << np.uint64(CHUNK_BITS * j)
        empty = coder.is_empty()
    except DeltaFormatError:
        raise
    except Exception as e:  # constriction refuses exhausted or inconsistent data
        raise DeltaFormatError(f"corrupt ANS payload: {e}") from e
    total = sum(k_of_group)
    if rd.pos != len(side) or not empty or total != n_changed:
        raise DeltaFormatError(
            f"entropy sections inconsistent: {len(side) - rd.pos} side bytes left, "
            f"ANS empty {empty}, {total} changes vs {n_changed}"
        )
    if not total:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=spec.uint)
    # positions: a cumulative sum over all groups' gaps, restarted at each group's start
    k_arr = np.array(k_of_group, dtype=np.int64)
    steps_ = np.concatenate(gap_parts).astype(np.int64) + 1
    run = np.cumsum(steps_)
    first = np.cumsum(k_arr) - k_arr  # index of each group's first change
    before = run[first] - steps_[first]  # the running sum before each group
    local = run - 1 - np.repeat(before, k_arr)
    last = np.cumsum(k_arr) - 1
    if np.any(local[last] >= np.array(ns, dtype=np.int64)):
        raise DeltaFormatError("change positions run past their exponent group")
    pos = local + np.repeat(np.array(starts, dtype=np.int64), k_arr)
    s = t.astype(np.uint64)
    s[big] = from_tokens(t[big], ex)
    z = (s + np.uint64(1)).astype(spec.uint)  # wraps to 0 only for a corrupt s = 2**64 - 1
    return pos, z
