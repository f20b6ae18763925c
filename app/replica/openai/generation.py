"""Generating a `Plan` and recording what it generated: the `Outcome` both the JSON answer and the
stream are made of.

Generation runs on the generation threads behind the bounded queue (app/replica/admission.py,
admitted before the response starts), one step callback per token: stop strings and held-back
text (choice_text.py), the deltas a stream sends, and cancellation. Every choice that generated
at least one token writes one `generation` event to `<ns>.interactions`, acknowledged by Kafka
before the answer; the event records every token generated up to and including the one that
completed a stop string (a prefix of the sample, so the behaviour log-probs stay exact). A
cancelled stream's choices say `finish_reason: "cancelled"`; a choice that generated nothing
writes no event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from app.replica import metrics as m
from app.replica.admission import QueueFull
from app.replica.engines.base import EngineUnavailable
from app.replica.openai.calls import ChoiceCalls, Piece
from app.replica.openai.choice_text import ChoiceText
from app.replica.openai.errors import OpenAIError, bad_param, unavailable
from app.replica.openai.plan import Plan
from app.replica.replica import Replica

Push = Callable[[list[tuple[int, Piece]]], None]  # (choice index, content text or call), in order


@dataclass
class Outcome:
    """What a finished (or cancelled) generation produced, per choice."""

    choices: list[ChoiceText]
    reasons: list[str]
    samples: list[Any]
    calls: list[ChoiceCalls | None]  # per choice, when the request's tools are read as calls


def admit(replica: Replica, p: Plan) -> Any:
    """A place in the generation queue for `p` (503 `queue_full` when there is none)."""
    assert replica.queue is not None, "the replica has not started"
    try:
        return replica.queue.admit(p.n * p.max_tokens)
    except QueueFull as exc:
        raise unavailable(exc.detail, "queue_full", exc.retry_after_s, "rejected") from None


def generation_error(exc: Exception) -> OpenAIError | None:
    """The answer to a generation that failed the expected ways (a temperature the sampler
    refuses, events Kafka refused or did not acknowledge, an engine that cannot generate);
    None for any other failure."""
    from app.infra.event_producer import KafkaUnavailable, RecordRejected
    from policy.base import SamplingError
    from policy.constrain import ConstraintError

    if isinstance(exc, SamplingError):
        return bad_param("temperature", str(exc))
    if isinstance(exc, ConstraintError):  # the tools' grammar hit a parser limit mid-generation
        return bad_param("tools", f"constrained decoding could not go on: {exc}")
    if isinstance(exc, RecordRejected):
        return bad_param(
            "max_tokens",
            f"the generation could not be recorded ({exc}); ask for fewer tokens or "
            "candidates, or send a shorter prompt",
            "generation_not_recordable",
        )
    if isinstance(exc, KafkaUnavailable):
        return unavailable(
            f"could not record the generation: {exc}",
            "kafka_unavailable",
            exc.retry_after_s,
            "unavailable",
        )
    if isinstance(exc, EngineUnavailable):
        return unavailable(
            f"the engine cannot generate: {exc}", "engine_unavailable", 2, "unavailable"
        )
    return None


def _pieces(calls: ChoiceCalls | None, text: str) -> list[Piece]:
    """A choice's newly decided text as what it adds to the message."""
    if calls is None:
        return [text] if text else []
    return calls.feed(text)


def _on_step_for(
    choices: list[ChoiceText],
    calls: list[ChoiceCalls | None],
    cancelled: threading.Event,
    push: Push | None,
) -> Callable[[int, list[int | None]], bool]:
    """The per-step callback (generation thread): stop strings, calls, deltas to the stream,
    cancel."""

    def on_step(_step: int, tokens: list[int | None]) -> bool:
        deltas: list[tuple[int, Piece]] = []
        for i, t in enumerate(tokens):
            c = choices[i]
            if t is None or c.ended is not None:
                continue
            deltas.extend((i, piece) for piece in _pieces(calls[i], c.add(t)))
        if push is not None and deltas:
            push(deltas)
        return not cancelled.is_set() and any(c.ended is None for c in choices)

    return on_step


async def generate(
    replica: Replica,
    p: Plan,
    ticket: Any,
    cancelled: threading.Event,
    push: Push | None,
    request: Request | None = None,
) -> Outcome:
    """Run the model (on the generation thread) and record one event per choice that generated
    something; raises ClientGone (nothing generated), SamplingError, RecordRejected,
    KafkaUnavailable."""
    tok = p.lv.policy.tokenizer
    choices = [ChoiceText(tok, p.stops, p.max_tokens) for _ in range(p.n)]
    reads = p.tools is not None and p.tools.reads_calls
    calls = [ChoiceCalls(p.tools) if reads else None for _ in range(p.n)]

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
        _on_step_for(choices, calls, cancelled, push),
        p.top_logprobs,
        None if p.tools is None else p.tools.constraint,
        still_wanted=still_wanted,
    )
    m.GENERATION_SECONDS.labels(replica.id).observe(gen_s)
    reasons = []
    for i, (c, cc) in enumerate(zip(choices, calls)):
        tail = c.finish() if c.ended is None else ""
        pieces = _pieces(cc, tail) if cc is None else cc.finish(tail)
        if pieces and push is not None:
            push([(i, piece) for piece in pieces])
        reason = c.ended or ("cancelled" if cancelled.is_set() else "length")
        reasons.append("tool_calls" if reason == "stop" and cc is not None and cc.calls else reason)
    trimmed = [_trimmed(s, len(c.tokens)) for s, c in zip(samples, choices)]
    await _record(replica, p, trimmed, reasons, calls)
    return Outcome(choices, reasons, trimmed, calls)


def _tool_fields(p: Plan, calls: ChoiceCalls | None) -> dict[str, Any]:
    """What a chat generation event records of the turn and its tool calls."""
    if p.tools is None:
        return {}
    t = p.tools
    fields: dict[str, Any] = {"turn": t.turn}
    if t.tools:
        fields.update(
            tool_choice=t.choice, tools_digest=t.digest, constrained=t.constraint is not None
        )
    if calls is not None:
        fields.update(calls.event_fields())
    return fields


async def _record(
    replica: Replica,
    p: Plan,
    samples: list[Any],
    reasons: list[str],
    calls: list[ChoiceCalls | None],
) -> None:
    """One generation event per choice that generated something, acknowledged by Kafka."""
    latency_ms = (time.perf_counter() - p.t_start) * 1000.0
    events = [
        replica.generation_event(
            request_id=rid,
            session_id=p.session_id,
            temperature=p.temperature,
            lv=p.lv,
            prompt=p.prompt,
            sample=s,
            group_id=p.group_id,
            latency_ms=latency_ms,
            finish_reason=reason,
            stream=p.stream,
            extra=_tool_fields(p, cc),
        )
        for rid, s, reason, cc in zip(p.ids, samples, reasons, calls)
        if s.tokens  # a cancelled stream that generated nothing has nothing to record
    ]
    if events:
        await replica.record(events)
        m.TOKENS.labels(replica.id, p.lv.version, "prompt").inc(len(p.prompt) * len(events))
        m.TOKENS.labels(replica.id, p.lv.version, "completion").inc(
            sum(len(e["completion_tokens"]) for e in events)
        )
    _count_calls(replica.id, p, calls)


def _count_calls(replica_id: str, p: Plan, calls: list[ChoiceCalls | None]) -> None:
    if p.tools is not None and p.tools.constraint is not None:
        m.CONSTRAINED.labels(replica_id, p.tools.choice).inc(p.n)
    for cc in calls:
        if cc is None:
            continue
        for call in cc.calls:
            outcome = "valid" if call.arguments_error is None else "invalid_arguments"
            m.TOOL_CALLS.labels(replica_id, outcome).inc()
        if cc.invalid:
            m.TOOL_CALLS.labels(replica_id, "malformed").inc(len(cc.invalid))


def _trimmed(sample: Any, n_tokens: int) -> Any:
    """The sample cut to its first `n_tokens` (what the client was given: the rest came after its
    stop string or after it went away). A prefix keeps the behaviour log-probs exact."""
    from policy.base import Sample

    if n_tokens == len(sample.tokens):
        return sample
    routes = None if sample.routes is None else sample.routes[:n_tokens]
    top = None if sample.top_logprobs is None else sample.top_logprobs[:n_tokens]
    return Sample(
        tokens=sample.tokens[:n_tokens],
        logprobs=sample.logprobs[:n_tokens],
        routes=routes,
        text=sample.text,
        meta=sample.meta,
        top_logprobs=top,
    )


def usage(p: Plan, out: Outcome) -> dict[str, int]:
    completion = sum(len(s.tokens) for s in out.samples)
    return {
        "prompt_tokens": len(p.prompt),
        "completion_tokens": completion,
        "total_tokens": len(p.prompt) + completion,
    }
