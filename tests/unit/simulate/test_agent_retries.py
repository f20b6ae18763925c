"""Agent users when a replica cannot serve a turn (app/simulate/agents.py `AgentPopulation._post`).

A refusal that generated nothing (503 + Retry-After when the generation queue is full or no weights
are loaded, 429, no connection) is retried, as an editor's OpenAI client retries it; a turn that
failed after it was sent, or stayed refused for `agent_retry_s`, interrupts the session, which then
reports its tool errors and no outcome and no rating: reported as `abandoned`, the service's failures
were charged to the agent and dragged its group's baseline down (docs/TRAINER.md "Why it falls short").

The replica here is a stand-in HTTP server on a real socket (uvicorn, `ServerThread`): a real replica's queue
cannot be made full at a chosen request, and this one answers each request as the test scripts it
(503 with the replica's Retry-After, 500, or a chat completion).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from app.api.server import ServerThread
from app.sandbox.sandbox import Sandbox
from app.sandbox.session import INTERRUPTED, AgentSession, Verdict
from app.sandbox.tasks import tasks
from app.simulate.agents import AgentPopulation, AgentUser
from app.simulate.config import SimulateConfig

QUEUE_FULL = {"error": {"message": "generation queue full", "type": "server_error", "code": None}}


def _completion(content: str | None, calls: list[dict] | None = None) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{time.monotonic_ns()}",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def stand_in_replica(script: list[tuple[int, dict]]) -> tuple[ServerThread, list[int]]:
    """A server that answers the n-th POST /v1/chat/completions with `script[n]` (status, body),
    then 200s; and the list its requests are counted in."""
    script, seen = list(script), []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    def chat() -> JSONResponse:
        seen.append(1)
        status, body = script.pop(0) if script else (200, _completion("done"))
        headers = {"x-flywheel-model-version": "3"}
        if status == 503:
            headers["Retry-After"] = "0"
        return JSONResponse(body, status_code=status, headers=headers)

    return ServerThread(app).start(), seen


@pytest.fixture()
def replica() -> Iterator:
    started: list[ServerThread] = []

    def _start(script: list[tuple[int, dict]]) -> tuple[ServerThread, list[int]]:
        server, seen = stand_in_replica(script)
        started.append(server)
        return server, seen

    yield _start
    for server in started:
        server.stop()


def _turns(url: str, retry_s: float, n: int) -> tuple[AgentPopulation, AgentSession, Verdict]:
    """`n` turns of one session against `url` (fewer if it ends), and its verdict."""
    cfg = SimulateConfig(agents=True, users=1, agent_think_s=0, agent_retry_s=retry_s, seed=3)
    pop = AgentPopulation("http://127.0.0.1:9", "fw_key", [url], cfg)
    task = tasks(1, seed=3)[0]

    async def run(s: AgentSession) -> None:
        async with httpx.AsyncClient() as http:
            for _ in range(n):
                if s.done:
                    break
                await pop._turn(http, s, None)

    with Sandbox(task) as box:
        s = AgentSession("s", task, box, max_turns=6)
        asyncio.run(run(s))
        return pop, s, s.verdict()


def test_refused_turns_are_retried_and_the_session_goes_on(replica) -> None:
    r, seen = replica([(503, QUEUE_FULL), (503, QUEUE_FULL), (429, QUEUE_FULL)])
    pop, s, v = _turns(r.url, retry_s=30, n=1)
    assert len(seen) == 4 and pop.stats.retries == 3 and pop.stats.errors == 0
    assert len(s.turns) == 1 and s.answered and not s.interrupted, (s.turns, s.abandoned)


def test_a_turn_refused_past_agent_retry_s_interrupts_the_session(replica) -> None:
    r, seen = replica([(503, QUEUE_FULL)] * 50)
    pop, s, v = _turns(r.url, retry_s=0, n=1)
    assert len(seen) == 1 and pop.stats.errors == 1
    assert s.abandoned == INTERRUPTED and s.interrupted and not s.turns


def test_an_interrupted_session_reports_its_tool_errors_but_no_outcome_or_rating(replica) -> None:
    """A call that failed on turn 1, then a 500 on turn 2 (sent, so not retried): the tool error
    reaches the loop, the outcome and any rating do not, whatever the user's dice."""
    bad_read = {
        "id": "c0",
        "type": "function",
        "function": {"name": "read_file", "arguments": json.dumps({"path": "missing.py"})},
    }
    r, seen = replica([(200, _completion(None, [bad_read])), (500, {"error": {"message": "boom"}})])
    pop, s, v = _turns(r.url, retry_s=30, n=3)
    assert len(seen) == 2 and pop.stats.retries == 0 and pop.stats.errors == 1
    assert s.interrupted and len(s.turns) == 1 and s.turns[0].error is not None
    assert v.gave_up, "by the session's own verdict it ended without an answer"
    for seed in range(20):  # every outcome and rating draw
        events = AgentUser("u", seed=seed).events(s, v)
        assert [e["type"] for e in events] == ["tool_error"], events
    # the same session, had the agent stopped there itself, reports that it gave up
    s.abandoned = "max_turns"
    kinds = {e["type"] for e in AgentUser("u", seed=0).events(s, v)}
    assert "session_outcome" in kinds
