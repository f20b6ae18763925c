"""Interaction events: the `flywheel.interactions` contract (docs/DESIGN.md §Editor events).

One JSON object per event, a flat discriminated union on `type`. Validation is strict:
unknown fields, NaN/Infinity, coercions ("1" for 1), naive timestamps and
length mismatches are rejected with an error that names the field.

Used by the ingest API (`POST /v1/events`), the streams workers (decoding Kafka records,
invalid ones go to the dead-letter topic) and the replicas (which write `generation`
events themselves).

    from app.contracts.events import parse_event, EventValidationError
    ev = parse_event({"type": "accept", "event_id": "e1", ...})
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_ID_LEN = 128
MAX_COMPLETION_TOKENS = 32768
MAX_TEXT_LEN = 4096
MAX_TEMPERATURE = 100.0  # the replicas' upper bound (app/replica/bodies.py, openai/requests.py)

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN)]
NonNegInt = Annotated[int, Field(ge=0)]
MAX_TOOL_CALLS = 1024  # calls (or invalid calls) one generation event records
MAX_TOOL_TEXT = 262144  # characters of one call's arguments or invalid text
LogProb = Annotated[float, Field(le=0.0)]


def _require_rfc3339_string(v: Any) -> Any:
    if isinstance(v, datetime):  # already parsed (python callers)
        return v
    if not isinstance(v, str):
        raise ValueError(
            "must be an RFC 3339 timestamp string with a timezone, e.g. 2026-11-21T10:00:00Z"
        )
    if "T" not in v.upper() and " " not in v:
        raise ValueError("must be an RFC 3339 timestamp (date and time), e.g. 2026-11-21T10:00:00Z")
    return v


def _in_utc(v: datetime) -> datetime:
    """The same instant in UTC; refuses offsets that push it outside years 1-9999 (not representable)."""
    try:
        return v.astimezone(UTC)
    except OverflowError:
        raise ValueError(
            f"{v.isoformat()} is outside the representable range (years 0001-9999 in UTC)"
        ) from None


# Every reader of an event timestamp goes through this one type: the ingest schema below, and
# `parse_ts` for the downstream readers (streams, controller, trainer), so they cannot disagree.
Timestamp = Annotated[
    AwareDatetime,
    Field(strict=False),
    BeforeValidator(_require_rfc3339_string),
    AfterValidator(_in_utc),
]
_timestamp: TypeAdapter[datetime] = TypeAdapter(Timestamp)


def parse_ts(value: str | datetime) -> datetime:
    """An event timestamp (RFC 3339 text, or an aware datetime) as an aware UTC datetime.

    The one parser of event time: it accepts exactly what ingest accepts (same pydantic type),
    so an event that passed `POST /v1/events` always parses downstream. Raises ValueError
    (naming the problem) for anything else."""
    try:
        return _timestamp.validate_python(value)
    except ValidationError as exc:
        raise ValueError(
            f"invalid timestamp {value!r}: {exc.errors(include_url=False)[0]['msg']}"
        ) from None


def format_ts(value: datetime) -> str:
    """The canonical text of an instant: UTC, microseconds, upper-case Z (`2026-11-21T10:00:00.123456Z`).

    Ingest rewrites every accepted event's `ts` to this form before producing it."""
    if value.tzinfo is not UTC:
        assert value.utcoffset() is not None, f"format_ts needs an aware datetime, got {value!r}"
        value = _in_utc(value)
    return value.isoformat("T", "microseconds")[:-6] + "Z"  # UTC: the text ends with "+00:00"


class _Envelope(BaseModel):
    """Fields every event carries."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    event_id: Id  # client-unique idempotency key
    request_id: Id  # the generation this event is about
    session_id: Id
    ts: Timestamp
    model_version: str | None = None


class ToolCallRecord(BaseModel):
    """A call the model made, as the replica returned it (docs/AGENTS.md)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    id: Id
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=MAX_TOOL_TEXT)  # JSON text of an object
    arguments_valid: bool  # they validate against the function's schema
    arguments_error: str | None = Field(None, max_length=2000)


class InvalidToolCall(BaseModel):
    """Text in the model's tool-call format that is not a valid call: returned as content,
    never repaired."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    text: str = Field(max_length=MAX_TOOL_TEXT)
    error: str = Field(max_length=2000)


class Generation(_Envelope):
    type: Literal["generation"]
    model_version: str = Field(min_length=1)  # required for generations
    prompt_tokens: list[NonNegInt]
    completion_tokens: list[NonNegInt] = Field(min_length=1, max_length=MAX_COMPLETION_TOKENS)
    logprobs: list[LogProb]
    routes: str | None = None  # base64 of little-endian int32 expert ids, shape route_shape
    # [len(completion_tokens), layers, top_k]. A JSON array arrives as a list, which strict mode would refuse
    # for a tuple; the BeforeValidator (added by the replica work) turns it into a tuple, items stay strict ints.
    route_shape: Annotated[
        tuple[NonNegInt, NonNegInt, NonNegInt] | None,
        BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v),
    ] = None
    temperature: float = Field(ge=0.0, le=MAX_TEMPERATURE)
    group_id: Id | None = None
    latency_ms: float | None = Field(None, ge=0.0)
    tokenizer: str = Field(min_length=1, max_length=64)
    # why the completion ended: "stop" (eos or a stop sequence), "length" (max_tokens), or
    # "cancelled" (the client went away mid-stream; completion_tokens is what was generated)
    finish_reason: Literal["stop", "length", "cancelled", "tool_calls"] | None = None
    stream: bool | None = None  # whether the completion was streamed to the client
    # chat turns (docs/AGENTS.md): the assistant messages before this one in the request's history
    turn: NonNegInt | None = None
    tool_choice: Literal["none", "auto", "required", "function"] | None = None  # with tools
    tools_digest: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")  # sha256 of the tools
    # sampled under a grammar constraint (required / named tool_choice): `logprobs` are those of
    # the masked distribution, which the trainer does not score (docs/NUMERICS.md)
    constrained: bool | None = None
    tool_calls: list[ToolCallRecord] | None = Field(None, max_length=MAX_TOOL_CALLS)
    invalid_tool_calls: list[InvalidToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)

    @field_validator("logprobs")
    @classmethod
    def _one_logprob_per_token(cls, v: list[float], info: ValidationInfo) -> list[float]:
        tokens = info.data.get(
            "completion_tokens"
        )  # absent when completion_tokens itself was invalid
        if tokens is not None and len(v) != len(tokens):
            raise ValueError(
                f"logprobs has {len(v)} entries but completion_tokens has {len(tokens)}; they must match"
            )
        return v

    @model_validator(mode="after")
    def _shapes_agree(self) -> Generation:
        n = len(self.completion_tokens)
        if (self.routes is None) != (self.route_shape is None):
            raise ValueError("routes and route_shape must be given together")
        if self.routes is not None and self.route_shape is not None:
            t, layers, top_k = self.route_shape
            if t != n:
                raise ValueError(f"route_shape[0] is {t} but completion_tokens has {n} entries")
            try:
                raw = base64.b64decode(self.routes, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"routes is not valid base64: {exc}") from None
            if len(raw) != 4 * t * layers * top_k:
                raise ValueError(
                    f"routes decodes to {len(raw)} bytes; route_shape {list(self.route_shape)} needs {4 * t * layers * top_k}"
                )
        return self


class Accept(_Envelope):
    type: Literal["accept"]


class Reject(_Envelope):
    type: Literal["reject"]


class EditPersistence(_Envelope):
    type: Literal["edit_persistence"]
    fraction: float = Field(ge=0.0, le=1.0)
    after_s: float = Field(gt=0.0)


class Rating(_Envelope):
    type: Literal["rating"]
    value: Literal[-1, 1]

    @field_validator("value", mode="before")
    @classmethod
    def _not_a_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # True == 1 would pass the literal check
            raise ValueError("must be the number -1 or 1, not a boolean")
        return v


class ToolError(_Envelope):
    type: Literal["tool_error"]
    message: str = Field(max_length=MAX_TEXT_LEN)
    hint: str | None = Field(None, max_length=MAX_TEXT_LEN)
    token_index: NonNegInt


class Followup(_Envelope):
    type: Literal["followup"]
    sentiment: float = Field(ge=-1.0, le=1.0)


class SessionOutcome(_Envelope):
    """How an agent session ended (docs/AGENTS.md "Sessions"): one per session. `request_id` names
    the session's last generation; the session ends once that turn is in (streams/ledger.py)."""

    type: Literal["session_outcome"]
    outcome: Literal["success", "failure", "abandoned"]


Event = Annotated[
    Generation | Accept | Reject | EditPersistence | Rating | ToolError | Followup | SessionOutcome,
    Field(discriminator="type"),
]
FEEDBACK_TYPES = ("accept", "reject", "edit_persistence", "rating", "tool_error", "followup")
SESSION_TYPES = ("session_outcome",)
EVENT_TYPES = ("generation",) + FEEDBACK_TYPES + SESSION_TYPES

_adapter: TypeAdapter[Event] = TypeAdapter(Event)


class FieldError(BaseModel):
    """One problem with one event: `field` is a dotted path inside the event."""

    index: int
    field: str
    message: str


class EventValidationError(ValueError):
    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(f"[{e.index}] {e.field}: {e.message}" for e in errors))


def _field_errors(exc: ValidationError, index: int) -> list[FieldError]:
    out = []
    for err in exc.errors(include_url=False):
        loc = list(err["loc"])
        # the discriminated union puts the tag first: ('generation', 'logprobs', 3)
        if loc and isinstance(loc[0], str) and loc[0] in EVENT_TYPES:
            loc = loc[1:]
        field = ".".join(str(p) for p in loc) or (
            "type" if err["type"].startswith("union_tag") else "(event)"
        )
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not part of the event schema)"
        elif err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            msg = f"{msg}; expected one of {', '.join(EVENT_TYPES)}"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        out.append(FieldError(index=index, field=field, message=msg))
    return out


def parse_event(obj: Any, index: int = 0) -> Event:
    """Validate one decoded JSON object; raises EventValidationError naming each bad field."""
    if not isinstance(obj, dict):
        raise EventValidationError(
            [FieldError(index=index, field="(event)", message="each event must be a JSON object")]
        )
    try:
        return _adapter.validate_python(obj)
    except ValidationError as exc:
        raise EventValidationError(_field_errors(exc, index)) from None


def parse_event_bytes(raw: bytes) -> Event:
    """Decode and validate one Kafka record value (UTF-8 JSON)."""
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise EventValidationError(
            [FieldError(index=0, field="(record)", message=f"not valid JSON: {exc}")]
        ) from None
    return parse_event(obj)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (NaN and Infinity are rejected)")


def validate_batch(events: list[Any]) -> tuple[list[Event], list[FieldError]]:
    """Validate every event of a batch; returns (parsed, errors) — errors for every bad event.

    Normalises in place: each valid event dict's `ts` is rewritten to its canonical form
    (`format_ts`), so what ingest produces to Kafka carries one timestamp spelling."""
    parsed: list[Event] = []
    errors: list[FieldError] = []
    for i, obj in enumerate(events):
        try:
            event = parse_event(obj, i)
        except EventValidationError as exc:
            errors.extend(exc.errors)
            continue
        parsed.append(event)
        obj["ts"] = format_ts(event.ts)
    return parsed, errors


def dumps_event(event: Event) -> bytes:
    """Canonical JSON for an event (used by producers that build events in Python)."""
    return event.model_dump_json(exclude_none=True).encode()


def encode_routes(ids: Any) -> tuple[str, tuple[int, int, int]]:
    """Pack an int array of shape [T, layers, top_k] into (base64 little-endian int32, shape)."""
    import numpy as np

    arr = np.ascontiguousarray(np.asarray(ids), dtype="<i4")
    assert arr.ndim == 3, f"routes must be [T, layers, top_k], got shape {arr.shape}"
    return base64.b64encode(arr.tobytes()).decode(), tuple(int(s) for s in arr.shape)  # type: ignore[return-value]


def decode_routes(routes: str, shape: tuple[int, int, int]) -> Any:
    """Inverse of encode_routes: a numpy int32 array of `shape`."""
    import numpy as np

    return np.frombuffer(base64.b64decode(routes), dtype="<i4").reshape(shape).copy()
