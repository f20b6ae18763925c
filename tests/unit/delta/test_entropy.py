"""The entropy-coded ("ans") layout: exact round trips at its edge cases, the reference and
vectorised symbol streams agree, it wins on checkpoint-like deltas, corruption is caught, and
format version 1 files stay readable while unknown versions are refused."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.delta import DeltaFormatError, decode_delta, encode_delta, entropy, inspect_delta
from kernels.delta.bits import SPEC_BY_NAME, bits_to_tensor
from kernels.delta.container import _PREFIX, COLUMNS, MAGIC, make_compressor, parse_container

from .conftest import bit_equal, perturb

BF16 = SPEC_BY_NAME["bfloat16"]


def ans_roundtrip(
    old: np.ndarray, new: np.ndarray, spec, sizes: list[int], residual: str = "ulp"
) -> list[bytes]:
    sizes_a = np.array(sizes, dtype=np.int64)
    raws = entropy.encode(old, new, spec, residual, sizes_a)
    assert raws == entropy.encode(old, new, spec, residual, sizes_a, reference=True), (
        "reference and vectorised gap symbols differ"
    )
    positions, r = entropy.decode(spec, sizes_a, int(np.count_nonzero(old != new)), raws)
    out = old.copy()
    out[positions] = entropy.apply(old[positions], r, spec, residual)
    assert np.array_equal(out, new), "ans round trip is not exact"
    return raws


def test_groups_with_no_all_one_and_single_element_changes_roundtrip():
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, 1 + 50 + 40 + 1 + 30, dtype=np.uint64).astype(np.uint16)
    new = old.copy()
    new[1:51] += np.uint16(1)  # group 2: all 50 change
    new[91] ^= np.uint16(0x40)  # group 4: its single element changes
    new[95:100] -= np.uint16(3)  # group 5: a few change; groups 1 and 3 stay unchanged
    ans_roundtrip(old, new, BF16, [1, 50, 40, 1, 30])
    ans_roundtrip(old, new, BF16, [1, 50, 40, 1, 30], residual="xor")


def test_huge_gaps_use_escapes_and_roundtrip():
    n = 3_000_000
    old = np.full(n, 0x3C00, dtype=np.uint16)
    new = old.copy()
    new[[5, n - 1]] += np.uint16(1)  # two changes, gaps far beyond the 4096-symbol alphabet
    side, payload = ans_roundtrip(old, new, BF16, [n])
    L, esc = entropy.gap_alphabet(n, 2)
    assert esc and L == entropy.MAX_GAP_ALPHABET, f"expected escapes, L={L}"
    assert len(payload) < 64, f"two changes in 3M elements took {len(payload)} ANS bytes"


def test_large_residuals_and_nan_payloads_roundtrip_through_tokens_and_extra_bits():
    rng = np.random.default_rng(1)
    old = rng.integers(0, 1 << 16, 2000, dtype=np.uint64).astype(np.uint16)
    new = old.copy()
    new[:1000] += np.uint16(1)
    new[1000:1010] = np.array(
        [0x7FC1, 0xFFFF, 0x7F81, 0x8000, 0, 0x7F80, 0xFF80, 1, 0x8001, 0x7F7F], dtype=np.uint16
    )
    new[1500] = old[1500] + np.uint16(20000)
    ans_roundtrip(old, new, BF16, [2000])
    z = entropy.residuals(old, new, BF16, "ulp")[old != new]
    t, nbits, _ = entropy.to_tokens(z - np.uint16(1))
    assert t.max() >= entropy.EXACT_TOKENS and nbits.max() > entropy.CHUNK_BITS // 2, (
        "needs large residuals"
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 2), max_size=40))
def test_tokens_and_extra_bits_invert_for_any_64_bit_value(values):
    s = np.array(values, dtype=np.uint64)
    t, nbits, extra = entropy.to_tokens(s)
    assert t.max(initial=0) < entropy.N_TOKENS
    assert np.array_equal(entropy.token_bits(t), nbits)
    assert np.array_equal(entropy.from_tokens(t, extra), s)
    assert np.all(extra < (np.uint64(1) << nbits.astype(np.uint64)))


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(sorted(SPEC_BY_NAME)),
    sizes=st.lists(st.integers(1, 400), min_size=1, max_size=6),
    frac=st.sampled_from([0.0, 0.002, 0.05, 0.5, 1.0]),
    big=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_groups_roundtrip_for_every_dtype(dtype, sizes, frac, big, seed):
    spec = SPEC_BY_NAME[dtype]
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    old = rng.integers(0, 2**63, n, dtype=np.uint64).astype(spec.uint)
    if dtype == "bool":
        old &= np.uint8(1)
    t = perturb(rng, bits_to_tensor(old, spec, (n,)), frac, max_ulps=1000 if big else 2)
    new = (
        t.reshape(-1)
        .view(
            torch.uint8
            if dtype in ("bool", "uint8")
            else {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[spec.width]
        )
        .numpy()
        .view(spec.uint)
    )
    ans_roundtrip(old, new.copy(), spec, sizes)


def checkpoint_like(seed: int = 0, frac: float = 0.03) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    base = {
        "w": (torch.randn(64, 256, generator=g) * 0.02).to(torch.bfloat16),
        "b": (torch.randn(256, generator=g) * 0.02).to(torch.float32),
    }
    upd = {
        k: v.float()
        + 1e-4
        * torch.randn(v.shape, generator=g).sign()
        * (torch.rand(v.shape, generator=g) < frac * 4)
        for k, v in base.items()
    }
    return base, {k: upd[k].to(v.dtype) for k, v in base.items()}


def test_checkpoint_like_delta_picks_ans_and_both_codecs_write_the_same_bytes():
    base, target = checkpoint_like()
    fast = encode_delta(base, target, impl="fast")
    ref = encode_delta(base, target, impl="reference")
    assert fast == ref, "fast and reference codecs wrote different bytes"
    kinds = {t.name: t.kind for t in inspect_delta(fast).tensors}
    assert kinds["w"] == "ans", (
        f"expected the entropy-coded layout on a sparse bf16 update, got {kinds}"
    )
    assert bit_equal(decode_delta(base, fast, impl="fast"), target)
    assert bit_equal(decode_delta(base, fast, impl="reference"), target)


def test_flipping_any_bit_of_the_ans_stream_is_detected():
    """Every bit of the (raw) ANS stream matters: a flip is refused by the ANS decoder's checks or
    by the content hashes, even without the file hash. (A flip inside a zstd frame can leave the
    decompressed bytes unchanged, which is harmless; the file hash still refuses such a file.)"""
    base, target = checkpoint_like(1)
    blob = encode_delta(base, target)
    header = inspect_delta(blob)
    assert any(t.kind == "ans" for t in header.tensors)
    start = (
        _PREFIX.size + _PREFIX.unpack_from(blob, 0)[3] + sum(s.length for s in header.streams[:-1])
    )
    assert header.streams[-1].codec == "raw" and start + header.streams[-1].length == len(blob) - 32
    for i in range(start, len(blob) - 32, 3):
        for bit in (0, 7):
            bad = bytearray(blob)
            bad[i] ^= 1 << bit
            with pytest.raises(DeltaFormatError):
                decode_delta(base, bytes(bad), verify_file_hash=False)


def rewrite_version(blob: bytes, version: int, drop_streams: int = 0) -> bytes:
    """The same delta with another container version (streams dropped from the header's end)."""
    head_len = _PREFIX.unpack_from(blob, 0)[3]
    doc = json.loads(
        zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS).decompress(
            blob[_PREFIX.size : _PREFIX.size + head_len], max_output_size=1 << 24
        )
    )
    assert doc["columns"] == COLUMNS
    doc["format_version"] = version
    if drop_streams:
        assert all(s[1] == 0 for s in doc["streams"][-drop_streams:]), (
            "dropped streams must be empty"
        )
        doc["streams"] = doc["streams"][:-drop_streams]
    head = make_compressor(19).compress(json.dumps(doc, separators=(",", ":")).encode())
    body = _PREFIX.pack(MAGIC, version, 0, len(head)) + head + blob[_PREFIX.size + head_len : -32]
    return body + hashlib.sha256(body).digest()


def test_version_1_deltas_are_still_read_and_unknown_versions_refused(small_pair):
    base, _ = (
        small_pair  # a delta without changed tensors (same, full, removed) is also a valid version 1 file
    )
    target = {
        "w": base["w"],
        "steps": base["steps"].to(torch.int32),
        "new": torch.arange(3, dtype=torch.float16),
    }
    blob = encode_delta(base, target)
    assert struct.unpack_from("<H", blob, 8)[0] == 2
    assert all(t.kind != "ans" for t in inspect_delta(blob).tensors), "fixture must not use ans"
    v1 = rewrite_version(blob, 1, drop_streams=2)
    assert bit_equal(decode_delta(base, v1), target)
    with pytest.raises(DeltaFormatError, match="unsupported delta format version 3"):
        parse_container(rewrite_version(blob, 3))
    ans_blob = encode_delta(*checkpoint_like(2))
    with pytest.raises(DeltaFormatError, match="version 1"):  # an ans delta relabelled as version 1
        parse_container(rewrite_version(ans_blob, 1))
