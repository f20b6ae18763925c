"""OpenAI's error shape for the replica's OpenAI-compatible routes.

Refusals are `{"error": {"message", "type", "param", "code"}}`: 400 `invalid_request_error`
naming the parameter (unknown parameters, unsupported ones such as `tools`, `logit_bias`, `echo`,
`best_of` > 1, a penalty != 0, bad types, NaN, limits), 401 `invalid_api_key`, 404
`model_not_found`, and 503 `server_error` + Retry-After when the replica has no weights yet, the
generation queue is full, `max_open_streams` streams are open, or Kafka did not acknowledge the
events.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from app.replica.bodies import RequestInvalid


class OpenAIError(Exception):
    """An answer in OpenAI's error shape; `outcome` is its label in
    `flywheel_replica_openai_requests_total`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        outcome: str = "invalid",
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )
        self.outcome, self.retry_after_s = outcome, retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_param(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after_s: int, outcome: str) -> OpenAIError:
    return OpenAIError(
        503,
        message,
        code=code,
        type_="server_error",
        outcome=outcome,
        retry_after_s=retry_after_s,
    )


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_ROLE_TAGS = {"system", "developer", "user", "assistant", "tool"}  # the messages' discriminator


def _param_path(loc: list[Any]) -> str:
    """["messages", 0, "content"] -> "messages.[0].content" (how OpenAI names nested parameters);
    pydantic's union-member tags (`str`, `list[function-after[...]]`, a message's role after its
    index) are not parameters."""
    parts = []
    for j, x in enumerate(loc):
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif j > 0 and isinstance(loc[j - 1], int) and x in _ROLE_TAGS:
            continue
        elif "[" not in str(x) and str(x) not in _UNION_TAGS:
            parts.append(str(x))
    return ".".join(parts)


def from_invalid(exc: RequestInvalid) -> OpenAIError:
    """The first of a body's validation errors as a 400 naming its parameter."""
    err = exc.errors[0]
    loc = list(err["loc"][1:])  # drop "body"
    if not loc:
        return bad_param(None, f"the request body is not a valid JSON object: {err['msg']}")
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc.append("role" if loc and loc[0] == "messages" else "type")  # the union's discriminator
    param = _param_path(loc)
    if err["type"] == "extra_forbidden":
        return bad_param(
            param,
            f"Unrecognized request argument supplied: {param} (this replica does not support it)",
            "unknown_parameter",
        )
    if err["type"] == "missing":
        return bad_param(
            param, f"Missing required parameter: '{param}'.", "missing_required_parameter"
        )
    return bad_param(param, f"Invalid value for '{param}': {err['msg']}", "invalid_value")
