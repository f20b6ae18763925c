"""The non-streamed answer of the OpenAI-compatible routes: a `text_completion` or
`chat.completion` object, after Kafka acknowledged the generation events.

- **Log-probs.** The behaviour log-prob of each sampled token (completions `logprobs`, chat
  `logprobs: true`), and the k most likely alternatives at each position of the distribution it
  was sampled from (completions `logprobs: k`, as OpenAI also with the sampled token, so up to
  k + 1 entries; chat `top_logprobs: k`). A log-prob of -inf (a token a constraint ruled out) is
  written -9999.0, as OpenAI and vLLM write it, since JSON has no infinity. Log-probs in streams
  are refused with 400 (plan.py).
- **Tool calls** (chat with tools, `tool_choice` not `none`): `message.tool_calls` with the calls
  the model made, `content` the text outside them (null when there is none), and
  `finish_reason: "tool_calls"` when the completion ended after its calls (calls.py).
- A client that disconnects before its turn in the generation queue gets nothing generated or
  logged (499); once generating, a non-streamed request runs to the end, like /v1/complete.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from app.replica import metrics as m
from app.replica.admission import ClientGone
from app.replica.openai.generation import Outcome, admit, generate, generation_error, usage
from app.replica.openai.plan import Plan
from app.replica.replica import Replica


async def answer(request: Request, replica: Replica, p: Plan) -> Response:
    """Generate `p` to the end and answer with one JSON object (OpenAIError when it fails)."""
    ticket = admit(replica, p)
    gone = threading.Event()  # a non-streamed request runs to the end, like /v1/complete
    try:
        out = await generate(replica, p, ticket, gone, None, request)
    except ClientGone:
        m.count_openai(replica.id, p.endpoint, "disconnected")
        return Response(status_code=499)  # nobody reads it; nothing was generated or logged
    except Exception as exc:
        if (err := generation_error(exc)) is None:
            raise
        raise err from None
    body = {
        "id": p.top_id,
        "object": "chat.completion" if p.endpoint == "chat" else "text_completion",
        "created": p.created,
        "model": p.model,
        "system_fingerprint": p.fingerprint,
        "choices": _choices(p, out),
        "usage": usage(p, out),
    }
    m.count_openai(replica.id, p.endpoint, "ok")
    m.REQUEST_SECONDS.labels(replica.id).observe(time.perf_counter() - p.t_start)
    return JSONResponse(body, headers=p.headers())


def _choices(p: Plan, out: Outcome) -> list[dict[str, Any]]:
    choices = []
    for i, (c, s, reason, cc) in enumerate(zip(out.choices, out.samples, out.reasons, out.calls)):
        choice: dict[str, Any] = {"index": i}
        if p.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": c.text, "refusal": None}
            if cc is not None:
                choice["message"]["content"] = cc.content or (None if cc.calls else "")
                if cc.calls:
                    choice["message"]["tool_calls"] = [call.message() for call in cc.calls]
            choice["logprobs"] = _chat_logprobs(c.tok, s) if p.logprobs else None
        else:
            choice["text"] = c.text
            choice["logprobs"] = _completion_logprobs(c.tok, s) if p.logprobs else None
        choice["finish_reason"] = reason
        choice["request_id"] = p.ids[i]
        choices.append(choice)
    return choices


def _token_text(tok: Any, tokens: list[int], j: int) -> str:
    return tok.decode(tokens[j : j + 1])


def _finite(lp: float) -> float:
    return max(float(lp), -9999.0)


def _completion_logprobs(tok: Any, s: Any) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object: per token its text and log-prob, and a map of the
    alternatives asked for (text -> log-prob) with the sampled token in it too; `logprobs: 0`
    asks for none, so each map holds the sampled token alone (OpenAI's schema types the field as
    a list of maps, never null). Two ids with one text keep the likelier."""
    tops = s.top_logprobs or [[] for _ in s.tokens]
    top_maps = []
    for t, lp, top in zip(s.tokens, s.logprobs, tops):
        entries: dict[str, float] = {}
        for i, v in [*top, (t, lp)]:
            entries.setdefault(tok.decode([i]), _finite(v))
        top_maps.append(entries)
    return {
        "tokens": [_token_text(tok, s.tokens, j) for j in range(len(s.tokens))],
        "token_logprobs": [_finite(x) for x in s.logprobs],
        "top_logprobs": top_maps,
        "text_offset": [len(tok.decode(s.tokens[:j])) for j in range(len(s.tokens))],
    }


def _chat_logprobs(tok: Any, s: Any) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object: per token its text, log-prob and bytes, and the
    alternatives asked for (`top_logprobs`), most likely first."""

    def entry(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode())}

    tops = s.top_logprobs or [[] for _ in s.tokens]
    content = []
    for j, (lp, top) in enumerate(zip(s.logprobs, tops)):
        alternatives = [entry(tok.decode([i]), v) for i, v in top]
        content.append({**entry(_token_text(tok, s.tokens, j), lp), "top_logprobs": alternatives})
    return {"content": content, "refusal": None}
