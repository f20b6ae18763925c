"""Policies behind one small interface (base.Policy); `build_policy` picks one by name.

from trainer.policy import build_policy, save_policy, load_policy
policy = build_policy({"type": "moe-byte", "d_model": 64})   # None -> the default built-in
policy = build_policy({"type": "hf", "model_dir": "/models/qwen-moe"})  # a Hugging Face model
samples = policy.generate([policy.tokenizer.encode("def f(")], max_tokens=32, seed=0)
lp = policy.logprobs([prompt], [samples[0].tokens], routes=[samples[0].routes])
"""

from __future__ import annotations

from trainer.policy.base import Policy, Sample, Tokenizer
from trainer.policy.checkpoint import load_policy, save_policy
from trainer.policy.factory import POLICY_TYPES, build_policy

__all__ = [
    "POLICY_TYPES",
    "Policy",
    "Sample",
    "Tokenizer",
    "build_policy",
    "load_policy",
    "save_policy",
]
