"""The rollout record as the trainer reads it: the producer's contract (app/contracts/rollouts.py
`Rollout`, docs/DESIGN.md §Rollout record) plus the structural invariants training needs
(lengths, route bytes, a multi-turn record's spans and loss mask). trainer/rollouts.py parses
records into it; trainer/validate.py checks one against the model being trained.

A multi-turn record (a session's segment, docs/TRAINER.md "Multi-turn records") has `turns`
(each model call's span of `completion_tokens`, version and temperature) and/or `loss_mask` (1 on
the tokens the model sampled). Its invariants, each refused as `invalid_rollout` naming the
field: `loss_mask` has one value per completion token and at least one 1; `turns` is non-empty,
its spans lie in the completion, in order, without overlap; with both, `loss_mask` is 1 exactly
on the union of the spans; `model_version` is the newest turn's; a top-level `temperature` is
every turn's that names one. The log-probs at mask-0 positions are placeholders the trainer
ignores (not checked, and read as 0.0). Its `routes`, when given, are checked as a one-call
record's: `route_shape` [len(completion_tokens), layers, top_k], the whole completion (the session
ledger writes zeros between the turns, which the trainer does not replay, trainer/batch.py).
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)


class ToolErrorInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")
    message: str = Field(max_length=4096)
    hint: str | None = Field(None, max_length=4096)
    token_index: int = Field(ge=0)


def version_number(v: str) -> int | None:
    """A model_version as an int; None (counted as stale) unless it is 1 to 18 ASCII digits
    ("²".isdigit() is True and int() refuses it; int() also refuses > 4300 digits)."""
    return int(v) if v.isascii() and v.isdigit() and len(v) <= 18 else None


class TurnSpan(BaseModel):
    """One model call of a multi-turn record: it sampled `completion_tokens[start:end]` with
    `model_version` at `temperature` (None: the record's)."""

    model_config = ConfigDict(extra="ignore")
    request_id: str = Field(min_length=1, max_length=128)
    model_version: str = Field(min_length=1)
    temperature: float | None = None
    start: int = Field(ge=0)
    end: int = Field(ge=1)
    constrained: bool | None = None  # sampled under a grammar mask (trainer/validate.py refuses it)

    @field_validator("model_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


def _need(ok: bool, message: str) -> None:
    """Refuse the record (a ValueError pydantic reports under the field) unless `ok`."""
    if not ok:
        raise ValueError(message)


def _check_turns(turns: list[TurnSpan], data: dict[str, Any]) -> None:
    """The spans lie in the completion, in order, without overlap; the record's model_version is
    the newest turn's and its temperature (when given) every turn's that names one."""
    _need(bool(turns), "turns must not be empty (None for a one-call record)")
    n = len(data["completion_tokens"]) if "completion_tokens" in data else None
    prev_end = 0
    for k, t in enumerate(turns):
        _need(
            t.start < t.end and (n is None or t.end <= n),
            f"turns[{k}] spans [{t.start}, {t.end}): not a non-empty span of the {n} completion tokens",
        )
        _need(
            t.start >= prev_end,
            f"turns[{k}] starts at {t.start}, before turns[{k - 1}] ends at {prev_end}: "
            "turns must be in order without overlap",
        )
        prev_end = t.end
    newest = max(turns, key=lambda t: version_number(t.model_version) or -1).model_version
    version = data.get("model_version")
    _need(
        version is None or version == newest,
        f"model_version {version!r} must be the newest turn's ({newest!r})",
    )
    temperature = data.get("temperature")
    for k, t in enumerate(turns):
        _need(
            temperature is None or t.temperature in (None, temperature),
            f"turns[{k}].temperature {t.temperature!r} is not the record's temperature {temperature!r}",
        )


def _check_loss_mask(mask: list[int], data: dict[str, Any]) -> None:
    """One {0,1} per completion token, at least one 1, and 1 exactly on the turns' spans."""
    n = len(data["completion_tokens"]) if "completion_tokens" in data else len(mask)
    _need(len(mask) == n, f"loss_mask has {len(mask)} values for {n} completion tokens")
    _need(all(m in (0, 1) for m in mask), "loss_mask values must be 0 or 1")
    _need(any(mask), "loss_mask has no 1: nothing of the completion was sampled by the model")
    turns = data.get("turns")
    if turns:
        spans = spans_mask(turns, n)
        bad = next((i for i, (a, b) in enumerate(zip(mask, spans)) if a != b), None)
        if bad is not None:
            raise ValueError(
                f"loss_mask[{bad}] = {mask[bad]} but the turns' spans say {spans[bad]}: "
                "loss_mask must be 1 exactly on the union of the turns' spans"
            )


def spans_mask(turns: list[TurnSpan], n: int) -> list[int]:
    """[n] 0/1: 1 on the union of the turns' spans."""
    out = [0] * n
    for t in turns:
        out[t.start : t.end] = [1] * (min(t.end, n) - t.start)
    return out


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
    # how the agent session ended (a session_outcome that reached this segment); None: no outcome
    outcome: Literal["success", "failure", "abandoned"] | None = None
    # a multi-turn record (module docstring): each model call's span; None for one call
    turns: list[TurnSpan] | None = None
    # 1 on completion tokens the model sampled (trained on), 0 elsewhere; None: all sampled
    loss_mask: list[int] | None = None

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

    @field_validator("turns")
    @classmethod
    def _turns(cls, v: list[TurnSpan] | None, info: ValidationInfo) -> list[TurnSpan] | None:
        if v is not None:
            _check_turns(v, info.data)
        return v

    @field_validator("loss_mask")
    @classmethod
    def _loss_mask(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is not None:
            _check_loss_mask(v, info.data)
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
                whole = " (a multi-turn record's routes cover its whole completion)"
                raise ValueError(
                    f"route_shape {self.route_shape} must be [len(completion_tokens), layers, top_k] "
                    f"with len(completion_tokens) = {len(self.completion_tokens)}"
                    + (whole if self.turns is not None else "")
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
        """The version as an int (`version_number`); None counts as stale."""
        return version_number(self.model_version)

    def train_mask(self) -> list[int] | None:
        """[len(completion_tokens)] 0/1: the tokens to train on (the model sampled them, from a
        fresh turn); None: all of them (a one-call record)."""
        if self.loss_mask is not None:
            return self.loss_mask
        if self.turns is not None:
            return spans_mask(self.turns, len(self.completion_tokens))
        return None

    def trained_turns(self) -> int:
        """Model calls this record trains on: 1 for a one-call record; a multi-turn record's turns
        whose span is trained (not masked as stale or constrained at intake)."""
        if self.turns is None:
            return 1
        trained = self.train_mask() or [1] * len(self.completion_tokens)
        return sum(1 for t in self.turns if any(trained[t.start : t.end]))

    def turn_temperatures(self) -> set[float | None]:
        """The temperatures the turns were sampled at (a turn without one: the record's)."""
        return {
            self.temperature if t.temperature is None else t.temperature for t in self.turns or []
        }

    def scoring_temperature(self) -> float | None:
        """What the policy scores the record at: its temperature, else its turns' (one, once
        trainer/validate.py refused `mixed_temperature`); None: the trainer's setting."""
        if self.temperature is not None or not self.turns:
            return self.temperature
        return self.turns[0].temperature

    def without_turns(self, dropped: list[int]) -> Rollout:
        """A copy whose loss mask is 0 on the spans of the turns at indices `dropped` (stale
        turns, trainer/rollouts.py): they stay as context, untrained."""
        mask = list(self.train_mask() or [1] * len(self.completion_tokens))
        for k in dropped:
            t = self.turns[k]  # type: ignore[index]
            mask[t.start : t.end] = [0] * (t.end - t.start)
        return self.model_copy(update={"loss_mask": mask})
