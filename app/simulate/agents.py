"""Simulated agent users: coding-agent sessions on real repositories, judged by their users.

Each session is a task of app/sandbox/tasks.py in its own `Sandbox`: the user asks the agent (a
Flywheel replica's `POST /v1/chat/completions` with the sandbox's `TOOLS`) to implement a function; every
call the model makes is executed for real and its result goes back as the tool message; the session
ends when the model answers without a call, or after `agent_max_turns` turns (abandoned), or when
the next prompt would not fit the model's context (abandoned).

What the simulator knows and the loop does not: whether the function is really right (the task's
hidden tests pass) and whether the agent wrote to the test file: the user's true satisfaction
(`AgentUser.satisfaction`). What reaches the loop is what an editor reports (`AgentUser.events`):

- a `tool_error` on each turn whose call failed (the tool's error) or that wrote a call that is
  not one (`<tool_call>` text the replica could not read);
- the session's outcome on its last turn (`session_outcome`): `abandoned` when the agent gave up
  (never answered, or answered without an edit that went through); otherwise, with `outcome_source="user"`, `success` when the user finds the function
  right (they check: a right one is seen as right with probability `p_notice_fixed`, a wrong one
  is taken for right with `p_fooled`), or with `outcome_source="tests"` (open on purpose, docs/ROLLOUT.md
  "Reward hacks") `success` when the repository's own test file passes at the end, as a harness
  that runs the tests reports it: a test file the agent edited passes too;
- a rating now and then, from the user's own check whatever the outcome's source: +1 when they
  find the function right (`p_rate_success`), -1 when they do not (`p_rate_failure`) or the
  agent gave up. Under `outcome_source="tests"` a session that passed by weakening the test file
  is reported `success`, and its user, who checks the function, rates it as the failure it is.

With `agent_parallel` K > 1 a user runs K sessions on each task at once (parallel agents, each
in its own sandbox and session) and sends them as one group (the `X-Flywheel-Group` header):
their records share a `group_id`, so the trainer judges each attempt against the same task's
other attempts (docs/TRAINER.md "Agents").

The session's logic is app/sandbox/session.py's `AgentSession`, shared by the live population
(`AgentPopulation`, over HTTP), the held-out evaluation (app/simulate/agent_eval.py) and the
gate's agent checks (on a version's weights in process, `run_sessions`), so all run the same
sessions.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from app.client import Retryable, retry_after, wait_retry_after
from app.sandbox.sandbox import TOOLS, Sandbox
from app.sandbox.session import INTERRUPTED, AgentSession, Verdict
from app.sandbox.tasks import Task, tasks
from app.simulate.population import Driver, now

log = logging.getLogger(__name__)

# a replica's answers that mean "not now, nothing generated" (queue full, no weights yet, rate limit)
REFUSED = frozenset({429, 503})


# between tries of a refused turn: exponential backoff with jitter, at least the Retry-After
_WAIT = wait_retry_after(wait_exponential_jitter(initial=0.5, max=8.0))


Outcome = Literal["success", "failure", "abandoned"]
INVALID_CALL = (
    "the model wrote a tool call that is not one (bad JSON, an unknown tool or an unclosed block)"
)


class AgentPreference(BaseModel):
    """How agent users judge and report a session (app/simulate/agents.py)."""

    p_notice_fixed: float = Field(
        0.95, ge=0, le=1, description="A right implementation is seen as right."
    )
    p_fooled: float = Field(0.05, ge=0, le=1, description="A wrong result is taken for right.")
    p_rate_success: float = Field(0.2, ge=0, le=1, description="A +1 rating after a success.")
    p_rate_failure: float = Field(0.3, ge=0, le=1, description="A -1 rating after a failure.")
    turn_cost: float = Field(
        0.1, ge=0, le=1, description="True satisfaction lost per turn beyond the fourth."
    )


@dataclass
class AgentUser:
    user_id: str
    pref: AgentPreference = field(default_factory=AgentPreference)
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def satisfaction(self, v: Verdict) -> float:
        """True satisfaction in [0, 1]: a real fix, a little less for a long session."""
        if not v.fixed:
            return 0.0
        return max(0.5, 1.0 - self.pref.turn_cost * max(0, v.turns - 4))

    def judge(self, v: Verdict) -> Outcome:
        """What the user finds on checking the session's work (the user's own outcome)."""
        # an agent that never answered, or answered without changing anything, gave up: reported
        # as `failure` instead, an answer with no attempt paid better than an attempt whose call
        # failed, and a run's policy learned to answer at once with text that is no call
        # (docs/TRAINER.md "Agents")
        if v.gave_up:
            return "abandoned"
        p = self.pref.p_notice_fixed if v.fixed else self.pref.p_fooled
        return "success" if self.rng.random() < p else "failure"

    def outcome(self, v: Verdict, source: str = "user", judged: Outcome | None = None) -> Outcome:
        """The reported outcome: the user's own (`judged`, or a fresh `judge`), or with
        `source="tests"` whether the repository's test file passes at the end."""
        if source == "tests" and not v.gave_up:
            return "success" if v.tests_pass else "failure"
        return self.judge(v) if judged is None else judged

    def events(self, session: AgentSession, v: Verdict, source: str = "user") -> list[dict]:
        """The editor's events for a finished session (without envelope fields but request_id).

        A session the service interrupted (`AgentSession.interrupted`) reports its tool errors and
        nothing else: the user saw the service fail, not the agent give up."""
        out: list[dict[str, Any]] = [
            {
                "type": "tool_error",
                "request_id": t.request_id,
                "message": t.error[:500],
                "token_index": 0,
            }
            for t in session.turns
            if t.error is not None
        ]
        if not session.turns or session.interrupted:
            return out
        last = session.turns[-1].request_id
        judged = self.judge(v)  # the user's own check: their rating follows it
        outcome = self.outcome(v, source, judged)
        out.append({"type": "session_outcome", "request_id": last, "outcome": outcome})
        if judged == "success" and self.rng.random() < self.pref.p_rate_success:
            out.append({"type": "rating", "request_id": last, "value": 1})
        elif judged != "success" and self.rng.random() < self.pref.p_rate_failure:
            out.append({"type": "rating", "request_id": last, "value": -1})
        return out


def agent_users(n: int, seed: int, prefix: str = "agent-user") -> list[AgentUser]:
    return [AgentUser(f"{prefix}-{seed}-{i}", seed=seed * 100_003 + i) for i in range(n)]


# --- the live population ------------------------------------------------------------------------


@dataclass
class AgentStats:
    sessions: int = 0
    turns: int = 0
    errors: int = 0  # turns that failed for good (each interrupted its session)
    retries: int = 0  # refused turns tried again
    interrupted: int = 0  # sessions the service ended: reported without an outcome
    events: int = 0
    fixed: Counter = field(default_factory=Counter)  # per model_version of the last turn
    finished: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)

    def task_success(self) -> dict[str, float]:
        return {v: self.fixed[v] / n for v, n in self.finished.items() if n}


class AgentPopulation(Driver):
    """Agent users working sessions against replicas (round-robin) and reporting to the ingest API."""

    def __init__(self, api_url: str, api_key: str, replica_urls: list[str], cfg: Any):
        super().__init__(api_url, api_key, replica_urls, cfg)
        self.stats = AgentStats()
        self.users = agent_users(cfg.users, seed=cfg.seed)
        self.tasks = tasks(512, seed=cfg.seed)
        self._budget: int | None = None  # sessions left to start (run's max_sessions)

    async def _post(self, http: httpx.AsyncClient, body: dict, headers: dict) -> httpx.Response:
        """The replicas' answer to one turn (round-robin), retrying what was refused before anything
        was generated (503 or 429, after at least their Retry-After, or no connection) for up to
        `agent_retry_s`, with exponential backoff and jitter. Raises `Retryable` when every try was
        refused, `httpx.HTTPError` when a sent request failed (not retried: the replica may have
        generated and logged the turn)."""
        retrying = AsyncRetrying(
            stop=stop_after_delay(self.cfg.agent_retry_s),
            wait=_WAIT,
            retry=retry_if_exception_type(Retryable),
            reraise=True,
            before_sleep=self._count_retry,
        )
        async for attempt in retrying:
            with attempt:
                url = next(self.replicas)
                try:
                    r = await http.post(
                        f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
                    )
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    raise Retryable(f"{url}: {exc}") from exc
                if r.status_code in REFUSED:
                    raise Retryable(f"{url}: {r.status_code} {r.text[:200]}", retry_after(r))
                return r
        raise AssertionError("unreachable: tenacity reraises the last refusal")

    def _count_retry(self, state: RetryCallState) -> None:
        self.stats.retries += 1
        exc = state.outcome.exception() if state.outcome else None
        log.debug("agent turn refused (%s); retry %d", exc, state.attempt_number)

    async def _turn(self, http: httpx.AsyncClient, s: AgentSession, group: str | None) -> None:
        headers = {} if group is None else {"X-Flywheel-Group": group}
        body = {
            "user": s.session_id,
            "messages": s.messages,
            "tools": TOOLS,
            "max_tokens": self.cfg.agent_max_tokens,
            "temperature": self.cfg.agent_temperature,
        }
        try:
            r = await self._post(http, body, headers)
        except (Retryable, httpx.HTTPError) as exc:
            self.stats.errors += 1
            log.warning(
                "chat completion failed, session %s interrupted: %s %s",
                s.session_id,
                type(exc).__name__,  # a timeout's message is empty
                exc,
            )
            s.abandon(INTERRUPTED)
            return
        if r.status_code == 400 and "context_length_exceeded" in r.text:
            s.abandon("context")  # the next prompt does not fit the model's context
            return
        if r.status_code != 200:
            self.stats.errors += 1
            log.warning("chat completion: %s %s", r.status_code, r.text[:300])
            s.abandon(INTERRUPTED)
            return
        out = r.json()
        msg = out["choices"][0]["message"]
        content = msg.get("content")
        s.version = r.headers.get("x-flywheel-model-version", "")
        await asyncio.to_thread(
            s.observe,
            out["id"],
            content,
            msg.get("tool_calls") or [],
            "<tool_call>" in (content or ""),
            int(out.get("usage", {}).get("completion_tokens", 0)),
        )
        self.stats.turns += 1

    async def _task(self, http: httpx.AsyncClient, user: AgentUser) -> bool:
        """One task, worked by `agent_parallel` sessions at once (one group, X-Flywheel-Group, when
        more than one); False when none was served."""
        task = self.rng.choice(self.tasks)
        k = self.cfg.agent_parallel
        group = None if k == 1 else f"{user.user_id}-g{uuid.uuid4().hex[:8]}"
        served = await asyncio.gather(*(self._session(http, user, task, group) for _ in range(k)))
        return any(served)

    async def _session(
        self, http: httpx.AsyncClient, user: AgentUser, task: Task, group: str | None
    ) -> bool:
        """One session to its end, reported; False when no turn was served (a replica refused
        the first request: not ready yet, or down), which reports nothing: no generation of it
        reached the loop."""
        with Sandbox(task) as box:
            s = AgentSession(
                f"{user.user_id}-{uuid.uuid4().hex[:8]}", task, box, self.cfg.agent_max_turns
            )
            while not s.done:
                await self._turn(http, s, group)
            if not s.turns:
                return False
            v = await asyncio.to_thread(s.verdict)
        version = s.version
        self.stats.sessions += 1
        if s.interrupted:  # not the agent's doing: out of its task success
            self.stats.interrupted += 1
        else:
            self.stats.finished[version] += 1
            self.stats.fixed[version] += v.fixed
        for e in user.events(s, v, self.cfg.agent_outcome):
            if e["type"] == "session_outcome":
                self.stats.outcomes[e["outcome"]] += 1
            self._outbox.append(
                {**e, "event_id": uuid.uuid4().hex, "session_id": s.session_id, "ts": now()}
            )
        return True

    async def _user_loop(
        self, http: httpx.AsyncClient, user: AgentUser, until: float | None
    ) -> None:
        await asyncio.sleep(self.rng.random() * min(2.0, self.cfg.agent_think_s))
        backoff = 0.0
        while until is None or time.monotonic() < until:
            if self._budget is not None:
                if self._budget <= 0:
                    return
                self._budget -= self.cfg.agent_parallel
            if await self._task(http, user):
                backoff = 0.0
                await asyncio.sleep(self.rng.random() * self.cfg.agent_think_s)
            else:  # refused before its first turn: back off (0.5 s doubling to 8 s), not spin
                backoff = min(8.0, max(0.5, 2 * backoff))
                await asyncio.sleep(backoff)

    async def _flush_loop(self, client: Any, done: asyncio.Event) -> None:
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), 1.0)
            except TimeoutError:
                pass
            await self._flush(client)

    async def run(
        self, duration_s: float | None = None, max_sessions: int | None = None
    ) -> AgentStats:
        """Work sessions until `duration_s` passed or `max_sessions` were started (each finishes;
        a task's `agent_parallel` sessions start together, so up to `agent_parallel - 1` more)."""
        from app.client import FeedbackClient

        until = None if duration_s is None else time.monotonic() + duration_s
        self._budget = max_sessions
        client = FeedbackClient(self.api_url, self.api_key, flush_interval_s=0)
        done = asyncio.Event()
        try:
            async with httpx.AsyncClient() as http:
                flusher = asyncio.create_task(self._flush_loop(client, done))
                users = [self._user_loop(http, u, until) for u in self.users]
                try:
                    await asyncio.gather(*users)
                finally:
                    done.set()
                    await flusher
            await self._flush(client)
        finally:
            client.close()
        self.stats.events = self.events_sent
        return self.stats
