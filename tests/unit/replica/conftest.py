"""Tiny policies for the replica's unit tests (CPU is shared: keep them small)."""

from __future__ import annotations

import pytest
import torch

TINY = {
    "type": "moe-byte",
    "d_model": 16,
    "n_layers": 1,
    "n_heads": 2,
    "d_ff": 16,
    "n_experts": 2,
    "top_k": 1,
    "max_context": 64,
}


def tiny_state(
    seed: int = 0, max_context: int | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, bf16 serving state dict) of a tiny policy initialised with `seed` (its context
    `max_context` tokens instead of TINY's 64 when given)."""
    from policy import build_policy

    cfg = {**TINY, "init_seed": seed, **({"max_context": max_context} if max_context else {})}
    return cfg, build_policy(cfg).serving_state_dict()


@pytest.fixture()
def tiny():
    return tiny_state
