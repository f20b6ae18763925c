"""An agent session on a sandboxed task: the chat, its turns, the calls executed, and the verdict.

    session = AgentSession("s-1", task, box, max_turns=6)   # box: an open Sandbox of the task
    session.observe(request_id, content, tool_calls, invalid, completion_tokens)  # one model turn
    session.verdict()   # what really happened: fixed? tests edited? turns, tool errors, ...
    run_sessions(policy, sessions, max_tokens=128)  # every session to its end, on a policy in process

`observe` takes a turn as an OpenAI chat completion's message gives it (`tool_calls` entries with
their `arguments` JSON text), runs each call in the sandbox and appends the results as tool
messages, so `messages` is the history a client sends back. The session ends when the model
answers without a call, after `max_turns` turns (abandoned) or when a driver abandons it (the next
prompt does not fit the context). The drivers: the simulator's users over a replica's HTTP API
(app/simulate/agents.py), and `run_sessions` on a policy in process, which renders the prompt with
the model's chat template and reads the calls with its tool-call format exactly as a replica
does (the held-out evaluation, app/simulate/agent_eval.py, and the gate's agent checks,
app/controller/monitors.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.sandbox.sandbox import TOOL_NAMES, TOOLS, Sandbox
from app.sandbox.tasks import Task

INVALID_CALL = (
    "the model wrote a tool call that is not one (bad JSON, an unknown tool or an unclosed block)"
)


@dataclass
class Turn:
    """One assistant turn: its generation's request id and what came of it."""

    request_id: str
    calls: list[str] = field(default_factory=list)  # tool names called
    error: str | None = None  # a failed call's error, or INVALID_CALL
    completion_tokens: int = 0


# why a session ended when a replica could not serve a turn (app/simulate/agents.py)
INTERRUPTED = "service_error"


@dataclass
class AgentSession:
    """One agent session on one task: the chat so far, its turns, and how it ended."""

    session_id: str
    task: Task
    box: Sandbox
    max_turns: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    answered: bool = False  # the model answered without a call
    abandoned: str | None = None  # why the session ended without an answer
    version: str = ""  # the model version of the last turn (live sessions)

    def __post_init__(self) -> None:
        self.messages = [{"role": "user", "content": self.task.instruction}]

    @property
    def done(self) -> bool:
        return self.answered or self.abandoned is not None

    def observe(
        self,
        request_id: str,
        content: str | None,
        calls: list[dict[str, Any]],
        invalid: bool,
        completion_tokens: int = 0,
    ) -> None:
        """The model's turn: `calls` are OpenAI `tool_calls` entries, `invalid` whether the turn wrote
        text that is not a call. Runs the calls in the sandbox and appends their results."""
        turn = Turn(request_id, [c["function"]["name"] for c in calls], None, completion_tokens)
        self.turns.append(turn)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = calls
        self.messages.append(message)
        if invalid:
            turn.error = INVALID_CALL
        for call in calls:
            result = self.box.call(call["function"]["name"], call["function"]["arguments"])
            if result.error and turn.error is None:
                turn.error = result.error
            self.messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": result.content}
            )
        if not calls and not invalid:
            self.answered = True
        elif len(self.turns) >= self.max_turns:
            self.abandoned = "max_turns"

    def abandon(self, why: str) -> None:
        self.abandoned = why

    @property
    def interrupted(self) -> bool:
        """The service ended the session (a turn it could not serve), not the agent."""
        return self.abandoned == INTERRUPTED

    # --- the ground truth, read at the end --------------------------------------------------------
    def verdict(self) -> Verdict:
        """What really happened (read once the session is done; runs the tests)."""
        return Verdict(
            fixed=self.box.hidden_pass() and not self.box.tests_edited(),
            tests_pass=self.box.run_tests()[0],
            tests_edited=self.box.tests_edited(),
            answered=self.answered,
            turns=len(self.turns),
            tool_errors=sum(t.error is not None for t in self.turns),
            invalid_calls=sum(t.error == INVALID_CALL for t in self.turns),
            completion_tokens=sum(t.completion_tokens for t in self.turns),
            edits=len(self.box.edited),
        )


@dataclass(frozen=True)
class Verdict:
    fixed: bool  # the hidden tests pass and the test file is as it was
    tests_pass: bool  # the repository's own test file passes (as the agent may have left it)
    tests_edited: bool
    answered: bool
    turns: int
    tool_errors: int  # turns with a failed or invalid call
    invalid_calls: int
    completion_tokens: int
    edits: int

    @property
    def gave_up(self) -> bool:
        """Ended without an edit, or without answering."""
        return not self.answered or self.edits == 0


def run_sessions(
    policy: Any,
    sessions: list[AgentSession],
    max_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    on_sample: Any = None,
) -> None:
    """Run `sessions` to their end on `policy` in process, all of a turn in one batch.
    `on_sample(session, prompt_ids, sample)` sees each turn's prompt and sample before the session
    observes it (bench/agent_rl.py trains on them)."""
    import torch

    from policy.tool_format import tool_format_for

    tok = policy.tokenizer
    fmt = tool_format_for(tok)
    assert fmt is not None, f"tokenizer {tok.name} has no tool-call format"
    ctx = int(policy.config_dict().get("max_context") or 0)
    step = 0
    while active := [s for s in sessions if not s.done]:
        batch, live = [], []
        for s in active:
            ids = tok.encode(tok.apply_chat_template(s.messages, TOOLS))
            if ctx and len(ids) + 1 + max_tokens > ctx:  # as a replica refuses it
                s.abandon("context")
                continue
            batch.append(ids)
            live.append(s)
        if not batch:
            break
        with torch.no_grad():
            samples = policy.generate(
                batch, max_tokens=max_tokens, temperature=temperature, seed=seed + step
            )
        for s, ids, sample in zip(live, batch, samples):
            if on_sample is not None:
                on_sample(s, ids, sample)
            reader = fmt.reader(TOOL_NAMES)
            outs = [reader.feed(sample.text), reader.finish()]
            content = "".join(o.content for o in outs)
            calls = [
                {
                    "id": f"call_{len(s.turns)}_{i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for i, c in enumerate(c for o in outs for c in o.calls)
            ]
            invalid = any(o.invalid for o in outs)
            s.observe(f"{s.session_id}-{len(s.turns)}", content, calls, invalid, len(sample.tokens))
        step += 1
