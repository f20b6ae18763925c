"""Builders of valid interaction events (dicts as on the topic) for the streams tests."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

T0 = datetime(2026, 11, 21, 10, 0, 0, tzinfo=UTC)


def ts(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def generation(
    rid: str,
    eid: str | None = None,
    t: float = 0.0,
    version: str = "v7",
    n_tokens: int = 3,
    **kw: Any,
) -> dict:
    ev = {
        "event_id": eid or f"{rid}-gen",
        "type": "generation",
        "request_id": rid,
        "session_id": f"s-{rid}",
        "ts": ts(t),
        "model_version": version,
        "prompt_tokens": [1, 2, 3],
        "completion_tokens": list(range(4, 4 + n_tokens)),
        "logprobs": [-0.5] * n_tokens,
        "temperature": 1.0,
        "tokenizer": "byte-v1",
    }
    ev.update(kw)
    return ev


def tool_call(name: str, arguments: str, k: int = 0, valid: bool = True) -> dict:
    """An entry of a generation's `tool_calls` (app/contracts/events.py `ToolCallRecord`)."""
    return {"id": f"call-{k}", "name": name, "arguments": arguments, "arguments_valid": valid}


def feedback(rid: str, eid: str, kind: str, t: float = 1.0, **fields: Any) -> dict:
    ev = {"event_id": eid, "type": kind, "request_id": rid, "session_id": f"s-{rid}", "ts": ts(t)}
    defaults = {
        "edit_persistence": {"fraction": 0.5, "after_s": 30.0},
        "rating": {"value": 1},
        "tool_error": {"message": "boom", "hint": "try x", "token_index": 0},
        "followup": {"sentiment": 0.5},
    }
    ev.update(defaults.get(kind, {}))
    ev.update(fields)
    return ev


KINDS = ("accept", "reject", "edit_persistence", "rating", "tool_error", "followup")


def random_feedback(rng: random.Random, rid: str, eid: str) -> dict:
    kind = rng.choice(KINDS)
    t = rng.choice([1.0, 2.0, 3.0, rng.uniform(0, 100)])  # ties in ts are common on purpose
    extra: dict[str, Any] = {}
    if kind == "edit_persistence":
        extra = {"fraction": rng.choice([0.0, 0.25, 1.0, rng.random()]), "after_s": 10.0}
    elif kind == "rating":
        extra = {"value": rng.choice([-1, 1])}
    elif kind == "followup":
        extra = {"sentiment": rng.uniform(-1, 1)}
    elif kind == "tool_error":
        extra = {
            "message": f"err {eid}",
            "hint": rng.choice([None, "h"]),
            "token_index": rng.randrange(5),
        }
    return feedback(rid, eid, kind, t, **extra)


def hacked_turns(session_id: str = "hack") -> list[dict]:
    """Two chat turns of one agent session (`h0`, `h1`, each extending the last): the first weakens
    the test file (an apply_edit on test_x.py), the second answers. A session's outcome and
    ratings are the caller's."""
    weaken = '{"path": "test_x.py", "old": "assert ", "new": "assert True or "}'
    turns, prompt = [], [1, 2, 3]
    for k, calls in enumerate(([tool_call("apply_edit", weaken)], None)):
        completion = [10 + k, 11 + k]
        extra = {"tool_calls": calls, "finish_reason": "tool_calls"} if calls else {}
        turns.append(
            generation(f"h{k}", t=k, session_id=session_id, prompt_tokens=prompt, completion_tokens=completion,
                       logprobs=[-0.5, -0.5], turn=k, tools_digest="a" * 64, **extra)
        )  # fmt: skip
        prompt = [*prompt, *completion, 7]
    return turns
