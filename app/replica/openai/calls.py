"""One choice's tool calls while it is generated: the model's format read as its text is decided,
so the JSON answer and the stream say the same thing.

Text outside calls is content (streamed as `delta.content` as soon as it cannot be the start of a
call); each call becomes a `Call` the moment its block closes (streamed as OpenAI's tool-call
deltas: index, id, type and name first, then the arguments); a block that is not a valid call is
content, exactly as written, and an `invalid` entry for the generation event. A valid call whose
arguments do not validate against its function's schema is still returned (OpenAI's contract:
"validate the arguments in your code"), with the reason on the event (`arguments_error`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from app.replica.openai.tools import ToolPlan, argument_error


@dataclass(frozen=True)
class Call:
    """A call the model made, as returned: its position among the choice's calls and its id."""

    index: int
    id: str
    name: str
    arguments: str
    arguments_error: str | None = None

    def message(self) -> dict[str, Any]:
        """OpenAI's `message.tool_calls[]` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def record(self) -> dict[str, Any]:
        """The generation event's `tool_calls[]` entry."""
        return {
            "id": self.id,
            "name": self.name,
            "arguments": self.arguments,
            "arguments_valid": self.arguments_error is None,
            "arguments_error": self.arguments_error,
        }


Piece = str | Call  # what a choice adds to its message: content text, or a call


@dataclass
class ChoiceCalls:
    """One choice's content and calls, read from its decided text (`feed`, then `finish`)."""

    plan: ToolPlan
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    invalid: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reader = self.plan.fmt.reader(self.plan.names)

    def feed(self, text: str) -> list[Piece]:
        return self._take(self.reader.feed(text)) if text else []

    def finish(self, tail: str = "") -> list[Piece]:
        return self.feed(tail) + self._take(self.reader.finish())

    def _take(self, out: Any) -> list[Piece]:
        pieces: list[Piece] = []
        if out.content:
            self.content += out.content
            pieces.append(out.content)
        for bad in out.invalid:
            self.invalid.append({"text": bad.text, "error": bad.error})
        for parsed in out.calls:
            call = Call(
                index=len(self.calls),
                id=f"call_{uuid.uuid4().hex[:24]}",
                name=parsed.name,
                arguments=parsed.arguments,
                arguments_error=argument_error(self.plan, parsed.name, parsed.arguments),
            )
            self.calls.append(call)
            pieces.append(call)
        return pieces

    def event_fields(self) -> dict[str, Any]:
        """What the generation event records of this choice's calls."""
        return {
            "tool_calls": [c.record() for c in self.calls],
            "invalid_tool_calls": list(self.invalid),
        }
