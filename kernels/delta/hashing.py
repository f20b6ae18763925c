"""SHA-256 of tensors and of whole checkpoints, over a canonical byte encoding.

Definitions (format v1; the replica, the trainer and any other reader must agree on them):

    tensor_sha256(t)   = SHA-256( b"flywheel-tensor-v1\\0" + dtype name + b"\\0"
                                  + ",".join(shape) + b"\\0" + raw little-endian element bytes )
    checkpoint_sha256  = SHA-256( b"flywheel-checkpoint-v1\\0"
                                  + for each name in sorted order of its UTF-8 bytes:
                                      u32le(len(name_utf8)) + name_utf8 + tensor digest (32 bytes) )

So the checkpoint hash covers names, dtypes, shapes and bytes; it is computed from the
per-tensor digests, so a reader that has verified every tensor gets it for free.
`hash_state_dict(sd, threads=N)` hashes tensors on a thread pool (hashlib releases the GIL).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kernels.delta.bits import spec_of, tensor_bits


def tensor_digest_bits(
    bits: np.ndarray, dtype_name: str, shape: tuple[int, ...] | list[int]
) -> str:
    h = hashlib.sha256(b"flywheel-tensor-v1\0")
    h.update(dtype_name.encode() + b"\0" + ",".join(str(int(s)) for s in shape).encode() + b"\0")
    h.update(np.ascontiguousarray(bits).view(np.uint8).data)
    return h.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    return tensor_digest_bits(tensor_bits(t), spec_of(t).name, tuple(t.shape))


def checkpoint_sha256_from_digests(digests: Mapping[str, str]) -> str:
    h = hashlib.sha256(b"flywheel-checkpoint-v1\0")
    for name in sorted(digests, key=lambda n: n.encode()):
        raw = name.encode()
        h.update(struct.pack("<I", len(raw)) + raw + bytes.fromhex(digests[name]))
    return h.hexdigest()


def hash_state_dict(sd: Mapping[str, torch.Tensor], threads: int = 1) -> tuple[dict[str, str], str]:
    """(per-tensor SHA-256 hex digests, checkpoint SHA-256) of a state dict."""
    names = list(sd)
    if threads > 1 and len(names) > 1:
        with ThreadPoolExecutor(threads) as pool:
            digests = dict(zip(names, pool.map(lambda n: tensor_sha256(sd[n]), names)))
    else:
        digests = {n: tensor_sha256(sd[n]) for n in names}
    return digests, checkpoint_sha256_from_digests(digests)


def checkpoint_sha256(sd: Mapping[str, torch.Tensor], threads: int = 1) -> str:
    return hash_state_dict(sd, threads)[1]
