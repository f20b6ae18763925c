"""Request bodies of the OpenAI-compatible routes: `CompletionRequest` (POST /v1/completions) and
`ChatRequest` (POST /v1/chat/completions), parsed strictly (app/replica/bodies.py: NaN, Infinity,
huge numbers and lone surrogates reach the validators; unknown parameters are refused).

Parameters OpenAI defines that this replica cannot honour (`top_p` != 1, penalties, `logit_bias`,
`best_of` > 1, `echo`, `suffix`, `functions`, `response_format` other than text) are
accepted with their neutral values, which clients send by default, and refused with 400
`unsupported_parameter` saying why otherwise: `top_p` must be 1 because the trainer scores every
completion under the full softmax at its temperature, so the logged behaviour log-probs have to
be exactly those.

Chat messages are OpenAI's: `system`/`developer`, `user`, `assistant` (with `tool_calls`) and
`tool` (with `tool_call_id`), content as a string or text parts; function `tools`, `tool_choice`
and `parallel_tool_calls` are parsed here and checked against each other and the history in
tools.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from app.contracts.events import MAX_ID_LEN
from app.replica.bodies import RequestInvalid, Text, parse_body, valid_unicode
from app.replica.openai.errors import bad_param, from_invalid

MAX_SEED = 2**62 - 1

# Parameters OpenAI defines that this replica cannot honour: their neutral values are accepted
# (clients send some by default), anything else is a 400 saying why.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "top_p": (
        (1, 1.0),
        "only top_p = 1 is served: the trainer scores completions under the full "
        "softmax at the sampled temperature, so the logged behaviour log-probs must come "
        "from it unchanged",
    ),
    "presence_penalty": (
        (0, 0.0),
        "penalties change the sampling distribution away from the "
        "one the trainer scores; only 0 is served",
    ),
    "frequency_penalty": (
        (0, 0.0),
        "penalties change the sampling distribution away from the "
        "one the trainer scores; only 0 is served",
    ),
    "logit_bias": (
        ({},),
        "logit_bias changes the sampling distribution away from the one the trainer scores",
    ),
    "best_of": ((1,), "best_of > 1 is not served; ask for n completions and rank them yourself"),
    "echo": ((False,), "echo is not served"),
    "suffix": (("",), "suffix (fill-in-the-middle) is not served by this model"),
    "functions": (([],), "the deprecated `functions` are not served: send `tools`"),
    "function_call": (
        ("none",),
        "the deprecated `function_call` is not served: send `tool_choice`",
    ),
    "response_format": (({"type": "text"},), "only text responses are served"),
}


def _strip_neutral(obj: Any) -> Any:
    """Drop the unsupported parameters that carry their neutral value (or null); 400 for the rest."""
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        if k in _NEUTRAL:
            neutral, why = _NEUTRAL[k]
            if v is None or any(type(v) is type(n) and v == n for n in neutral):
                continue  # (type first: `true` is not top_p 1, `0.0` is presence_penalty 0)
            raise bad_param(
                k, f"{k} = {json.dumps(v)[:100]} is not supported: {why}", "unsupported_parameter"
            )
        out[k] = v
    return out


def check_session_id(v: str) -> str:
    """A session id (`user` or the X-Flywheel-Session header): valid Unicode, 1..MAX_ID_LEN chars."""
    v = valid_unicode(v)
    if not 1 <= len(v) <= MAX_ID_LEN:
        raise ValueError(f"must be 1..{MAX_ID_LEN} characters (it is the session id)")
    return v


Session = Annotated[str, Field(strict=True), AfterValidator(check_session_id)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = Field(None, strict=True)


class _Common(BaseModel):
    """Parameters both endpoints share (None: absent, OpenAI's default applies)."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0.0, le=100.0, allow_inf_nan=False, strict=True)
    n: int | None = Field(None, ge=1, strict=True)
    stop: Text | list[Text] | None = None
    user: Session | None = None
    stream: bool | None = Field(None, strict=True)
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED, strict=True)


class CompletionRequest(_Common):
    """Body of POST /v1/completions."""

    prompt: Text
    logprobs: int | None = Field(None, ge=0, le=5, strict=True)


class TextPart(BaseModel):
    """A text content part (the only kind this replica serves)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


Content = Text | list[TextPart]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text | None = None


class SystemMessage(_Msg):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Msg):
    role: Literal["user"]
    content: Content


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Text  # JSON text; tools.py checks it parses to an object


class ToolCall(BaseModel):
    """A call in an assistant message of the history, as the replica returned it."""

    model_config = ConfigDict(extra="forbid")
    id: Annotated[str, Field(strict=True, min_length=1, max_length=MAX_ID_LEN)]
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Msg):
    role: Literal["assistant"]
    content: Content | None = None
    refusal: Text | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["tool"]
    content: Content
    tool_call_id: Annotated[str, Field(strict=True, min_length=1, max_length=MAX_ID_LEN)]


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema (checked in tools.py)
    strict: bool | None = Field(None, strict=True)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenFunction


class ChatRequest(_Common):
    """Body of POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)


def parse_request(
    raw: bytes, model_cls: type[CompletionRequest] | type[ChatRequest]
) -> CompletionRequest | ChatRequest:
    """The body as `model_cls`, neutral unsupported parameters dropped; OpenAIError (400) naming
    the parameter otherwise."""
    try:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):
            obj = None  # parse_body names what is wrong with the body
        if isinstance(obj, dict) and _NEUTRAL.keys() & obj.keys():
            raw = json.dumps(_strip_neutral(obj)).encode()  # 400 for a non-neutral one
        return parse_body(raw, model_cls)
    except RequestInvalid as exc:
        raise from_invalid(exc) from None
