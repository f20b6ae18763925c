"""The delta codec round-trips bit-exactly, and the fast codec writes the reference's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.delta import (
    DeltaFormatError,
    checkpoint_sha256,
    decode_delta,
    encode_delta,
    inspect_delta,
)
from kernels.delta.bits import (
    SPEC_BY_NAME,
    ordered_key,
    ordered_key_formula,
    ordered_key_inverse,
    ordered_key_inverse_formula,
    varint_decode,
    varint_decode_ref,
    varint_encode,
    varint_encode_ref,
)

from .conftest import SPECIAL_BF16, bit_equal, perturb, random_bits

DTYPES = list(SPEC_BY_NAME)


def roundtrip(base, target, impl="fast"):
    blob = encode_delta(base, target, impl=impl)
    out = decode_delta(base, blob, impl=impl)
    assert bit_equal(out, target), f"{impl} round trip is not bit-exact"
    return blob


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 300),
    frac=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_tensors_roundtrip_bit_exact_and_impls_agree(dtype, n, frac, seed):
    rng = np.random.default_rng(seed)
    base = {"a": random_bits(rng, dtype, (n,)), "b": random_bits(rng, dtype, (3, 4))}
    target = {k: perturb(rng, v, frac) for k, v in base.items()}
    blob_fast = roundtrip(base, target, "fast")
    blob_ref = roundtrip(base, target, "reference")
    assert blob_fast == blob_ref, "fast and reference codecs wrote different bytes"
    assert bit_equal(decode_delta(base, blob_ref, impl="fast"), target)
    assert bit_equal(decode_delta(base, blob_fast, impl="reference"), target)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_special_float_values_survive_any_change_between_them(dtype):
    spec = SPEC_BY_NAME[dtype]
    w = 8 * spec.width
    sign, exp_all = 1 << (w - 1), ((1 << spec.exp_bits) - 1) << spec.exp_shift
    specials = np.array(
        [
            0,
            sign,
            exp_all,
            sign | exp_all,
            exp_all | 1,
            exp_all | (1 << (spec.exp_shift - 1)),
            (1 << w) - 1,
            1,
            sign | 1,
            (1 << spec.exp_shift) - 1,
            exp_all - 1,
            sign | (exp_all - 1),
            1 << spec.exp_shift,
        ],
        dtype=np.uint64,
    ).astype(spec.uint)
    # every ordered pair of special values: old -> new
    old = np.repeat(specials, specials.size)
    new = np.tile(specials, specials.size)
    from kernels.delta.bits import bits_to_tensor

    base = {"x": bits_to_tensor(old, spec, (old.size,))}
    target = {"x": bits_to_tensor(new, spec, (new.size,))}
    assert roundtrip(base, target, "reference") == roundtrip(base, target, "fast")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_key_tables_equal_the_formula_on_every_pattern(dtype):
    spec = SPEC_BY_NAME[dtype]
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(ordered_key(bits, spec), ordered_key_formula(bits, spec))
    assert np.array_equal(ordered_key_inverse(bits, spec), ordered_key_inverse_formula(bits, spec))


def test_ordered_key_is_monotonic_and_bijective_on_all_bf16_patterns():
    spec = SPEC_BY_NAME["bfloat16"]
    bits = np.arange(1 << 16, dtype=np.uint64).astype(np.uint16)
    keys = ordered_key(bits, spec)
    assert np.unique(keys).size == 1 << 16
    assert np.array_equal(ordered_key_inverse(keys, spec), bits)
    vals = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    finite = np.isfinite(vals) | np.isinf(vals)
    order = np.argsort(keys[finite])
    assert np.all(np.diff(vals[finite][order]) >= 0), "ordered keys must sort floats numerically"


def test_sparse_and_dense_changes_pick_matching_layouts():
    g = torch.Generator().manual_seed(1)
    base = {"w": (torch.randn(4096, generator=g) * 0.02).to(torch.bfloat16)}
    rng = np.random.default_rng(0)
    sparse = {"w": perturb(rng, base["w"], 0.002, 1)}
    dense = {"w": perturb(rng, base["w"], 0.95, 1)}
    assert inspect_delta(roundtrip(base, sparse)).tensors[0].kind in ("gaps", "ans")
    assert inspect_delta(roundtrip(base, dense)).tensors[0].kind in ("bitmap", "dense", "ans")
    assert len(roundtrip(base, sparse)) < 4096 * 2 / 20, "a 0.2% change must compress well"


def test_empty_and_scalar_tensors_roundtrip():
    base = {
        "e": torch.zeros(0, 3, dtype=torch.bfloat16),
        "s": torch.tensor(1.5, dtype=torch.bfloat16),
    }
    target = {
        "e": torch.zeros(0, 3, dtype=torch.bfloat16),
        "s": torch.tensor(-1.5, dtype=torch.bfloat16),
    }
    roundtrip(base, target)
    assert inspect_delta(roundtrip(base, base)).tensors[0].op == "same"


def test_new_removed_and_reshaped_tensors_are_handled(small_pair):
    base, target = small_pair
    target = dict(target, steps=torch.arange(4, dtype=torch.int32))  # dtype and shape change
    header = inspect_delta(roundtrip(base, target, "reference"))
    ops = {t.name: t.op for t in header.tensors}
    assert ops == {"new": "full", "steps": "full", "w": "delta"} and header.removed == ["old"]


def test_delta_refuses_the_wrong_base(small_pair):
    base, target = small_pair
    blob = encode_delta(base, target)
    wrong = dict(base, w=perturb(np.random.default_rng(1), base["w"], 0.5))
    with pytest.raises(DeltaFormatError, match="base checkpoint"):
        decode_delta(wrong, blob)


def test_unsupported_dtype_is_refused_clearly():
    with pytest.raises(DeltaFormatError, match="unsupported dtype"):
        encode_delta(
            {"c": torch.zeros(2, dtype=torch.complex64)},
            {"c": torch.ones(2, dtype=torch.complex64)},
        )


def test_checkpoint_hash_covers_names_dtypes_shapes_and_bytes():
    a = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    variants = [
        {"v": a["w"]},
        {"w": torch.zeros(4, dtype=torch.float16)},
        {"w": torch.zeros(2, 2, dtype=torch.bfloat16)},
        {"w": torch.tensor([0, 0, 0, -0.0], dtype=torch.bfloat16)},
    ]
    hashes = {checkpoint_sha256(a)} | {checkpoint_sha256(v) for v in variants}
    assert len(hashes) == 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), max_size=50))
def test_vectorised_varints_match_reference(values):
    arr = np.array(values, dtype=np.uint64)
    enc = varint_encode_ref(arr)
    assert varint_encode(arr) == enc
    assert np.array_equal(varint_decode(enc, len(values)), arr)
    assert np.array_equal(varint_decode_ref(enc, len(values)), arr)


def test_special_bf16_fixture_really_holds_specials(small_pair):
    base, _ = small_pair
    bits = base["w"].view(torch.int16).numpy().view(np.uint16).reshape(-1)[: len(SPECIAL_BF16)]
    assert list(bits) == SPECIAL_BF16
