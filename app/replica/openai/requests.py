"""Request bodies of the OpenAI-compatible routes: `CompletionRequest` (POST /v1/completions) and
`ChatRequest` (POST /v1/chat/completions), parsed strictly (app/replica/bodies.py: NaN, Infinity,
huge numbers and lone surrogates reach the validators; unknown parameters are refused).

Parameters OpenAI defines that this replica cannot honour (`top_p` != 1, penalties, `logit_bias`,
`best_of` > 1, `echo`, `suffix`, `tools`, `functions`, `response_format` other than text) are
accepted with their neutral values, which clients send by default, and refused with 400
`unsupported_parameter` saying why otherwise: `top_p` must be 1 because the trainer scores every
completion under the full softmax at its temperature, so the logged behaviour log-probs have to
be exactly those.
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
    "tools": (([],), "this model does not call tools"),
    "tool_choice": (("none",), "this model does not call tools"),
    "parallel_tool_calls": ((False,), "this model does not call tools"),
    "functions": (([],), "this model does not call functions"),
    "function_call": (("none",), "this model does not call functions"),
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


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatRequest(_Common):
    """Body of POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)


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
