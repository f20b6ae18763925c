"""Tool-call formats: how a model family writes tool calls in its completions, and how the replica
reads them back out of the generated text.

A format is a small seam with a factory, as vLLM's tool parsers are: `tool_format_for(tokenizer)`
picks the format of a model's family, `ToolFormat.reader(tool_names)` reads one completion
incrementally (the same reader serves the JSON answer and the stream, so both say the same), and
`ToolFormat.grammar(tools, choice, parallel)` is the grammar that constrained decoding
(policy/constrain.py) holds a required or named call to.

**Hermes** (`hermes`; Qwen2.5, Hermes, the built-in policy): each call is a JSON object between
tags, several calls one after another, then eos:

    <tool_call>
    {"name": "read_file", "arguments": {"path": "app.py"}}
    </tool_call>

A block is a **valid call** when its body parses as one JSON object with a string `name` naming
one of the request's tools and an object `arguments`; its `arguments` are returned as the JSON
text of that object (`json.dumps`, separators `", "` and `": "`). Anything else between the tags
(bad JSON, an unknown function, an unterminated block at the end) is an **invalid call**: it is
never repaired, its raw text stays in the message's content, and it is reported so the generation
event records it. Whitespace between blocks, and between the content and a block, is the format's,
not content.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_INVALID_TEXT = 4096  # characters of an invalid call's raw text kept for its report


@dataclass(frozen=True)
class ParsedCall:
    """A call the model made: its function name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class InvalidCall:
    """Text between a format's tags that is not a valid call, and why."""

    text: str
    error: str


@dataclass
class ReadOut:
    """What one piece of generated text turned out to be, in order: content text, calls, and
    invalid calls (whose raw text is also in `content`)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    invalid: list[InvalidCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls or self.invalid)


class ToolReader(ABC):
    """Reads one completion's text as it is decided (`feed`), then `finish` at its end."""

    @abstractmethod
    def feed(self, text: str) -> ReadOut:
        """Take the next decided piece of text; what is now known."""

    @abstractmethod
    def finish(self) -> ReadOut:
        """The completion ended: whatever is still held back."""


class ToolFormat(ABC):
    """One model family's tool-call format."""

    name: str

    @abstractmethod
    def reader(self, tool_names: Iterable[str]) -> ToolReader:
        """A reader for one completion of a request offering the functions `tool_names`."""

    @abstractmethod
    def grammar(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool) -> str:
        """The constrained-decoding grammar of a call to one of `tools` (`choice`: that function
        only), one or, with `parallel`, several (policy/constrain.py compiles it)."""

    @abstractmethod
    def render_call(self, name: str, arguments: str) -> str:
        """A call as the model writes it (the built-in chat template renders history with it)."""


class HermesFormat(ToolFormat):
    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def reader(self, tool_names: Iterable[str]) -> ToolReader:
        return _HermesReader(self, frozenset(tool_names))

    def grammar(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool) -> str:
        from policy.constrain import tool_call_grammar

        return tool_call_grammar(
            tools,
            choice,
            parallel,
            open_tag=self.open_tag + "\n",
            close_tag="\n" + self.close_tag,
        )

    def render_call(self, name: str, arguments: str) -> str:
        return f'{self.open_tag}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{self.close_tag}'


def dump_arguments(args: dict[str, Any]) -> str:
    """The JSON text of a call's arguments, as the replica returns it."""
    return json.dumps(args, ensure_ascii=False)


def parse_call(body: str, tool_names: frozenset[str]) -> ParsedCall | InvalidCall:
    """A Hermes block's body as a call, or why it is not one."""
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return InvalidCall(body[:MAX_INVALID_TEXT], f"not JSON: {exc}")
    if not isinstance(obj, dict):
        return InvalidCall(body[:MAX_INVALID_TEXT], "not a JSON object")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str):
        return InvalidCall(body[:MAX_INVALID_TEXT], "no string `name`")
    if name not in tool_names:
        return InvalidCall(body[:MAX_INVALID_TEXT], f"unknown function {name[:100]!r}")
    if not isinstance(args, dict):
        return InvalidCall(body[:MAX_INVALID_TEXT], "`arguments` is not a JSON object")
    return ParsedCall(name, dump_arguments(args))


class _HermesReader(ToolReader):
    """Content until an open tag (text that may be the start of one, and trailing whitespace,
    held back), then the block until its close tag, then content again."""

    def __init__(self, fmt: HermesFormat, tool_names: frozenset[str]) -> None:
        self.fmt, self.tool_names = fmt, tool_names
        self.buf = ""  # decided text not yet classified
        self.in_block = False
        self.any_block = False  # a block was seen: whitespace around blocks is the format's

    def feed(self, text: str) -> ReadOut:
        self.buf += text
        out = ReadOut()
        while True:
            if self.in_block:
                end = self.buf.find(self.fmt.close_tag)
                if end < 0:
                    return out
                self._block(self.buf[:end], out)
                self.buf = self.buf[end + len(self.fmt.close_tag) :]
                self.in_block = False
                continue
            start = self.buf.find(self.fmt.open_tag)
            if start >= 0:
                self._content(self.buf[:start].rstrip(), out)
                self.buf = self.buf[start + len(self.fmt.open_tag) :]
                self.in_block = self.any_block = True
                continue
            keep = _partial_suffix(self.buf, self.fmt.open_tag)
            decided = self.buf[: len(self.buf) - keep]
            ws = len(decided) - len(decided.rstrip())  # whitespace may precede a block
            self._content(decided[: len(decided) - ws], out)
            self.buf = self.buf[len(decided) - ws :]
            return out

    def finish(self) -> ReadOut:
        out = ReadOut()
        if self.in_block:
            raw = self.fmt.open_tag + self.buf
            out.invalid.append(InvalidCall(raw[:MAX_INVALID_TEXT], "unterminated tool call"))
            out.content += raw
        elif not self.any_block:
            out.content += self.buf  # a plain answer keeps its text exactly
        else:
            self._content(self.buf.rstrip(), out)
        self.buf, self.in_block = "", False
        return out

    def _content(self, text: str, out: ReadOut) -> None:
        if self.any_block:
            text = text.lstrip()  # the whitespace after a block
        out.content += text

    def _block(self, body: str, out: ReadOut) -> None:
        got = parse_call(body.strip(), self.tool_names)
        if isinstance(got, ParsedCall):
            out.calls.append(got)
        else:
            out.invalid.append(got)
            out.content += self.fmt.open_tag + body + self.fmt.close_tag


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat}


def make_format(name: str) -> ToolFormat:
    """The format called `name` (ValueError naming the known ones otherwise)."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(FORMATS)}") from None


def tool_format_for(tokenizer: Any) -> ToolFormat | None:
    """The tool-call format of a model's family, from its tokenizer, or None when its chat template
    offers no tool format Flywheel reads: the built-in tokenizer writes Hermes calls (its
    template, policy/tokenizer.py); a Hugging Face chat template that writes `<tool_call>` blocks
    is Hermes (Qwen2.5, Hermes, and the models fine-tuned from them)."""
    name = getattr(tokenizer, "tool_format_name", None)
    if name is not None:
        return make_format(name)
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
    if isinstance(template, str) and HermesFormat.open_tag in template:
        return HermesFormat()
    return None
