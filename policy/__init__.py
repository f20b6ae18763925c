"""The policy package, shared by the trainer and the replicas: the policy interface (base.Policy),
the built-in byte-level MoE policy, Hugging Face causal LMs (dense, MoE, LoRA), their tokenizers,
checkpoints and model files, and the grammar mask of constrained decoding (tool calls:
`constrain.py`). `build_policy` picks one by name.

from policy import build_policy, save_policy, load_policy
policy = build_policy({"type": "moe-byte", "d_model": 64})   # None -> the default built-in
policy = build_policy({"type": "hf", "model_dir": "/models/qwen-moe"})  # a Hugging Face model
samples = policy.generate([policy.tokenizer.encode("def f(")], max_tokens=32, seed=0)
lp = policy.logprobs([prompt], [samples[0].tokens], routes=[samples[0].routes])

A leaf under the roles: it imports `kernels` and no role (the trainer, the replica, ...) or
orchestration module (pyproject.toml's import contracts). The names below load on first use, so
`policy.lora_spec` (torch-free, validated by the trainer's settings) imports no torch, and no
submodule imports this package back.

May import: kernels
Tests: tests/unit/policy/
Docs: docs/TRAINER.md, docs/NUMERICS.md
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policy.base import Policy, Sample, Tokenizer
    from policy.checkpoint import load_policy, save_policy
    from policy.factory import POLICY_TYPES, build_policy

_WHERE = {
    "POLICY_TYPES": "policy.factory",
    "Policy": "policy.base",
    "Sample": "policy.base",
    "Tokenizer": "policy.base",
    "build_policy": "policy.factory",
    "load_policy": "policy.checkpoint",
    "save_policy": "policy.checkpoint",
}

__all__ = [
    "POLICY_TYPES",
    "Policy",
    "Sample",
    "Tokenizer",
    "build_policy",
    "load_policy",
    "save_policy",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'policy' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value
