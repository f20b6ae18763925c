"""The `.fwd` delta container: a self-describing file a reader validates before applying.

Layout (all integers little-endian):

    offset 0   8 bytes   magic  b"FWDELTA\\x00"
    offset 8   u16       format version (2; version 1 files, written before the entropy-coded
                         "ans" layout and its two streams existed, are still read)
    offset 10  u16       flags (0; a reader refuses unknown flags)
    offset 12  u32       H = length of the compressed header
    offset 16  H bytes   header: a magicless zstd frame of compact JSON (`DeltaHeader`): base and
                         target checkpoint SHA-256, zstd level, one row per target tensor
                         (name, dtype, shape, op, encoding, sections as [codec, length,
                         raw_length]) under the column names in "columns", removed names
    ...        P bytes   payload: the sections, contiguous, in header order (offsets implied)
    last 32    bytes     SHA-256 of every byte before it

`parse_container` checks, before anything is decoded: the size, magic, version and flags, the
trailing file hash, the JSON against a strict schema (unknown fields rejected), that names are
unique, dtypes supported, section counts match each tensor's encoding and the sections tile
the payload exactly. After decoding, the codec hashes every tensor and checks the target
checkpoint SHA-256 (per-tensor SHA-256s live in the version's manifest.json, not in the
delta, where 32 bytes per tensor would be a large share of a sparse delta). So any corrupted byte raises `DeltaFormatError` (tests flip every byte).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Literal, NamedTuple

import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kernels.delta.bits import SPEC_BY_NAME, DeltaFormatError

MAGIC = b"FWDELTA\x00"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
_PREFIX = struct.Struct("<8sHHI")
_DIGEST = 32
Hex64 = Field(pattern=r"^[0-9a-f]{64}$")


STREAMS = (
    "gaps",
    "bitmap",
    "values",
    "dense",
    "full",
    "model",
    "ans",
)  # payload streams, in file order
STREAMS_V1 = 5  # version 1 files hold the first five


class Stream(BaseModel):
    model_config = ConfigDict(extra="forbid")
    codec: Literal["zstd", "raw"] = Field(
        description="zstd: magicless zstd frame; raw: bytes as is"
    )
    length: int = Field(ge=0, description="stored bytes in the payload")
    raw_length: int = Field(ge=0, description="bytes after decompression")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stream: Literal["gaps", "bitmap", "values", "dense", "full", "model", "ans"] = Field(
        description="the payload stream holding this section; sections follow each other in it in tensor order"
    )
    raw_length: int = Field(ge=0, description="bytes of this section in the decompressed stream")


def section_streams(op: str, kind: str | None) -> list[str]:
    """The stream of each section of a tensor entry, as its op and layout dictate."""
    if op == "same":
        return []
    if op == "full":
        return ["full"]
    return {
        "dense": ["dense"],
        "gaps": ["gaps", "values"],
        "bitmap": ["bitmap", "values"],
        "ans": ["model", "ans"],
    }[kind]


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str = Field(description="canonical dtype name, see bits.SPEC_BY_NAME")
    shape: list[int] = Field(description="target shape")
    op: Literal["same", "delta", "full"] = Field(
        description="same: unchanged from base; delta: encoded against base; full: stored whole "
        "(new name, or dtype/shape changed)"
    )
    kind: Literal["dense", "gaps", "bitmap", "ans"] | None = Field(
        None,
        description="delta only: dense residuals, changed positions as varint gaps / bitmap, or "
        "positions and residuals entropy-coded per base-exponent group (entropy.py)",
    )
    residual: Literal["ulp", "xor"] | None = Field(
        None, description="delta only: zigzag ordered-key difference (ULPs) or XOR of the bits"
    )
    order: Literal["natural", "exponent"] | None = Field(
        None, description="delta only: element order, natural or stable-sorted by the base exponent"
    )
    n_changed: int | None = Field(None, ge=0)
    sections: list[Section]

    @model_validator(mode="after")
    def _consistent(self) -> TensorEntry:
        spec = SPEC_BY_NAME.get(self.dtype)
        if spec is None:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        n = 1
        for s in self.shape:
            n *= s
        encoding = (self.kind, self.residual, self.order, self.n_changed)
        want: list[int | None]
        if self.op == "same":
            want = []
            if encoding != (None, None, None, None):
                raise ValueError("op 'same' carries no encoding")
        elif self.op == "full":
            want = [n * spec.width]
            if encoding != (None, None, None, None):
                raise ValueError("op 'full' carries no encoding")
        else:
            if None in encoding:
                raise ValueError("op 'delta' needs kind, residual, order and n_changed")
            if not 0 < self.n_changed <= n:
                raise ValueError(f"n_changed {self.n_changed} outside 1..{n}")
            if self.order == "exponent" and not spec.is_float:
                raise ValueError(f"exponent order on non-float dtype {self.dtype}")
            values = self.n_changed * spec.width
            want = {
                "dense": [n * spec.width],
                "gaps": [None, values],
                "bitmap": [(n + 7) // 8, values],
                "ans": [None, None],
            }[self.kind]
            if self.kind == "ans" and self.sections[1:2] and self.sections[1].raw_length % 4:
                raise ValueError("ans section: the ANS payload is not whole 32-bit words")
        if len(self.sections) != len(want):
            raise ValueError(
                f"{self.op}/{self.kind} needs {len(want)} sections, got {len(self.sections)}"
            )
        for sec, raw, stream in zip(self.sections, want, self.streams()):
            if raw is not None and sec.raw_length != raw:
                raise ValueError(f"section raw_length {sec.raw_length}, expected {raw}")
            if sec.stream != stream:
                raise ValueError(f"section in stream {sec.stream!r}, expected {stream!r}")
        return self

    def streams(self) -> list[str]:
        return section_streams(self.op, self.kind)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class DeltaHeader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["flywheel-delta"] = "flywheel-delta"
    format_version: Literal[1, 2] = FORMAT_VERSION
    base_checkpoint_sha256: str = Hex64
    target_checkpoint_sha256: str = Hex64
    zstd_level: int
    streams: list[Stream] = Field(description=f"one per name in {STREAMS}, in that order")
    tensors: list[TensorEntry]
    removed: list[str] = Field(default_factory=list, description="names in base absent from target")

    @model_validator(mode="after")
    def _unique(self) -> DeltaHeader:
        if len(self.streams) != len(STREAMS):
            raise ValueError(f"{len(self.streams)} streams, expected {len(STREAMS)}")
        for name, stream in zip(STREAMS, self.streams):
            used = sum(
                sec.raw_length for t in self.tensors for sec in t.sections if sec.stream == name
            )
            if used != stream.raw_length:
                raise ValueError(
                    f"sections use {used} bytes of stream {name!r}, which holds {stream.raw_length}"
                )
            if stream.codec == "raw" and stream.length != stream.raw_length:
                raise ValueError("raw stream whose length differs from raw_length")
        if self.format_version == 1 and any(t.kind == "ans" for t in self.tensors):
            raise ValueError("the 'ans' layout does not exist in format version 1")
        names = [t.name for t in self.tensors]
        if (
            len(set(names)) != len(names)
            or set(names) & set(self.removed)
            or len(set(self.removed)) != len(self.removed)
        ):
            raise ValueError("tensor names must be unique and disjoint from removed names")
        return self


def make_compressor(level: int, threads: int = 0) -> zstandard.ZstdCompressor:
    """Deterministic zstd: the same input, level and mode always give the same bytes.

    threads=0: zstd's single-threaded mode (used for the per-tensor size trials); threads>=1:
    zstd's multi-threaded mode, whose output does not depend on the number of workers (so the
    reference, with 1 worker, and the fast codec, with N, write identical streams)."""
    return zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters.from_level(
            level,
            format=zstandard.FORMAT_ZSTD1_MAGICLESS,
            write_content_size=1,
            write_checksum=0,
            write_dict_id=0,
            threads=threads,
        )
    )


class Stored(NamedTuple):
    codec: str  # "zstd" | "raw"
    data: bytes  # stored bytes
    raw_length: int  # bytes before compression


def store_section(raw: bytes, compressor: zstandard.ZstdCompressor) -> Stored:
    """zstd when strictly smaller than raw, else raw."""
    if not raw:
        return Stored("raw", b"", 0)
    packed = compressor.compress(raw)
    return (
        Stored("zstd", packed, len(raw)) if len(packed) < len(raw) else Stored("raw", raw, len(raw))
    )


def load_stream(sec: Stream, stored: memoryview) -> bytes:
    data = bytes(stored)
    if sec.codec == "raw":
        return data
    try:
        out = zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS).decompress(
            data, max_output_size=sec.raw_length
        )
    except zstandard.ZstdError as e:
        raise DeltaFormatError(f"corrupt zstd section: {e}") from e
    if len(out) != sec.raw_length:
        raise DeltaFormatError(
            f"section decompressed to {len(out)} bytes, header says {sec.raw_length}"
        )
    return out


COLUMNS = ["name", "dtype", "shape", "op", "kind", "residual", "order", "n_changed", "sections"]
# a row's sections are [stream, raw_length] pairs; "streams" are [codec, length, raw_length]
_MAX_HEADER = 64 << 20


def build_container(header: DeltaHeader, sections: list[bytes]) -> bytes:
    doc = header.model_dump(mode="json", exclude={"tensors", "streams"})
    doc["columns"] = COLUMNS
    doc["streams"] = [[s.codec, s.length, s.raw_length] for s in header.streams]
    doc["tensors"] = [
        [
            t.name,
            t.dtype,
            t.shape,
            t.op,
            t.kind,
            t.residual,
            t.order,
            t.n_changed,
            [[s.stream, s.raw_length] for s in t.sections],
        ]
        for t in header.tensors
    ]
    head = make_compressor(19).compress(json.dumps(doc, separators=(",", ":")).encode())
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(head)) + head + b"".join(sections)
    return body + hashlib.sha256(body).digest()


def _header_from_doc(doc: dict, version: int) -> DeltaHeader:
    if not isinstance(doc, dict) or doc.pop("columns", None) != COLUMNS:
        raise ValueError(f"header columns must be {COLUMNS}")
    if doc.get("format_version") != version:
        raise ValueError(
            f"header format_version {doc.get('format_version')!r} != file version {version}"
        )
    streams = doc.get("streams")
    if not isinstance(streams, list) or not all(
        isinstance(x, list) and len(x) == 3 for x in streams
    ):
        raise ValueError("streams must be [codec, length, raw_length] triples")
    if version == 1:
        if len(streams) != STREAMS_V1:
            raise ValueError(f"a version 1 delta has {STREAMS_V1} streams, got {len(streams)}")
        streams = streams + [["raw", 0, 0]] * (len(STREAMS) - STREAMS_V1)  # empty model/ans streams
    doc["streams"] = [{"codec": c, "length": n, "raw_length": r} for c, n, r in streams]
    rows = doc.get("tensors")
    if not isinstance(rows, list) or not all(
        isinstance(r, list) and len(r) == len(COLUMNS) for r in rows
    ):
        raise ValueError("tensors must be rows of the header columns")
    tensors = []
    for row in rows:
        entry = dict(zip(COLUMNS, row))
        secs = entry["sections"]
        if not isinstance(secs, list) or not all(isinstance(x, list) and len(x) == 2 for x in secs):
            raise ValueError("sections must be [stream, raw_length] pairs")
        entry["sections"] = [{"stream": st, "raw_length": r} for st, r in secs]
        tensors.append(entry)
    doc["tensors"] = tensors
    return DeltaHeader.model_validate(doc)


def parse_container(
    blob: bytes, verify_file_hash: bool = True
) -> tuple[DeltaHeader, list[memoryview]]:
    """Validate a container; return (header, the stored bytes of each stream in STREAMS order).

    Raises DeltaFormatError for anything malformed."""
    if len(blob) < _PREFIX.size + _DIGEST:
        raise DeltaFormatError(f"delta is {len(blob)} bytes, too short for a flywheel delta")
    magic, version, flags, head_len = _PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        raise DeltaFormatError(f"bad magic {magic!r}: not a flywheel delta (.fwd) file")
    if version not in READABLE_VERSIONS or flags != 0:
        raise DeltaFormatError(
            f"unsupported delta format version {version} flags {flags}; this reader "
            f"understands versions {list(READABLE_VERSIONS)} flags 0 (upgrade the reader)"
        )
    if _PREFIX.size + head_len + _DIGEST > len(blob):
        raise DeltaFormatError(f"header length {head_len} runs past the end of the file")
    if verify_file_hash and hashlib.sha256(memoryview(blob)[:-_DIGEST]).digest() != blob[-_DIGEST:]:
        raise DeltaFormatError("delta file SHA-256 mismatch: the file is corrupt or truncated")
    try:
        raw = zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS).decompress(
            blob[_PREFIX.size : _PREFIX.size + head_len], max_output_size=_MAX_HEADER
        )
        header = _header_from_doc(json.loads(raw), version)
    except (ValueError, ValidationError, UnicodeDecodeError, zstandard.ZstdError, TypeError) as e:
        raise DeltaFormatError(f"invalid delta header: {e}") from e
    payload = memoryview(blob)[_PREFIX.size + head_len : len(blob) - _DIGEST]
    pos, views = 0, []
    for stream in header.streams:
        views.append(payload[pos : pos + stream.length])
        pos += stream.length
    if pos != len(payload):
        raise DeltaFormatError(f"streams cover {pos} bytes, payload holds {len(payload)}")
    return header, views
