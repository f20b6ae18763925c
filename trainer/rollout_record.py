"""The rollout record as the trainer reads it: the producer's contract (app/contracts/rollouts.py
`Rollout`, docs/DESIGN.md §Rollout record) plus the structural invariants training needs
(lengths, route bytes). trainer/rollouts.py parses records into it; trainer/validate.py checks
one against the model being trained.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ToolErrorInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")
    message: str = Field(max_length=4096)
    hint: str | None = Field(None, max_length=4096)
    token_index: int = Field(ge=0)


class Rollout(BaseModel):
    """docs/DESIGN.md §Rollout record (the fields the trainer uses are validated strictly)."""

    model_config = ConfigDict(extra="ignore")
    request_id: str = Field(min_length=1, max_length=128)
    session_id: str = Field(min_length=1, max_length=128)
    group_id: str | None = None
    model_version: str
    prompt_tokens: list[int]
    completion_tokens: list[int] = Field(min_length=1, max_length=32768)
    logprobs: list[float]
    routes: str | None = None
    route_shape: list[int] | None = None
    reward: float
    components: dict[str, Any] | None = None
    tool_errors: list[ToolErrorInfo] = Field(default_factory=list)
    reward_spec: str = Field("v1", max_length=64)  # every distinct spec goes into a version's tags
    generated_at: str | None = None
    labelled_at: str | None = None
    closed_by: str | None = None
    tokenizer: str | None = (
        None  # the generation's tokenizer (checked against the model's when present)
    )
    temperature: float | None = None  # the generation's sampling temperature
    constrained: bool | None = None  # sampled under a grammar mask (trainer/validate.py refuses it)
    relabel_run: str | None = None  # set by `flywheel streams relabel` (exempt from max_staleness)

    @field_validator("model_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("prompt_tokens", "completion_tokens")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Rollout:
        if len(self.logprobs) != len(self.completion_tokens):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} values for {len(self.completion_tokens)} completion tokens"
            )
        if (self.routes is None) != (self.route_shape is None):
            raise ValueError("routes and route_shape go together")
        if self.route_shape is not None:
            if (
                len(self.route_shape) != 3
                or self.route_shape[0] != len(self.completion_tokens)
                or min(self.route_shape) < 0
            ):
                raise ValueError(
                    f"route_shape {self.route_shape} must be [len(completion_tokens), layers, top_k]"
                )
            try:
                n = len(base64.b64decode(self.routes, validate=True))  # type: ignore[arg-type]
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"routes is not valid base64: {exc}") from None
            need = 4 * math.prod(self.route_shape)
            if n != need:
                raise ValueError(
                    f"routes decodes to {n} bytes; route_shape {self.route_shape} needs {need}"
                )
        return self

    def routes_array(self) -> np.ndarray | None:
        """int32 [T, layers, top_k] or None."""
        if self.routes is None:
            return None
        from app.contracts.events import decode_routes

        return decode_routes(self.routes, tuple(self.route_shape))  # type: ignore[arg-type]

    def version_number(self) -> int | None:
        """The version as an int; None (counted as stale) unless it is 1 to 18 ASCII digits
        ("²".isdigit() is True and int() refuses it; int() also refuses > 4300 digits)."""
        v = self.model_version
        return int(v) if v.isascii() and v.isdigit() and len(v) <= 18 else None
