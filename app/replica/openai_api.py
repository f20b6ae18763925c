"""The replica's OpenAI-compatible API: `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/models`, with `stream: true` as server-sent events the way OpenAI's clients read them.

    client = openai.OpenAI(base_url="http://replica:8100/v1", api_key="<FLYWHEEL_REPLICA_API_KEY or any>")
    client.completions.create(model="flywheel-policy", prompt="def f(", max_tokens=32, user="session-1")

Same serving path as `POST /v1/complete` (server.py): the session picks champion or candidate,
generation runs on the generation threads behind the bounded queue, and every completion
writes one `generation` event to `<ns>.interactions`, acknowledged by Kafka before the answer
(before `data: [DONE]` for a stream). What is specific to this API:

- **Ids.** The response `id` is Flywheel's request_id; every choice also carries `request_id`,
  the id its generation event has and its feedback must name. For n == 1 both are the same; for
  n > 1 each choice has its own and the top-level `id` is their `group_id`.
- **Session.** `user`, else the `X-Flywheel-Session` header, is the session id (champion/candidate
  split, and the `session_id` of the events); a request with neither gets 400 naming `user`.
- **Model.** `model` may be the served model name (`FLYWHEEL_MODEL_NAME`) or absent; anything
  else is 404 `model_not_found`. `system_fingerprint` (`flywheel-v<version>`) and the headers
  `X-Flywheel-Model-Version` / `X-Flywheel-Slot` name the version and slot that answered.
- **Sampling.** `temperature` as for /v1/complete (0 greedy, else at least `min_temperature`);
  `top_p` must be 1: the trainer scores every completion under the full softmax at its
  temperature, so the logged behaviour log-probs have to be exactly those. `seed` fixes the
  sampler (same version, prompt, n, max_tokens, temperature: the same tokens). `stop` (a string or
  up to `max_stop_sequences`) ends a completion when its decoded text contains one; the returned
  text ends before it, the event records every token generated up to and including the one that
  completed it, and `finish_reason` is "stop" (as for eos); "length" when `max_tokens` ran out.
- **Log-probs.** The behaviour log-prob of each sampled token: completions `logprobs: 0`, chat
  `logprobs: true` (with `top_logprobs` absent or 0). Alternatives (`logprobs` > 0,
  `top_logprobs` > 0) and log-probs in streams are refused with 400.
- **Refusals** are OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`: 400
  `invalid_request_error` naming the parameter (unknown parameters, unsupported ones such as
  `tools`, `logit_bias`, `echo`, `best_of` > 1, a penalty != 0, bad types, NaN, limits), 401
  `invalid_api_key`, 404 `model_not_found`, and 503 `server_error` + Retry-After when the replica
  has no weights yet, the generation queue is full, `max_open_streams` streams are open, or Kafka
  did not acknowledge the events.
- **Streams.** `data: {chunk}\\n\\n` per generated token (chunk object `text_completion`, or
  `chat.completion.chunk` whose first chunk per choice carries the role), then one chunk per
  choice with its `finish_reason`, a usage chunk when `stream_options.include_usage`, and
  `data: [DONE]\\n\\n`. Text that may be the start of a stop string, or of a character whose
  bytes have not all been generated, is held back until it is decided. If Kafka does not
  acknowledge the events at the end, the stream ends with `data: {"error": {...}}` and no
  `[DONE]` (OpenAI's clients raise it). A client that disconnects mid-stream stops the
  generation after the current token; each choice that generated at least one token still gets
  its one generation event (`finish_reason: "cancelled"`, `stream: true`); a stream cancelled
  before its first token generated nothing and writes no event (counted in
  `flywheel_replica_streams_cancelled_total{recorded="no"}`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from app.contracts.events import MAX_ID_LEN
from app.replica import metrics as m
from app.replica.admission import ClientGone, QueueFull
from app.replica.bodies import (
    RequestInvalid,
    Text,
    context_error,
    limit_error,
    parse_body,
    valid_unicode,
)
from app.replica.engines.base import EngineUnavailable
from app.replica.replica import Replica
from app.replica.routing import pick_slot
from app.replica.weights import LoadedVersion

log = logging.getLogger(__name__)
SESSION_HEADER = "x-flywheel-session"
MAX_SEED = 2**62 - 1


# --- errors ----------------------------------------------------------------------------------------
class OpenAIError(Exception):
    """An answer in OpenAI's error shape."""

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


def _param_path(loc: list[Any]) -> str:
    """["messages", 0, "content"] -> "messages.[0].content" (how OpenAI names nested parameters);
    pydantic's union-member tags (`str`, `list[function-after[...]]`) are not parameters."""
    parts = [
        f"[{x}]" if isinstance(x, int) else str(x)
        for x in loc
        if isinstance(x, int) or ("[" not in str(x) and str(x) not in _UNION_TAGS)
    ]
    return ".".join(parts)


def from_invalid(exc: RequestInvalid) -> OpenAIError:
    """The first of a body's validation errors as a 400 naming its parameter."""
    err = exc.errors[0]
    loc = list(err["loc"][1:])  # drop "body"
    if not loc:
        return bad_param(None, f"the request body is not a valid JSON object: {err['msg']}")
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


# --- request bodies --------------------------------------------------------------------------------
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


def _session_id(v: str) -> str:
    v = valid_unicode(v)
    if not 1 <= len(v) <= MAX_ID_LEN:
        raise ValueError(f"must be 1..{MAX_ID_LEN} characters (it is the session id)")
    return v


Session = Annotated[str, Field(strict=True), AfterValidator(_session_id)]


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


# --- one completion as it is generated ------------------------------------------------------------
class ChoiceText:
    """One choice's tokens and text while it is generated (on the generation thread): stop strings,
    and the part of the text that is decided and may be streamed."""

    def __init__(self, tokenizer: Any, stops: list[str], max_tokens: int):
        self.tok, self.stops, self.max_tokens = tokenizer, stops, max_tokens
        self.tokens: list[int] = []
        self.text = ""  # the text so far (final once `ended`)
        self.sent = 0  # characters of `text` handed out as deltas
        self.ended: str | None = None  # "stop" | "length" once decided

    def add(self, token: int) -> str:
        """Append a generated token; returns the newly decided text (may be empty)."""
        self.tokens.append(token)
        full = self.tok.decode(self.tokens)
        if token == self.tok.eos_id:
            self.ended, self.text = "stop", full
        elif (cut := self._stop_at(full)) is not None:
            self.ended, self.text = "stop", full[:cut]
        elif len(self.tokens) >= self.max_tokens:
            self.ended, self.text = "length", full
        else:
            self.text = full
            return self._delta(len(full) - self._undecided(full))
        return self._delta(len(self.text))

    def finish(self) -> str:
        """The rest of the text when generation ended for another reason (cancelled, context)."""
        return self._delta(len(self.text))

    def _delta(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out

    def _stop_at(self, full: str) -> int | None:
        hits = [i for s in self.stops if (i := full.find(s)) >= 0]
        return min(hits) if hits else None

    def _undecided(self, full: str) -> int:
        """How many trailing characters could still change: an incomplete character (U+FFFD while
        its bytes arrive) or the start of a stop string."""
        keep = len(full) - len(full.rstrip("\ufffd"))
        for s in self.stops:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        return keep


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
    stream: bool
    include_usage: bool
    model: str
    t_start: float
    ids: list[str] = field(default_factory=list)
    top_id: str = ""
    created: int = 0
    lease: Any = None  # the request's hold on lv (weights.Leases), released when it is done

    def __post_init__(self) -> None:
        self.top_id = uuid.uuid4().hex
        self.ids = [self.top_id] if self.n == 1 else [uuid.uuid4().hex for _ in range(self.n)]
        self.created = int(time.time())

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    @property
    def fingerprint(self) -> str:
        return f"flywheel-v{self.lv.version}"

    def headers(self) -> dict[str, str]:
        return {"X-Flywheel-Model-Version": self.lv.version, "X-Flywheel-Slot": self.slot}


@dataclass
class Outcome:
    """What a finished (or cancelled) generation produced, per choice."""

    choices: list[ChoiceText]
    reasons: list[str]
    samples: list[Any]


# --- the routes ------------------------------------------------------------------------------------
def router(replica: Replica) -> APIRouter:
    """The OpenAI-compatible routes of `replica`."""
    from app.contracts.event_producer import KafkaUnavailable, RecordRejected
    from trainer.policy.base import NoChatTemplate, SamplingError

    cfg, settings = replica.cfg, replica.settings
    api = APIRouter()
    streams_open = 0

    def count(endpoint: str, outcome: str) -> None:
        m.OPENAI_REQUESTS.labels(cfg.id, endpoint, outcome).inc()

    def check_auth(request: Request) -> None:
        if not replica.authorized(request):
            raise OpenAIError(
                401,
                "Incorrect API key provided: this replica needs its serving key as "
                "Authorization: Bearer <key>",
                code="invalid_api_key",
                outcome="unauthorized",
            )

    def check_model(model: str | None) -> str:
        if model is not None and model != settings.model_name:
            raise OpenAIError(
                404,
                f"The model '{model[:200]}' does not exist: this replica serves "
                f"'{settings.model_name}'",
                param="model",
                code="model_not_found",
                outcome="model_not_found",
            )
        return settings.model_name

    def session_of(request: Request, user: str | None) -> str:
        header = request.headers.get(SESSION_HEADER)
        if user is not None:
            if header is not None and header != user:
                raise bad_param(
                    "user", f"user and the {SESSION_HEADER} header name different sessions"
                )
            return user
        if header is None:
            raise bad_param(
                "user",
                f"send the editor session as `user` (or the {SESSION_HEADER} header): it picks "
                "champion or candidate and keys the feedback events",
                "missing_required_parameter",
            )
        try:
            return _session_id(header)
        except ValueError as exc:
            raise bad_param("user", f"the {SESSION_HEADER} header {exc}") from None

    def stops_of(stop: str | list[str] | None) -> list[str]:
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

    async def plan(request: Request, endpoint: str) -> Plan:
        """Authorize, parse and check a request, pick its slot and encode its prompt (no model work)."""
        check_auth(request)  # before the body is read
        t_start = time.perf_counter()
        model_cls = ChatRequest if endpoint == "chat" else CompletionRequest
        try:
            raw = await request.body()
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):
                obj = None  # parse_body names what is wrong with the body
            if isinstance(obj, dict) and _NEUTRAL.keys() & obj.keys():
                raw = json.dumps(_strip_neutral(obj)).encode()  # 400 for a non-neutral one
            req = parse_body(raw, model_cls)
        except RequestInvalid as exc:
            raise from_invalid(exc) from None
        model = check_model(req.model)
        session_id = session_of(request, req.user)
        if req.stream_options is not None and not req.stream:
            raise bad_param("stream_options", "stream_options is only allowed when stream is true")
        logprobs = False
        if isinstance(req, CompletionRequest):
            if req.logprobs:
                raise bad_param(
                    "logprobs",
                    "only the sampled tokens' log-probs are served (logprobs: 0); "
                    "top alternatives are not",
                )
            logprobs = req.logprobs is not None
            max_tokens = req.max_tokens
        else:
            if req.top_logprobs:
                raise bad_param(
                    "top_logprobs",
                    "only the sampled tokens' log-probs are served (logprobs: true); "
                    "top alternatives are not",
                )
            if req.top_logprobs is not None and not req.logprobs:
                raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
            logprobs = bool(req.logprobs)
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
        stops = stops_of(req.stop)
        n = req.n if req.n is not None else 1
        temperature = req.temperature if req.temperature is not None else 1.0
        defaulted = max_tokens is None
        if defaulted:
            max_tokens = min(cfg.default_max_tokens, cfg.max_tokens)
        if isinstance(req, ChatRequest):
            messages = [msg.model_dump() for msg in req.messages]
            prompt_chars = sum(len(msg["content"]) for msg in messages)
        else:
            messages, prompt_chars = None, len(req.prompt)
        refused = limit_error(
            cfg, n=n, max_tokens=max_tokens, prompt_chars=prompt_chars, temperature=temperature
        )
        if refused is not None:
            param = "messages" if refused[0] == "prompt" and messages is not None else refused[0]
            raise bad_param(param, refused[1])
        serving = replica.store.snapshot()  # one consistent snapshot for the whole request
        if serving.champion is None:
            raise unavailable(
                "no verified weights loaded yet; retry shortly", "not_ready", 2, "not_ready"
            )
        slot = pick_slot(session_id, serving.traffic_pct, serving.candidate is not None)
        lv = serving.candidate if slot == "candidate" else serving.champion
        assert lv is not None
        ctx = int(lv.config.get("max_context") or 0)
        if defaulted and ctx:
            max_tokens = min(max_tokens, max(1, (ctx - 1) // 2))
        if (too_long := context_error(lv, max_tokens)) is not None:
            raise bad_param("max_tokens", too_long)
        text = req.prompt if messages is None else None
        if messages is not None:
            try:
                text = lv.policy.tokenizer.apply_chat_template(messages)
            except NoChatTemplate as exc:
                raise bad_param(
                    "messages", f"{exc}: this model serves POST /v1/completions only"
                ) from None
        try:
            prompt = replica.encode_prompt(lv, text, max_tokens)
        except ValueError as exc:
            raise bad_param("messages" if messages is not None else "prompt", str(exc)) from None
        return Plan(
            endpoint=endpoint,
            session_id=session_id,
            lv=lv,
            slot=slot,
            prompt=prompt,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=req.seed,
            stops=stops,
            logprobs=logprobs,
            stream=bool(req.stream),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            model=model,
            t_start=t_start,
        )

    def on_step_for(
        p: Plan,
        choices: list[ChoiceText],
        cancelled: threading.Event,
        push: Callable[[list[tuple[int, str]]], None] | None,
    ) -> Callable[[int, list[int | None]], bool]:
        """The per-step callback (generation thread): stop strings, deltas to the stream, cancel."""

        def on_step(_step: int, tokens: list[int | None]) -> bool:
            deltas = []
            for i, t in enumerate(tokens):
                c = choices[i]
                if t is None or c.ended is not None:
                    continue
                if delta := c.add(t):
                    deltas.append((i, delta))
            if push is not None and deltas:
                push(deltas)
            return not cancelled.is_set() and any(c.ended is None for c in choices)

        return on_step

    async def generate(
        p: Plan,
        ticket: Any,
        cancelled: threading.Event,
        push: Callable[[list[tuple[int, str]]], None] | None,
        request: Request | None = None,
    ) -> Outcome:
        """Run the model (on the generation thread) and record one event per choice that generated
        something; raises ClientGone (nothing generated), SamplingError, RecordRejected,
        KafkaUnavailable."""
        tok = p.lv.policy.tokenizer
        choices = [ChoiceText(tok, p.stops, p.max_tokens) for _ in range(p.n)]

        async def still_wanted() -> bool:  # checked when the request's turn comes
            if request is not None and await request.is_disconnected():
                return False
            return not cancelled.is_set()

        run_model = replica._generate if p.lease is None else p.lease.run(replica._generate)
        samples, gen_s = await replica.queue.run_admitted(
            ticket,
            run_model,  # holds p.lv until the generation returns, even if this handler is cancelled
            p.lv,
            p.prompt,
            p.n,
            p.max_tokens,
            p.temperature,
            p.seed,
            on_step_for(p, choices, cancelled, push),
            still_wanted=still_wanted,
        )
        m.GENERATION_SECONDS.labels(cfg.id).observe(gen_s)
        reasons = []
        for c in choices:
            if c.ended is None:
                tail = c.finish()
                if tail and push is not None:
                    push([(choices.index(c), tail)])
            reasons.append(c.ended or ("cancelled" if cancelled.is_set() else "length"))
        trimmed = [_trimmed(s, len(c.tokens)) for s, c in zip(samples, choices)]
        latency_ms = (time.perf_counter() - p.t_start) * 1000.0
        group_id = None if p.n == 1 else p.top_id
        events = [
            replica.generation_event(
                request_id=rid,
                session_id=p.session_id,
                temperature=p.temperature,
                lv=p.lv,
                prompt=p.prompt,
                sample=s,
                group_id=group_id,
                latency_ms=latency_ms,
                finish_reason=reason,
                stream=p.stream,
            )
            for rid, s, reason in zip(p.ids, trimmed, reasons)
            if s.tokens  # a cancelled stream that generated nothing has nothing to record
        ]
        if events:
            await replica.record(events)
            m.TOKENS.labels(cfg.id, p.lv.version, "prompt").inc(len(p.prompt) * len(events))
            m.TOKENS.labels(cfg.id, p.lv.version, "completion").inc(
                sum(len(e["completion_tokens"]) for e in events)
            )
        return Outcome(choices, reasons, trimmed)

    def admit(p: Plan) -> Any:
        assert replica.queue is not None, "the replica has not started"
        try:
            return replica.queue.admit(p.n * p.max_tokens)
        except QueueFull as exc:
            raise unavailable(exc.detail, "queue_full", exc.retry_after_s, "rejected") from None

    def record_error(exc: Exception) -> OpenAIError:
        if isinstance(exc, RecordRejected):
            return bad_param(
                "max_tokens",
                f"the generation could not be recorded ({exc}); ask for fewer tokens or "
                "candidates, or send a shorter prompt",
                "generation_not_recordable",
            )
        assert isinstance(exc, KafkaUnavailable)
        return unavailable(
            f"could not record the generation: {exc}",
            "kafka_unavailable",
            exc.retry_after_s,
            "unavailable",
        )

    # --- non-streamed ---------------------------------------------------------------------------
    async def answer(request: Request, p: Plan) -> Response:
        ticket = admit(p)
        gone = threading.Event()  # a non-streamed request runs to the end, like /v1/complete

        try:
            out = await generate(p, ticket, gone, None, request)
        except ClientGone:
            count(p.endpoint, "disconnected")
            return Response(status_code=499)  # nobody reads it; nothing was generated or logged
        except SamplingError as exc:
            raise bad_param("temperature", str(exc)) from None
        except (RecordRejected, KafkaUnavailable) as exc:
            raise record_error(exc) from None
        except EngineUnavailable as exc:
            raise unavailable(
                f"the engine cannot generate: {exc}", "engine_unavailable", 2, "unavailable"
            ) from None
        usage = _usage(p, out)
        choices = []
        for i, (c, s, reason) in enumerate(zip(out.choices, out.samples, out.reasons)):
            choice: dict[str, Any] = {"index": i}
            if p.endpoint == "chat":
                choice["message"] = {"role": "assistant", "content": c.text, "refusal": None}
                choice["logprobs"] = _chat_logprobs(c.tok, s) if p.logprobs else None
            else:
                choice["text"] = c.text
                choice["logprobs"] = _completion_logprobs(c.tok, s) if p.logprobs else None
            choice["finish_reason"] = reason
            choice["request_id"] = p.ids[i]
            choices.append(choice)
        body = {
            "id": p.top_id,
            "object": "chat.completion" if p.endpoint == "chat" else "text_completion",
            "created": p.created,
            "model": p.model,
            "system_fingerprint": p.fingerprint,
            "choices": choices,
            "usage": usage,
        }
        count(p.endpoint, "ok")
        m.REQUEST_SECONDS.labels(cfg.id).observe(time.perf_counter() - p.t_start)
        return JSONResponse(body, headers=p.headers())

    # --- streamed -------------------------------------------------------------------------------
    def stream(p: Plan) -> Response:
        nonlocal streams_open
        if streams_open >= cfg.max_open_streams:
            raise unavailable(
                f"{streams_open} streams are open (at most {cfg.max_open_streams})",
                "too_many_streams",
                1,
                "rejected",
            )
        ticket = admit(p)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        state = {"done": False}

        loop_thread = threading.get_ident()

        def push(deltas: list[tuple[int, str]]) -> None:
            """Queue text for the stream, in order, from the generation thread or the loop's own."""
            if threading.get_ident() == loop_thread:
                q.put_nowait(("deltas", deltas))
            else:
                loop.call_soon_threadsafe(q.put_nowait, ("deltas", deltas))

        async def job() -> None:
            try:
                await run_job()
            finally:
                p.release()

        async def run_job() -> None:
            try:
                out = await generate(p, ticket, cancelled, push)
            except ClientGone:
                m.STREAMS_CANCELLED.labels(cfg.id, "no").inc()
                count(p.endpoint, "disconnected")
                return
            except SamplingError as exc:
                q.put_nowait(("error", bad_param("temperature", str(exc))))
                count(p.endpoint, "invalid")
                return
            except (RecordRejected, KafkaUnavailable) as exc:
                err = record_error(exc)
                q.put_nowait(("error", err))
                count(p.endpoint, err.outcome)
                return
            except EngineUnavailable as exc:
                err = unavailable(
                    f"the engine cannot generate: {exc}", "engine_unavailable", 2, "unavailable"
                )
                q.put_nowait(("error", err))
                count(p.endpoint, err.outcome)
                return
            except Exception as exc:  # the stream has started: say so in it, and in the log
                log.exception("streamed generation failed")
                q.put_nowait(
                    ("error", OpenAIError(500, f"generation failed: {exc}", type_="server_error"))
                )
                count(p.endpoint, "error")
                return
            if cancelled.is_set():
                recorded = any(s.tokens for s in out.samples)
                m.STREAMS_CANCELLED.labels(cfg.id, "yes" if recorded else "no").inc()
                count(p.endpoint, "cancelled")
                return
            count(p.endpoint, "ok")
            m.REQUEST_SECONDS.labels(cfg.id).observe(time.perf_counter() - p.t_start)
            q.put_nowait(("done", out))

        replica.spawn(job())

        def chunk(
            choices: list[dict[str, Any]], usage: dict | None = None, with_usage: bool = False
        ) -> bytes:
            body: dict[str, Any] = {
                "id": p.top_id,
                "object": "chat.completion.chunk" if p.endpoint == "chat" else "text_completion",
                "created": p.created,
                "model": p.model,
                "system_fingerprint": p.fingerprint,
                "choices": choices,
            }
            if with_usage or p.include_usage:
                body["usage"] = usage
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        def piece(
            i: int, text: str | None, reason: str | None, first: bool = False
        ) -> dict[str, Any]:
            c: dict[str, Any] = {"index": i}
            if p.endpoint == "chat":
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c["delta"] = delta
            else:
                c["text"] = text or ""
            c["logprobs"] = None
            c["finish_reason"] = reason
            c["request_id"] = p.ids[i]
            return c

        async def events() -> AsyncIterator[bytes]:
            if p.endpoint == "chat":
                yield chunk([piece(i, "", None, first=True) for i in range(p.n)])
            while True:
                kind, item = await q.get()
                if kind == "deltas":
                    for i, text in item:
                        yield chunk([piece(i, text, None)])
                elif kind == "error":
                    state["done"] = True
                    yield b"data: " + json.dumps(item.body()).encode() + b"\n\n"
                    return
                else:
                    out: Outcome = item
                    for i, reason in enumerate(out.reasons):
                        yield chunk([piece(i, None if p.endpoint == "chat" else "", reason)])
                    if p.include_usage:
                        yield chunk([], _usage(p, out), with_usage=True)
                    state["done"] = True
                    yield b"data: [DONE]\n\n"
                    return

        def closed() -> None:
            nonlocal streams_open
            streams_open -= 1
            m.STREAMS_OPEN.labels(cfg.id).set(streams_open)
            if not state["done"]:
                cancelled.set()  # the client went away: stop after the current token

        streams_open += 1
        m.STREAMS_OPEN.labels(cfg.id).set(streams_open)
        return _EventStream(
            events(),
            on_close=closed,
            media_type="text/event-stream",
            headers={**p.headers(), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def serve(request: Request, endpoint: str) -> Response:
        try:
            while True:
                p = await plan(request, endpoint)
                # an in-place engine waits for the lease before replacing p.lv; None: a swap
                # took p.lv out after the plan's snapshot, so plan again on the new one
                if (lease := replica.store.hold(p.lv)) is not None:
                    p.lease = lease
                    break
        except OpenAIError as exc:
            count(endpoint, exc.outcome)
            return exc.response()
        try:
            if p.stream:
                return stream(p)  # its job releases the plan when the generation is over
            return await answer(request, p)
        except OpenAIError as exc:
            p.release()
            count(endpoint, exc.outcome)
            return exc.response()
        except BaseException:
            p.release()
            raise
        finally:
            if not p.stream:
                p.release()

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completions")

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat")

    def model_card() -> dict[str, Any]:
        return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "flywheel"}

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except OpenAIError as exc:
            count("models", exc.outcome)
            return exc.response()
        count("models", "ok")
        return JSONResponse({"object": "list", "data": [model_card()]})

    @api.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        try:
            check_auth(request)
            check_model(model)
        except OpenAIError as exc:
            count("models", exc.outcome)
            return exc.response()
        count("models", "ok")
        return JSONResponse(model_card())

    return api


class _EventStream(StreamingResponse):
    """A StreamingResponse that reports when it is over, finished or not (a client that disconnects
    cancels the send loop, even before its first chunk): `on_close` runs either way, synchronously."""

    def __init__(self, content: Any, *, on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _trimmed(sample: Any, n_tokens: int) -> Any:
    """The sample cut to its first `n_tokens` (what the client was given: the rest came after its
    stop string or after it went away). A prefix keeps the behaviour log-probs exact."""
    from trainer.policy.base import Sample

    if n_tokens == len(sample.tokens):
        return sample
    routes = None if sample.routes is None else sample.routes[:n_tokens]
    return Sample(
        tokens=sample.tokens[:n_tokens],
        logprobs=sample.logprobs[:n_tokens],
        routes=routes,
        text=sample.text,
        meta=sample.meta,
    )


def _usage(p: Plan, out: Outcome) -> dict[str, int]:
    completion = sum(len(s.tokens) for s in out.samples)
    return {
        "prompt_tokens": len(p.prompt),
        "completion_tokens": completion,
        "total_tokens": len(p.prompt) + completion,
    }


def _token_text(tok: Any, tokens: list[int], j: int) -> str:
    return tok.decode(tokens[j : j + 1])


def _completion_logprobs(tok: Any, s: Any) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object for the sampled tokens (no alternatives)."""
    return {
        "tokens": [_token_text(tok, s.tokens, j) for j in range(len(s.tokens))],
        "token_logprobs": [float(x) for x in s.logprobs],
        "top_logprobs": None,
        "text_offset": [len(tok.decode(s.tokens[:j])) for j in range(len(s.tokens))],
    }


def _chat_logprobs(tok: Any, s: Any) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for the sampled tokens (no alternatives)."""
    content = []
    for j, lp in enumerate(s.logprobs):
        text = _token_text(tok, s.tokens, j)
        content.append(
            {"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": []}
        )
    return {"content": content, "refusal": None}
