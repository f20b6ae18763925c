"""A small coding agent on a Flywheel replica, reporting how it went as feedback.

It copies a repository (by default ./sample_repo: a module with a bug and a test that fails) into
a temporary directory and works on the copy through four tools, one call per turn:

    read_file(path)              a file of the copy (the paths are the schema's enum)
    apply_edit(path, old, new)   replace the one occurrence of `old` in a file with `new`
    run_tests()                  pytest on the copy: its exit code and output
    finish(summary)              the agent is done

The model is any Flywheel replica's, through its OpenAI-compatible chat completions with
`tool_choice: "required"` (every turn is a call; `finish` ends the run) or `"auto"` (a text answer
ends it too). Every completion is logged by the replica as a generation event; this agent sends
the feedback that turns them into rewards, through Flywheel's `FeedbackClient` (app/client.py) to
the ingest API:

- `tool_error` on the completion whose call failed (an edit whose text is not in the file, an
  unknown file or tool, arguments that are not JSON, a call cut off by max_tokens), with the
  error as the message; the call is the completion's only content, so `token_index` is 0;
- at the end the agent runs the tests itself and sends the session's outcome (`session_outcome`,
  naming its last completion): `success` when they pass, `failure` when they do not after it
  called `finish`, `abandoned` when it ran out of turns first. The streams worker makes the
  session's turns one trajectory, and the outcome its return (docs/AGENTS.md "Sessions").

    python examples/agent/agent.py --replica http://127.0.0.1:8100 --api http://127.0.0.1:8000

examples/agent/README.md has the options; tests/integration/clients/test_agent_example.py runs
`run_agent` against a real replica and ingest API.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from app.client import FeedbackClient

SAMPLE_REPO = Path(__file__).resolve().parent / "sample_repo"
TASK = (
    "The tests of this repository fail. Read the code, fix the bug with apply_edit, check your "
    "fix with run_tests, then call finish with a one-line summary."
)
SYSTEM = "You are a careful coding agent. You act only through the tools, one call per turn."
MAX_TEXT = 120  # the longest `old`, `new` or `summary` a call may carry (JSON Schema maxLength)
MAX_OUTPUT = 2000  # a tool's output is cut to its last MAX_OUTPUT characters for the prompt
SKIP = {"__pycache__", ".pytest_cache", ".git"}


class ToolError(Exception):
    """A call the agent could not carry out; the message goes back to the model and to Flywheel."""


@dataclass
class TestRun:
    passed: bool
    output: str


class Workspace:
    """The tools, over a copy of a repository."""

    def __init__(self, source: Path, root: Path):
        shutil.copytree(source, root, ignore=shutil.ignore_patterns(*SKIP))
        self.root = root

    def files(self) -> list[str]:
        return sorted(
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*")
            if p.is_file() and not SKIP & set(p.relative_to(self.root).parts)
        )

    def _path(self, path: str) -> Path:
        if path not in self.files():
            raise ToolError(f"no file {path!r} in the repository")
        return self.root / path

    def read_file(self, path: str) -> str:
        return self._path(path).read_text()

    def apply_edit(self, path: str, old: str, new: str) -> str:
        file = self._path(path)
        text = file.read_text()
        count = text.count(old) if old else 0
        if count != 1:
            where = "is empty" if not old else f"occurs {count} times in {path}, not once"
            raise ToolError(f"apply_edit: the text to replace {where}")
        file.write_text(text.replace(old, new, 1))
        return f"replaced 1 occurrence in {path}"

    def run_tests(self) -> TestRun:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider"],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return TestRun(proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}")


def tools(files: list[str]) -> list[dict[str, Any]]:
    """The four tools as OpenAI function tools; paths are an enum of the repository's files."""
    path = {"type": "string", "enum": files, "description": "a file of the repository"}
    text = {"type": "string", "maxLength": MAX_TEXT}

    def fn(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
        parameters = {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        }
        return {
            "type": "function",
            "function": {"name": name, "description": description, "parameters": parameters},
        }

    return [
        fn("read_file", "Read a file of the repository.", {"path": path}),
        fn(
            "apply_edit",
            "Replace the one occurrence of `old` in a file with `new`.",
            {"path": path, "old": {**text, "minLength": 1}, "new": text},
        ),
        fn("run_tests", "Run the repository's tests (pytest); returns their output.", {}),
        fn("finish", "Stop: the work is done.", {"summary": text}),
    ]


@dataclass
class Step:
    """One turn: the completion (its request_id), the call it made and what came of it."""

    turn: int
    request_id: str
    tool: str | None  # None: the completion made no call
    arguments: dict[str, Any] | None
    output: str | None = None
    error: str | None = None


@dataclass
class Outcome:
    session_id: str
    workdir: Path
    steps: list[Step] = field(default_factory=list)
    finished: bool = False  # `finish` was called (or, under tool_choice auto, a text answer)
    tests: TestRun | None = None  # the agent's own test run at the end
    feedback: list[str] = field(default_factory=list)  # the event ids sent


def _call(ws: Workspace, name: str, args: dict[str, Any]) -> str:
    if name == "read_file":
        return ws.read_file(args.get("path", ""))
    if name == "apply_edit":
        return ws.apply_edit(args.get("path", ""), args.get("old", ""), args.get("new", ""))
    if name == "run_tests":
        return ws.run_tests().output
    if name == "finish":
        return "finished"
    raise ToolError(f"unknown tool {name!r}")


def run_agent(
    client: openai.OpenAI,
    feedback: FeedbackClient | None,
    *,
    model: str,
    repo: Path = SAMPLE_REPO,
    workdir: Path | None = None,
    max_turns: int = 8,
    max_tokens: int = 256,
    tool_choice: str = "required",
    session_id: str | None = None,
    seed: int | None = None,
) -> Outcome:
    """Work on a copy of `repo` (in `workdir`, a new temporary directory when None) for at most
    `max_turns` completions; send the feedback through `feedback` (none when None)."""
    session_id = session_id or f"agent-{uuid.uuid4().hex[:12]}"
    workdir = workdir or Path(tempfile.mkdtemp(prefix="flywheel-agent-")) / repo.name
    ws = Workspace(repo, workdir)
    out = Outcome(session_id, workdir)
    offered = tools(ws.files())
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{TASK}\nFiles: {', '.join(ws.files())}"},
    ]
    extra = {} if seed is None else {"seed": seed}
    for turn in range(max_turns):
        resp = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=offered,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=max_tokens,
            user=session_id,
            **extra,
        )
        choice = resp.choices[0]
        message = choice.message.model_dump(exclude_none=True, exclude={"refusal", "annotations"})
        messages.append(message)
        calls = choice.message.tool_calls or []
        if not calls:
            step = Step(turn, resp.id, None, None, output=choice.message.content or "")
            out.steps.append(step)
            if choice.finish_reason == "length":  # the call did not fit in max_tokens
                step.error = "the completion ended (max_tokens) before its tool call was complete"
                _tool_error(feedback, out, step)
                messages.append({"role": "user", "content": f"Error: {step.error}. Call a tool."})
                continue
            out.finished = True  # a text answer (tool_choice auto) ends the run
            break
        for call in calls:
            step = Step(turn, resp.id, call.function.name, None)
            out.steps.append(step)
            try:
                step.arguments = json.loads(call.function.arguments)
                if not isinstance(step.arguments, dict):
                    raise ToolError("the arguments are not a JSON object")
                step.output = _call(ws, call.function.name, step.arguments)
            except (ToolError, ValueError) as exc:
                step.error = str(exc)
                _tool_error(feedback, out, step)
            content = step.output if step.error is None else f"Error: {step.error}"
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": content[-MAX_OUTPUT:]}
            )
        if any(s.tool == "finish" and s.error is None for s in out.steps if s.turn == turn):
            out.finished = True
            break
    out.tests = ws.run_tests()
    if feedback is not None and out.steps:
        outcome = "success" if out.tests.passed else "failure" if out.finished else "abandoned"
        out.feedback.append(feedback.session_outcome(out.steps[-1].request_id, session_id, outcome))
        feedback.flush()
    return out


def _tool_error(feedback: FeedbackClient | None, out: Outcome, step: Step) -> None:
    if feedback is not None:
        out.feedback.append(
            feedback.tool_error(
                step.request_id, out.session_id, message=step.error[:4096], token_index=0
            )
        )


def _ingest_key(given: str | None) -> str | None:
    """--ingest-key, else $FLYWHEEL_INGEST_KEY, else `make run`'s .flywheel/local-keys.json."""
    if given or os.environ.get("FLYWHEEL_INGEST_KEY"):
        return given or os.environ["FLYWHEEL_INGEST_KEY"]
    keys = Path(os.environ.get("FLYWHEEL_DATA_DIR", ".flywheel")) / "local-keys.json"
    return json.loads(keys.read_text()).get("ingest") if keys.exists() else None


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica", default=env("FLYWHEEL_REPLICA_URL", "http://127.0.0.1:8100"))
    p.add_argument("--replica-key", default=env("FLYWHEEL_REPLICA_API_KEY", "unused"))
    p.add_argument("--api", default=env("FLYWHEEL_API_URL", "http://127.0.0.1:8000"))
    p.add_argument("--ingest-key", default=None, help="an ingest-scoped key; none: no feedback")
    p.add_argument("--model", default=None, help="the served model (default: the replica's)")
    p.add_argument("--repo", type=Path, default=SAMPLE_REPO)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="per completion (the replica's default cap is 256)",
    )
    p.add_argument("--tool-choice", choices=["required", "auto"], default="required")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)

    client = openai.OpenAI(base_url=f"{args.replica.rstrip('/')}/v1", api_key=args.replica_key)
    model = args.model or client.models.list().data[0].id
    key = _ingest_key(args.ingest_key)
    if key is None:
        print("no ingest key (--ingest-key, FLYWHEEL_INGEST_KEY): no feedback is sent")
    feedback = FeedbackClient(args.api, key) if key else None
    try:
        out = run_agent(
            client,
            feedback,
            model=model,
            repo=args.repo,
            max_turns=args.max_turns,
            max_tokens=args.max_tokens,
            tool_choice=args.tool_choice,
            seed=args.seed,
        )
    finally:
        if feedback is not None:
            feedback.close()
    for s in out.steps:
        what = s.error and f"error: {s.error}" or (s.output or "").strip().splitlines()[-1:]
        print(f"turn {s.turn} {s.request_id} {s.tool}({json.dumps(s.arguments)}) -> {what}")
    print(f"session {out.session_id}; the copy is in {out.workdir}")
    print(out.tests.output.strip().splitlines()[-1])
    print(f"tests {'pass' if out.tests.passed else 'fail'}; {len(out.feedback)} feedback events")
    return 0 if out.tests.passed else 1


if __name__ == "__main__":
    sys.exit(main())
