"""From an OpenAI-compatible request to a `Plan`: authorized, parsed, checked, its slot picked and
its prompt encoded, before any model work.

- **Ids.** The response `id` is Flywheel's request_id; every choice also carries `request_id`,
  the id its generation event has and its feedback must name. For n == 1 both are the same; for
  n > 1 each choice has its own and the top-level `id` is their `group_id`.
- **Session.** `user`, else the `X-Flywheel-Session` header, is the session id (champion/candidate
  split, and the `session_id` of the events); a request with neither gets 400 naming `user`.
- **Group.** The `X-Flywheel-Group` header puts the request's generations in a group: their
  events' `group_id` (the trainer centres each group's rewards on the group's mean), for
  attempts at one task in parallel sessions (an agent user's parallel agents). A grouped request
  is served by the slot its group hashes to, so every attempt of a group meets the same version.
  Without it, an n > 1 request's choices are a group (the top-level `id`).
- **Model.** `model` may be the served model name (`FLYWHEEL_MODEL_NAME`) or absent; anything
  else is 404 `model_not_found`. `system_fingerprint` (`flywheel-v<version>`) and the headers
  `X-Flywheel-Model-Version` / `X-Flywheel-Slot` name the version and slot that answered.
- **Sampling.** `temperature` as for /v1/complete (0 greedy, else at least `min_temperature`);
  `top_p` must be 1 (requests.py). `seed` fixes the sampler (same version, prompt, n, max_tokens,
  temperature: the same tokens). `stop` is a string or up to `max_stop_sequences` strings of at
  most `max_stop_chars` each (choice_text.py). Without `max_tokens` (or chat's
  `max_completion_tokens`) a completion gets `default_max_tokens` (at most `max_tokens`, and at
  most half the model's context).
- **Log-probs** of the sampled tokens (completions `logprobs` >= 0, chat `logprobs: true`), with
  the most likely alternatives at each position when asked (completions `logprobs` up to 5, chat
  `top_logprobs` up to 20), all from the distribution the token was sampled from. Log-probs in
  streams are refused with 400 (the generation events carry them).
- **Tools** (chat): `tools`, `tool_choice`, `parallel_tool_calls` and the history's calls and
  tool results are checked in tools.py; the prompt is the model's chat template with the tools.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from app.replica.bodies import context_error, limit_error
from app.replica.config import ReplicaConfig
from app.replica.openai.errors import OpenAIError, bad_param, unavailable
from app.replica.openai.requests import (
    ChatRequest,
    CompletionRequest,
    check_session_id,
    parse_request,
)
from app.replica.openai.tools import ToolPlan, plan_tools, render_messages
from app.replica.replica import Replica
from app.replica.routing import pick_slot
from app.replica.weights import LoadedVersion

SESSION_HEADER = "x-flywheel-session"
GROUP_HEADER = "x-flywheel-group"


@dataclass
class Plan:
    """A validated request, ready to generate."""

    endpoint: str  # "completions" | "chat"
    session_id: str
    lv: LoadedVersion
    slot: str
    prompt: list[int]
    n: int
    max_tokens: int
    temperature: float
    seed: int | None
    stops: list[str]
    logprobs: bool
    top_logprobs: int  # alternatives per token (0: the sampled tokens' log-probs only)
    stream: bool
    include_usage: bool
    model: str
    t_start: float
    ids: list[str] = field(default_factory=list)
    top_id: str = ""
    created: int = 0
    lease: Any = None  # the request's hold on lv (weights.Leases), released when it is done
    tools: ToolPlan | None = None  # chat: what the request asks of tool calling
    group: str | None = None  # the X-Flywheel-Group header

    def __post_init__(self) -> None:
        self.top_id = uuid.uuid4().hex
        self.ids = [self.top_id] if self.n == 1 else [uuid.uuid4().hex for _ in range(self.n)]
        self.created = int(time.time())

    @property
    def group_id(self) -> str | None:
        """The generation events' `group_id`: the X-Flywheel-Group header, else the top-level
        id of n > 1 choices, else none."""
        if self.group is not None:
            return self.group
        return None if self.n == 1 else self.top_id

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    @property
    def fingerprint(self) -> str:
        return f"flywheel-v{self.lv.version}"

    def headers(self) -> dict[str, str]:
        return {"X-Flywheel-Model-Version": self.lv.version, "X-Flywheel-Slot": self.slot}


def check_auth(request: Request, replica: Replica) -> None:
    if not replica.authorized(request):
        raise OpenAIError(
            401,
            "Incorrect API key provided: this replica needs its serving key as "
            "Authorization: Bearer <key>",
            code="invalid_api_key",
            outcome="unauthorized",
        )


def check_model(replica: Replica, model: str | None) -> str:
    served = replica.settings.model_name
    if model is not None and model != served:
        raise OpenAIError(
            404,
            f"The model '{model[:200]}' does not exist: this replica serves '{served}'",
            param="model",
            code="model_not_found",
            outcome="model_not_found",
        )
    return served


def session_of(request: Request, user: str | None) -> str:
    header = request.headers.get(SESSION_HEADER)
    if user is not None:
        if header is not None and header != user:
            raise bad_param("user", f"user and the {SESSION_HEADER} header name different sessions")
        return user
    if header is None:
        raise bad_param(
            "user",
            f"send the editor session as `user` (or the {SESSION_HEADER} header): it picks "
            "champion or candidate and keys the feedback events",
            "missing_required_parameter",
        )
    try:
        return check_session_id(header)
    except ValueError as exc:
        raise bad_param("user", f"the {SESSION_HEADER} header {exc}") from None


def group_of(request: Request) -> str | None:
    """The X-Flywheel-Group header, checked as a session id is (valid Unicode, 1..MAX_ID_LEN)."""
    header = request.headers.get(GROUP_HEADER)
    if header is None:
        return None
    try:
        return check_session_id(header)
    except ValueError as exc:
        raise bad_param(
            None, f"the {GROUP_HEADER} header {str(exc).replace('session id', 'group id')}"
        ) from None


def stops_of(cfg: ReplicaConfig, stop: str | list[str] | None) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > cfg.max_stop_sequences:
        raise bad_param(
            "stop",
            f"stop has {len(stops)} strings; at most {cfg.max_stop_sequences} are accepted",
        )
    for s in stops:
        if not s:
            raise bad_param("stop", "a stop string must not be empty")
        if len(s) > cfg.max_stop_chars:
            raise bad_param(
                "stop", f"a stop string has {len(s)} characters; at most {cfg.max_stop_chars}"
            )
    return stops


def _logprobs_and_max_tokens(
    req: CompletionRequest | ChatRequest,
) -> tuple[bool, int, int | None]:
    """Whether the sampled tokens' log-probs are asked for, how many alternatives per token, and
    the asked-for max_tokens."""
    if req.stream_options is not None and not req.stream:
        raise bad_param("stream_options", "stream_options is only allowed when stream is true")
    if isinstance(req, CompletionRequest):
        logprobs, top = req.logprobs is not None, req.logprobs or 0
        max_tokens = req.max_tokens
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs, top = bool(req.logprobs), req.top_logprobs or 0
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise bad_param(
                "max_completion_tokens", "send max_tokens or max_completion_tokens, not both"
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    if logprobs and req.stream:
        raise bad_param(
            "logprobs",
            "log-probs are not served in streams (the generation events carry them); "
            "drop logprobs or stream",
        )
    return logprobs, top, max_tokens


def _pick_version(replica: Replica, key: str) -> tuple[str, LoadedVersion]:
    """The slot of `key` (the session, or the group of a grouped request) and the version
    serving it, from one consistent snapshot."""
    serving = replica.store.snapshot()  # one consistent snapshot for the whole request
    if serving.champion is None:
        raise unavailable(
            "no verified weights loaded yet; retry shortly", "not_ready", 2, "not_ready"
        )
    slot = pick_slot(key, serving.traffic_pct, serving.candidate is not None)
    lv = serving.candidate if slot == "candidate" else serving.champion
    assert lv is not None
    return slot, lv


def _encode(
    replica: Replica,
    lv: LoadedVersion,
    text: str | None,
    messages: list[dict] | None,
    max_tokens: int,
    tools: ToolPlan | None = None,
) -> list[int]:
    """The prompt tokens: `text`, or the chat `messages` (and tools) through the version's chat
    template."""
    from policy.base import NoChatTemplate

    if messages is not None:
        try:
            text = lv.policy.tokenizer.apply_chat_template(
                messages, (tools.tools or None) if tools is not None else None
            )
        except NoChatTemplate as exc:
            raise bad_param(
                "messages", f"{exc}: this model serves POST /v1/completions only"
            ) from None
        except Exception as exc:  # the model's own template refused them (jinja's raise_exception)
            from jinja2 import TemplateError

            if not isinstance(exc, TemplateError):
                raise
            raise bad_param("messages", f"the model's chat template refused them: {exc}") from None
    from app.replica.replica import ContextOverflow

    # a chat with tools is never cut: keeping its end would drop the tool definitions
    whole = tools is not None and bool(tools.tools)
    try:
        return replica.encode_prompt(lv, text, max_tokens, truncate=not whole)
    except ContextOverflow as exc:
        raise bad_param(
            "messages",
            f"{exc}: a chat with tools is not cut (its tool definitions would be lost); send "
            "fewer or shorter messages, or ask for fewer max_tokens",
            "context_length_exceeded",
        ) from None
    except ValueError as exc:
        raise bad_param("messages" if messages is not None else "prompt", str(exc)) from None


async def plan(request: Request, replica: Replica, endpoint: str) -> Plan:
    """Authorize, parse and check a request, pick its slot and encode its prompt (no model work)."""
    cfg = replica.cfg
    check_auth(request, replica)  # before the body is read
    t_start = time.perf_counter()
    model_cls = ChatRequest if endpoint == "chat" else CompletionRequest
    req = parse_request(await request.body(), model_cls)
    model = check_model(replica, req.model)
    session_id = session_of(request, req.user)
    group = group_of(request)
    logprobs, top_logprobs, max_tokens = _logprobs_and_max_tokens(req)
    stops = stops_of(cfg, req.stop)
    n = req.n if req.n is not None else 1
    temperature = req.temperature if req.temperature is not None else 1.0
    defaulted = max_tokens is None
    if max_tokens is None:
        max_tokens = min(cfg.default_max_tokens, cfg.max_tokens)
    if isinstance(req, ChatRequest):
        messages = render_messages(req)
        prompt_chars = sum(len(msg["content"] or "") for msg in messages)
    else:
        messages, prompt_chars = None, len(req.prompt)
    refused = limit_error(
        cfg, n=n, max_tokens=max_tokens, prompt_chars=prompt_chars, temperature=temperature
    )
    if refused is not None:
        param = "messages" if refused[0] == "prompt" and messages is not None else refused[0]
        raise bad_param(param, refused[1])
    slot, lv = _pick_version(replica, session_id if group is None else group)
    ctx = int(lv.config.get("max_context") or 0)
    if defaulted and ctx:
        max_tokens = min(max_tokens, max(1, (ctx - 1) // 2))
    if (too_long := context_error(lv, max_tokens)) is not None:
        raise bad_param("max_tokens", too_long)
    text = req.prompt if isinstance(req, CompletionRequest) else None
    tools = None
    if isinstance(req, ChatRequest):
        tools = await plan_tools(req, cfg, lv.policy.tokenizer)
    return Plan(
        endpoint=endpoint,
        session_id=session_id,
        lv=lv,
        slot=slot,
        prompt=_encode(replica, lv, text, messages, max_tokens, tools),
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=req.seed,
        stops=stops,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        model=model,
        t_start=t_start,
        tools=tools,
        group=group,
    )
