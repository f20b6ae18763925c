"""Request bodies of the replica's routes (`/v1/complete` and the OpenAI-compatible ones): strict
JSON decoding into pydantic models, valid-Unicode strings, and the refusals both APIs share (a
field that is wrong, a limit that is exceeded, a prompt longer than the served context), each
naming the field. app/replica/routes/complete.py and app/replica/openai/ document the rules.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from app.contracts.events import Id
from app.replica.config import ReplicaConfig
from app.replica.weights import LoadedVersion

log = logging.getLogger(__name__)
B = TypeVar("B", bound=BaseModel)


def valid_unicode(v: str) -> str:
    """Refuse lone surrogates (JSON's `"\\ud800"` decodes to one): they cannot be encoded, tokenized or logged."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone surrogate (U+{ord(v[exc.start]):04X} at index {exc.start}), which is "
            f"not valid Unicode; send UTF-8 text"
        ) from None
    return v


Text = Annotated[str, Field(strict=True), AfterValidator(valid_unicode)]


class CompleteRequest(BaseModel):
    """Body of POST /v1/complete (limits beyond these come from ReplicaConfig, checked in the route)."""

    model_config = ConfigDict(extra="forbid")

    session_id: Annotated[Id, Field(strict=True), AfterValidator(valid_unicode)] = Field(
        description="Editor session; picks champion vs candidate."
    )
    prompt: Text = Field(description="Text to complete (may be empty).")
    max_tokens: int = Field(
        64, ge=1, strict=True, description="Most completion tokens per candidate."
    )
    temperature: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        allow_inf_nan=False,
        strict=True,
        description="0 = greedy; otherwise at least the replica's `min_temperature`.",
    )
    n: int = Field(
        1, ge=1, strict=True, description="Candidates for this context (n > 1 share a group_id)."
    )


class RequestInvalid(Exception):
    """A 422: `errors` in FastAPI's shape, `[{loc: ["body", field...], msg, type}]`."""

    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(errors)
        self.errors = errors


def _printable(v: Any, limit: int = 200) -> Any:
    """A loc item or message that is safe to send back (no lone surrogates, bounded length)."""
    if not isinstance(v, str):
        return v
    v = v.encode("utf-8", "backslashreplace").decode("utf-8")
    return v if len(v) <= limit else v[:limit] + "…"


def parse_complete_request(raw: bytes) -> CompleteRequest:
    """Decode and validate a /v1/complete body; RequestInvalid names the field (or `body`)."""
    return parse_body(raw, CompleteRequest)


def parse_body(raw: bytes, model: type[B]) -> B:
    """Decode and validate a JSON body into `model`; RequestInvalid names the field (or `body`).

    The standard JSON decoder reads the body first so that NaN, Infinity, huge numbers and
    lone-surrogate escapes reach the model's validators, which name the field they are in."""

    def body_error(msg: str, type_: str = "json_invalid") -> RequestInvalid:
        return RequestInvalid([{"loc": ["body"], "msg": msg, "type": type_}])

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise body_error(
            f"the body is not valid UTF-8 (byte {exc.start}: {exc.reason})", "utf8_invalid"
        ) from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise body_error("the body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers longer than Python's 4300-digit limit
        raise body_error(f"the body is not valid JSON: {_printable(str(exc))}") from None
    if isinstance(obj, dict):  # pydantic cannot name a key that is not valid Unicode: name it here
        for key in obj:
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestInvalid(
                    [
                        {
                            "loc": ["body", _printable(key)],
                            "msg": "field name contains a lone "
                            "surrogate, which is not valid Unicode",
                            "type": "string_unicode",
                        }
                    ]
                ) from None
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise RequestInvalid(
            [
                {
                    "loc": ["body", *map(_printable, e["loc"])],
                    "msg": _printable(e["msg"], 500),
                    "type": e["type"],
                }
                for e in exc.errors(include_url=False, include_context=False, include_input=False)
            ]
        ) from None


def field_error(field: str, msg: str, status: int = 422) -> JSONResponse:
    return JSONResponse(
        {"detail": [{"loc": ["body", field], "msg": msg, "type": "value_error"}]},
        status_code=status,
    )


def limit_error(
    cfg: ReplicaConfig, *, n: int, max_tokens: int, prompt_chars: int, temperature: float
) -> tuple[str, str] | None:
    """The replica's own bounds on an otherwise valid request: (field, message) or None."""
    if n > cfg.max_n:
        return "n", f"n is {n}; this replica serves at most {cfg.max_n} candidates per request"
    if max_tokens > cfg.max_tokens:
        return (
            "max_tokens",
            f"max_tokens is {max_tokens}; this replica allows at most {cfg.max_tokens}",
        )
    if prompt_chars > cfg.max_prompt_chars:
        return (
            "prompt",
            f"prompt has {prompt_chars} characters; at most {cfg.max_prompt_chars} are accepted",
        )
    if 0.0 < temperature < cfg.min_temperature:
        return (
            "temperature",
            f"temperature {temperature!r} is below this replica's smallest non-zero temperature "
            f"{cfg.min_temperature}; send 0 for greedy",
        )
    return None


def context_error(lv: LoadedVersion, max_tokens: int) -> str | None:
    """Why `max_tokens` does not fit the served model's context (None when it does)."""
    ctx = int(lv.config.get("max_context") or 0)
    if ctx and max_tokens > ctx - 1:
        return (
            f"max_tokens is {max_tokens}; the model's context holds {ctx} tokens including bos, "
            f"so at most {ctx - 1}"
        )
    return None
