"""`build_policy`: a policy from its JSON config (`Policy.config_dict()`), the one place that maps a
config's `type` to a policy class (the built-in MoE policy, a Hugging Face model, LoRA on one)."""

from __future__ import annotations

from typing import Any

from policy.base import Policy

POLICY_TYPES = ("moe-byte", "hf")


def build_policy(config: dict[str, Any] | None = None) -> Policy:
    """Build a policy from its JSON config (`Policy.config_dict()`); None builds the default.

    Raises ValueError on an unknown `type` and pydantic's ValidationError on a bad field.
    """
    config = dict(config or {})
    kind = config.get("type", "moe-byte")
    if kind == "moe-byte":
        from policy.moe_lm import MoEConfig, MoEPolicy

        return MoEPolicy(MoEConfig(**config))
    if kind == "hf":
        from policy.hf import HFConfig, HFPolicy

        hf = HFConfig(**config)
        if hf.lora is not None:
            from policy.lora import LoraPolicy

            return LoraPolicy(hf)
        return HFPolicy(hf)
    raise ValueError(f"unknown policy type {kind!r}; known types: {', '.join(POLICY_TYPES)}")
