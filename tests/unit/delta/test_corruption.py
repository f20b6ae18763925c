"""Corrupting any byte of a delta is detected before (or while) it is applied."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.delta import DeltaFormatError, decode_delta, encode_delta
from kernels.delta.container import _PREFIX, parse_container

from .conftest import bit_equal, make_small_pair


def test_flipping_every_byte_of_a_small_delta_is_detected(small_pair):
    base, target = small_pair
    blob = encode_delta(base, target)
    assert bit_equal(decode_delta(base, blob), target)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0xFF
        with pytest.raises(DeltaFormatError):
            decode_delta(base, bytes(bad))


def test_payload_corruption_is_caught_by_content_hashes_even_without_the_file_hash(small_pair):
    base, target = small_pair
    blob = encode_delta(base, target)
    header_len = _PREFIX.unpack_from(blob, 0)[3]
    start, end = _PREFIX.size + header_len, len(blob) - 32
    assert end > start, "the fixture delta must have a payload"
    for i in range(start, end):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(DeltaFormatError):
            decode_delta(base, bytes(bad), verify_file_hash=False)


def test_truncation_and_extension_are_detected(small_pair):
    base, target = small_pair
    blob = encode_delta(base, target)
    for bad in (blob[:-1], blob[: len(blob) // 2], blob + b"\0", b"", blob[:10]):
        with pytest.raises(DeltaFormatError):
            parse_container(bad)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_corruptions_are_detected(data):
    base, target = make_small_pair()
    blob = bytearray(encode_delta(base, target))
    positions = data.draw(st.sets(st.integers(0, len(blob) - 1), min_size=1, max_size=4))
    for i in positions:  # distinct positions, so the flips cannot cancel out
        blob[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(DeltaFormatError):
        decode_delta(base, bytes(blob))
