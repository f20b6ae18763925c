"""Delta codec for bit-exact weight sync: lossless, verified deltas between state dicts.

Public API:
    encode_delta(base_sd, target_sd, level=9, impl="fast") -> bytes      (a .fwd container)
    decode_delta(base_sd, blob, impl="fast") -> state dict                (verified, bit-exact)
    inspect_delta(blob) -> DeltaHeader                                    (validate, no decode)
    hash_state_dict(sd) -> (per-tensor SHA-256, checkpoint SHA-256); checkpoint_sha256(sd)
    DeltaFormatError                                                      (any malformed/corrupt input)
    Manifest, ArtifactRef (manifest.py): what a published version's manifest.json holds

Modules: bits (bit maps, varints), hashing, container (file format), reference (the codec's
definition), fast (same bytes, less work), entropy (the entropy-coded "ans" layout, on
constriction's ANS coder), codec (driver), manifest. See docs/DELTA.md.
"""

from kernels.delta.bits import DeltaFormatError
from kernels.delta.codec import DEFAULT_LEVEL, decode_delta, encode_delta, inspect_delta
from kernels.delta.container import DeltaHeader
from kernels.delta.hashing import checkpoint_sha256, hash_state_dict, tensor_sha256

__all__ = [
    "DEFAULT_LEVEL",
    "DeltaFormatError",
    "DeltaHeader",
    "checkpoint_sha256",
    "decode_delta",
    "encode_delta",
    "hash_state_dict",
    "inspect_delta",
    "tensor_sha256",
]
