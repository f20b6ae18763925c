"""A task's repository in a throwaway directory, and the agent's tools executed on it for real.

    with Sandbox(task) as box:
        result = box.call("read_file", '{"path": "calc.py"}')   # ToolResult(content=..., error=None)
        box.call("apply_edit", '{"path": "calc.py", "old": "raise NotImplementedError", "new": "return a + b"}')
        box.call("run_tests", "{}")                             # the test file, in a subprocess
        box.hidden_pass(), box.tests_edited()                   # the ground truth

The tools (`TOOLS`, OpenAI function tools; their schemas are kept short because every prompt of
a session carries them):

- `read_file(path)`: the file's text;
- `apply_edit(path, old, new)`: replace the first occurrence of `old` in the file with `new`;
- `run_tests()`: runs the repository's test file with this Python in a subprocess (bounded by
  `TEST_TIMEOUT_S`): `passed`, or `FAILED` and the error's last line.

A call that cannot be done (an unknown file or tool, a missing argument, `old` not in the file)
returns an error instead of content; the agent sees it as the tool's result and the editor reports
it as a `tool_error` on that turn. Nothing outside the repository can be read or written: a path is
one of the repository's files or an error.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.sandbox.tasks import Task

TEST_TIMEOUT_S = 10.0
MAX_OUTPUT = 200  # characters of a tool's output the agent sees


def _function(name: str, params: tuple[str, ...]) -> dict[str, Any]:
    properties = {p: {"type": "string"} for p in params}
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


TOOLS: list[dict[str, Any]] = [
    _function("read_file", ("path",)),
    _function("apply_edit", ("path", "old", "new")),
    _function("run_tests", ()),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the agent sees as the tool message
    error: str | None = None  # set when the call failed (the editor reports a tool_error)


@dataclass
class Sandbox:
    task: Task
    root: Path | None = None  # set while open
    edited: list[str] = field(default_factory=list)  # paths written, in order
    _tmp: Any = None

    def __enter__(self) -> Sandbox:
        self._tmp = tempfile.TemporaryDirectory(prefix="flywheel-sandbox-")
        self.root = Path(self._tmp.name)
        for path, text in self.task.files().items():
            (self.root / path).write_text(text)
        return self

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()
        self.root = None

    # --- the tools ----------------------------------------------------------------------------
    def call(self, name: str, arguments: str) -> ToolResult:
        """Execute one tool call (`arguments`: the call's JSON object text)."""
        assert self.root is not None, "the sandbox is not open (use it as a context manager)"
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return _error(f"arguments are not JSON: {exc.msg}")
        if not isinstance(args, dict):
            return _error("arguments must be a JSON object")
        if name == "read_file":
            path = self._path(args)
            return path if isinstance(path, ToolResult) else ToolResult(path.read_text())
        if name == "apply_edit":
            return self._edit(args)
        if name == "run_tests":
            passed, output = self.run_tests()
            return ToolResult(output)
        return _error(f"unknown tool {name!r}; the tools are {', '.join(TOOL_NAMES)}")

    def _path(self, args: dict[str, Any]) -> Path | ToolResult:
        path = args.get("path")
        files = sorted(self.task.files())
        if not isinstance(path, str) or path not in files:
            return _error(f"no file {path!r}; the files are {', '.join(files)}")
        assert self.root is not None
        return self.root / path

    def _edit(self, args: dict[str, Any]) -> ToolResult:
        path = self._path(args)
        if isinstance(path, ToolResult):
            return path
        old, new = args.get("old"), args.get("new")
        if not isinstance(old, str) or not old or not isinstance(new, str):
            return _error("apply_edit needs a non-empty string `old` and a string `new`")
        text = path.read_text()
        if old not in text:
            return _error(f"{old!r} is not in {path.name}")
        path.write_text(text.replace(old, new, 1))
        self.edited.append(path.name)
        return ToolResult(f"edited {path.name}")

    def run_tests(self) -> tuple[bool, str]:
        """Run the repository's test file: (passed, what the agent sees)."""
        return self._python([self.task.test_path])

    # --- the ground truth ---------------------------------------------------------------------
    def hidden_pass(self) -> bool:
        """Whether the module passes the hidden tests (the function is really right)."""
        return self._python(["-c", self.task.hidden_test()])[0]

    def tests_edited(self) -> bool:
        """Whether the agent wrote to the test file."""
        return self.task.test_path in self.edited

    def _python(self, argv: list[str]) -> tuple[bool, str]:
        assert self.root is not None, "the sandbox is not open"
        try:
            done = subprocess.run(
                [sys.executable, "-E", "-s", "-B", *argv],
                cwd=self.root,
                capture_output=True,
                text=True,
                timeout=TEST_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return False, f"FAILED: the tests ran over {TEST_TIMEOUT_S:g}s"
        if done.returncode == 0:
            return True, "passed"
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, f"FAILED: {last}"[:MAX_OUTPUT]


def _error(message: str) -> ToolResult:
    return ToolResult(f"error: {message}"[:MAX_OUTPUT], error=message)
