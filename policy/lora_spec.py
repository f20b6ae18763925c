"""The LoRA setting (`FLYWHEEL_TRAINER_LORA`, an HF policy config's `lora`): rank, alpha, dropout, targets.

Torch-free, so the trainer's settings validate it before torch is imported (trainer/config.py).
policy/lora.py turns it into a peft `LoraConfig` and checks the targets against the model.

    {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"],
     "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}

`target_modules` are module names (a module matches when its dotted name is the target or ends with
`.<target>`); `target_parameters` are `<module>.<parameter>` names of fused MoE expert parameters
(transformers 5.x `mlp.experts.gate_up_proj` / `down_proj`), which peft adapts with a low-rank
update per expert (peft's `ParamWrapper`). peft refuses dropout on such parameters, and so does this
model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraSpec(BaseModel):
    """A LoRA adapter's shape; stored in every LoRA version's policy config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    r: int = Field(..., gt=0, description="Rank of the low-rank update.")
    alpha: float | None = Field(
        None, gt=0, description="Scale numerator: the update is (alpha / r) * B @ A; None = r."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input while training (0 with target_parameters).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        description="Linear modules to adapt (names or name suffixes).",
    )
    target_parameters: list[str] = Field(
        default_factory=list,
        description="Fused expert parameters to adapt, e.g. mlp.experts.gate_up_proj.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LoraSpec:
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(self.r))
        if not self.target_modules and not self.target_parameters:
            raise ValueError("LoRA needs at least one of target_modules / target_parameters")
        if self.dropout and self.target_parameters:
            raise ValueError(
                "LoRA dropout must be 0 with target_parameters (peft cannot apply dropout to a "
                "low-rank update of a fused parameter)"
            )
        for name in [*self.target_modules, *self.target_parameters]:
            if not name or name.startswith(".") or name.endswith("."):
                raise ValueError(f"LoRA target {name!r} is not a dotted module/parameter name")
        return self
