"""Lossless, verified deltas between two state dicts: `encode_delta` / `decode_delta`.

    blob = encode_delta(base_sd, target_sd)            # bytes of a .fwd container
    sd = decode_delta(base_sd, blob)                   # == target_sd bit for bit, or raises

A delta records, per target tensor, one of: unchanged ("same"), a per-tensor delta against the
base ("delta", see reference.py for the encoding), or the whole tensor ("full": a new name, or
a dtype/shape change); base names absent from the target are listed as removed. Decoding
verifies the base checkpoint SHA-256 first (a delta applied to the wrong base is refused),
then every decoded tensor's SHA-256 and finally the target checkpoint SHA-256.

`impl="reference"` runs the plain reference codec serially; `impl="fast"` (default) runs the
fast codec on a thread pool. Both write identical bytes (tests/unit/delta checks parity).
Decoded tensors of "same" entries are the base's own tensor objects (never mutated here).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeVar

import torch
from prometheus_client import Counter, Histogram

import kernels.delta.fast as fast
import kernels.delta.reference as reference
from kernels.delta.bits import SPEC_BY_NAME, DeltaFormatError, bits_to_tensor, spec_of, tensor_bits
from kernels.delta.container import (
    STREAMS,
    DeltaHeader,
    TensorEntry,
    build_container,
    load_stream,
    make_compressor,
    parse_container,
    section_streams,
    store_section,
)
from kernels.delta.hashing import (
    checkpoint_sha256_from_digests,
    hash_state_dict,
    tensor_digest_bits,
)

log = logging.getLogger(__name__)

DEFAULT_LEVEL = (
    9  # zstd level; deterministic single-threaded frames (see bench/delta.py for the trade-off)
)
Impl = Literal["reference", "fast"]
StateDict = Mapping[str, torch.Tensor]
T = TypeVar("T")
R = TypeVar("R")

DELTA_SECONDS = Histogram(
    "flywheel_delta_codec_seconds", "Delta encode/decode wall time", ["op", "impl"]
)
DELTA_BYTES = Counter(
    "flywheel_delta_codec_bytes_total", "Delta container bytes written/read", ["op"]
)


def _threads(impl: Impl, threads: int | None) -> int:
    if impl == "reference":
        return 1
    return threads or min(8, os.cpu_count() or 1)


def _pmap(fn: Callable[[T], R], items: Iterable[T], threads: int) -> list[R]:
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def _module(impl: Impl):
    if impl not in ("reference", "fast"):
        raise ValueError(f"impl must be 'reference' or 'fast', got {impl!r}")
    return reference if impl == "reference" else fast


def encode_delta(
    base: StateDict,
    target: StateDict,
    *,
    level: int = DEFAULT_LEVEL,
    impl: Impl = "fast",
    threads: int | None = None,
) -> bytes:
    """Encode `target` as a delta against `base` (dict[str, Tensor] on CPU). Returns .fwd bytes."""
    t0 = time.perf_counter()
    codec, n_threads = _module(impl), _threads(impl, threads)
    for sd in (base, target):
        for name, t in sd.items():
            spec_of(t)  # refuses unsupported dtypes with a clear message
            if not isinstance(name, str) or not name:
                raise DeltaFormatError(f"state dict keys must be non-empty strings, got {name!r}")
    base_digests, base_sha = hash_state_dict(base, n_threads)
    target_digests, target_sha = hash_state_dict(target, n_threads)
    names = sorted(target, key=lambda n: n.encode())

    def encode_one(name: str) -> tuple[dict, list[bytes]]:
        new_t = target[name]
        spec = spec_of(new_t)
        fields = {"name": name, "dtype": spec.name, "shape": list(new_t.shape)}
        old_t = base.get(name)
        compressor = make_compressor(level)  # single-threaded mode, for the size trials
        if old_t is not None and old_t.dtype == new_t.dtype and old_t.shape == new_t.shape:
            if base_digests[name] == target_digests[name]:
                return dict(fields, op="same"), []
            enc, raws = codec.encode_tensor(
                tensor_bits(old_t), tensor_bits(new_t), spec, compressor
            )
            return dict(fields, op="delta", **enc), raws
        return dict(fields, op="full"), codec.encode_full(tensor_bits(new_t))

    entries, pooled = [], {name: [] for name in STREAMS}
    for fields, raws in _pmap(encode_one, names, n_threads):
        streams = section_streams(fields["op"], fields.get("kind"))
        entry = TensorEntry(
            sections=[{"stream": st, "raw_length": len(r)} for st, r in zip(streams, raws)],
            **fields,
        )
        for sec, raw in zip(entry.sections, raws):
            pooled[sec.stream].append(raw)
        entries.append(entry)
    # zstd's multi-threaded mode: identical bytes for any worker count >= 1
    stream_compressor = make_compressor(level, threads=n_threads)
    stored = _pmap(lambda n: store_section(b"".join(pooled[n]), stream_compressor), STREAMS, 1)
    removed = sorted((n for n in base if n not in target), key=lambda n: n.encode())
    header = DeltaHeader(
        base_checkpoint_sha256=base_sha,
        target_checkpoint_sha256=target_sha,
        zstd_level=level,
        tensors=entries,
        removed=removed,
        streams=[
            {"codec": s.codec, "length": len(s.data), "raw_length": s.raw_length} for s in stored
        ],
    )
    blob = build_container(header, [s.data for s in stored])
    DELTA_SECONDS.labels("encode", impl).observe(time.perf_counter() - t0)
    DELTA_BYTES.labels("encode").inc(len(blob))
    return blob


def inspect_delta(blob: bytes) -> DeltaHeader:
    """Validate the container (format, file hash, header schema) and return its header."""
    return parse_container(blob)[0]


def decode_delta(
    base: StateDict,
    blob: bytes,
    *,
    impl: Impl = "fast",
    threads: int | None = None,
    base_checkpoint_sha256: str | None = None,
    verify_file_hash: bool = True,
) -> dict[str, torch.Tensor]:
    """Apply a .fwd delta to `base` and return the verified target state dict.

    `base_checkpoint_sha256`: pass the base's hash when the caller has already verified it
    (e.g. it is the output of the previous delta in a chain) to skip re-hashing the base.
    Raises DeltaFormatError on any format, hash or consistency failure.
    """
    return decode_delta_verified(
        base,
        blob,
        impl=impl,
        threads=threads,
        base_checkpoint_sha256=base_checkpoint_sha256,
        verify_file_hash=verify_file_hash,
    )[0]


def decode_delta_verified(
    base: StateDict,
    blob: bytes,
    *,
    impl: Impl = "fast",
    threads: int | None = None,
    base_checkpoint_sha256: str | None = None,
    verify_file_hash: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """`decode_delta` that also returns the per-tensor SHA-256s and checkpoint SHA-256 it verified."""
    t0 = time.perf_counter()
    codec, n_threads = _module(impl), _threads(impl, threads)
    header, stored = parse_container(blob, verify_file_hash=verify_file_hash)
    streams = dict(
        zip(
            STREAMS,
            _pmap(
                lambda i: load_stream(header.streams[i], stored[i]), range(len(STREAMS)), n_threads
            ),
        )
    )
    sections: list[list[bytes]] = []
    cursor = dict.fromkeys(STREAMS, 0)
    for entry in header.tensors:
        raws = []
        for sec in entry.sections:
            start = cursor[sec.stream]
            raws.append(streams[sec.stream][start : start + sec.raw_length])
            cursor[sec.stream] = start + sec.raw_length
        sections.append(raws)
    if base_checkpoint_sha256 is None:
        base_checkpoint_sha256 = hash_state_dict(base, n_threads)[1]
    if base_checkpoint_sha256 != header.base_checkpoint_sha256:
        raise DeltaFormatError(
            f"delta expects base checkpoint {header.base_checkpoint_sha256[:12]}…, "
            f"the held weights are {base_checkpoint_sha256[:12]}…"
        )

    def decode_one(i: int) -> tuple[torch.Tensor, str]:
        entry = header.tensors[i]
        spec = SPEC_BY_NAME[entry.dtype]
        shape = tuple(entry.shape)
        if entry.op == "full":
            bits, tensor = codec.decode_full(entry, spec, sections[i]), None
        else:
            old_t = base.get(entry.name)
            if old_t is None or old_t.dtype != spec.torch_dtype or tuple(old_t.shape) != shape:
                raise DeltaFormatError(
                    f"{entry.name}: base tensor missing or of another dtype/shape"
                )
            old = tensor_bits(old_t)
            if entry.op == "same":
                bits, tensor = old, old_t
            else:
                bits, tensor = codec.decode_tensor(entry, old, spec, sections[i]), None
        digest = tensor_digest_bits(bits, spec.name, shape)
        # decoded bits are a fresh array: the tensor takes it over without a copy
        return (
            tensor if tensor is not None else bits_to_tensor(bits, spec, shape, copy=False)
        ), digest

    def guarded(i: int) -> tuple[torch.Tensor, str]:
        try:
            return decode_one(i)
        except DeltaFormatError:
            raise
        except (
            ValueError,
            IndexError,
            OverflowError,
            AssertionError,
        ) as e:  # malformed data in numpy
            raise DeltaFormatError(f"{header.tensors[i].name}: malformed section data: {e}") from e

    results = _pmap(guarded, range(len(header.tensors)), n_threads)
    out = {e.name: t for e, (t, _) in zip(header.tensors, results)}
    digests = {e.name: d for e, (_, d) in zip(header.tensors, results)}
    sha = checkpoint_sha256_from_digests(digests)
    if sha != header.target_checkpoint_sha256:
        raise DeltaFormatError(
            "decoded checkpoint SHA-256 does not match the delta's target: "
            "the delta is corrupt or was made against other weights"
        )
    DELTA_SECONDS.labels("decode", impl).observe(time.perf_counter() - t0)
    DELTA_BYTES.labels("decode").inc(len(blob))
    return out, digests, sha
