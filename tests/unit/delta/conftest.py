"""Fixtures for the delta codec tests: small state dicts with special values, and a bit-exact compare."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.delta.bits import SPEC_BY_NAME, bits_to_tensor, tensor_bits

SPECIAL_BF16 = [
    0x0000,
    0x8000,
    0x7F80,
    0xFF80,
    0x7FC0,
    0x7FC1,
    0xFFFF,
    0x7F81,
    0x0001,
    0x8001,
    0x007F,
    0x7F7F,
    0xFF7F,
    0x0080,
    0x3F80,
]  # ±0, ±inf, NaNs with payloads, subnormals, max/min


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and np.array_equal(tensor_bits(a[k]), tensor_bits(b[k]))
        for k in a
    )


def random_bits(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    spec = SPEC_BY_NAME[dtype]
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        bits = rng.integers(0, 2, n).astype(spec.uint)
    else:
        bits = (
            rng.integers(0, 1 << (8 * spec.width), n, dtype=np.uint64, endpoint=False).astype(
                spec.uint
            )
            if spec.width < 8
            else rng.integers(0, 2**63, n, dtype=np.uint64).astype(spec.uint)
        )
    return bits_to_tensor(bits, spec, shape)


def perturb(
    rng: np.random.Generator, t: torch.Tensor, frac: float, max_ulps: int = 3
) -> torch.Tensor:
    """Change about `frac` of the elements by a few units of their bit pattern (wrapping)."""
    spec = SPEC_BY_NAME[{v.torch_dtype: k for k, v in SPEC_BY_NAME.items()}[t.dtype]]
    bits = tensor_bits(t).copy()
    pick = rng.random(bits.size) < frac
    if spec.name == "bool":
        bits[pick] ^= np.uint8(1)
    else:
        steps = rng.integers(-max_ulps, max_ulps + 1, int(pick.sum())).astype(np.int64)
        bits[pick] = (bits[pick].astype(np.int64) + steps).astype(spec.uint)
    return bits_to_tensor(bits, spec, tuple(t.shape))


def make_small_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A tiny base/target pair (bf16 weights with special values, an int buffer, a new and a removed name)."""
    rng = np.random.default_rng(7)
    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[: len(SPECIAL_BF16)] = torch.tensor(
        np.array(SPECIAL_BF16, dtype=np.uint16).view(np.int16)
    )
    base = {"w": w, "steps": torch.tensor([3, 4], dtype=torch.int64), "old": torch.ones(2)}
    target = {
        "w": perturb(rng, w, 0.3),
        "steps": torch.tensor([3, 5], dtype=torch.int64),
        "new": torch.zeros(3, dtype=torch.float16),
    }
    return base, target


@pytest.fixture
def small_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return make_small_pair()
