"""Policies behind one small interface (base.Policy); `build_policy` picks one by name.

from trainer.policy import build_policy, save_policy, load_policy
policy = build_policy({"type": "moe-byte", "d_model": 64})   # None -> the default built-in
policy = build_policy({"type": "hf", "model_dir": "/models/qwen-moe"})  # a Hugging Face model
samples = policy.generate([policy.tokenizer.encode("def f(")], max_tokens=32, seed=0)
lp = policy.logprobs([prompt], [samples[0].tokens], routes=[samples[0].routes])
"""

from __future__ import annotations

from typing import Any

from trainer.policy.base import Policy, Sample, Tokenizer
from trainer.policy.checkpoint import load_policy, save_policy

POLICY_TYPES = ("moe-byte", "hf")


def build_policy(config: dict[str, Any] | None = None) -> Policy:
    """Build a policy from its JSON config (`Policy.config_dict()`); None builds the default.

    Raises ValueError on an unknown `type` and pydantic's ValidationError on a bad field.
    """
    config = dict(config or {})
    kind = config.get("type", "moe-byte")
    if kind == "moe-byte":
        from trainer.policy.moe_lm import MoEConfig, MoEPolicy

        return MoEPolicy(MoEConfig(**config))
    if kind == "hf":
        from trainer.policy.hf import HFConfig, HFPolicy

        hf = HFConfig(**config)
        if hf.lora is not None:
            from trainer.policy.lora import LoraPolicy

            return LoraPolicy(hf)
        return HFPolicy(hf)
    raise ValueError(f"unknown policy type {kind!r}; known types: {', '.join(POLICY_TYPES)}")


__all__ = [
    "POLICY_TYPES",
    "Policy",
    "Sample",
    "Tokenizer",
    "build_policy",
    "load_policy",
    "save_policy",
]
