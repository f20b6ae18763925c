"""`manifest.json` of a published version: what it holds, its hashes and its place in the chain.

Written by app/contracts/artifacts.py next to the version's artifacts; read first by every replica, so
it is the root of trust for a sync: it names the delta and anchor files with their SHA-256s,
lists every tensor with dtype, shape and SHA-256, and gives the checkpoint SHA-256
(kernels/delta/hashing.py) and the chain (parent version, nearest anchor, depth since it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MANIFEST_FILE = "manifest.json"
ANCHOR_FILE = "anchor.safetensors"


def delta_file(parent_version: str) -> str:
    return f"delta-from-{parent_version}.fwd"


class TensorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str = Field(description="canonical dtype name, e.g. bfloat16")
    shape: list[int]
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="tensor SHA-256 (hashing.tensor_sha256)"
    )


class ArtifactRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str = Field(description="file name among the version's artifacts")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the file's bytes")
    bytes: int = Field(ge=0, description="file size")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["flywheel-manifest"] = "flywheel-manifest"
    format_version: Literal[1] = 1
    version: str = Field(pattern=VERSION_PATTERN, description="this model version")
    parent_version: str | None = Field(
        None, description="the version the delta is from; None for the first"
    )
    anchor_version: str = Field(
        description="nearest version at or before this one with a full anchor"
    )
    chain_depth: int = Field(ge=0, description="deltas between anchor_version and this version")
    anchor_every: int = Field(ge=1, description="a full anchor is written every K versions")
    checkpoint_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tensors: list[TensorInfo]
    delta: ArtifactRef | None = Field(
        None, description="delta from parent_version (.fwd container)"
    )
    anchor: ArtifactRef | None = Field(
        None, description="full bf16 safetensors checkpoint, when due"
    )
