"""What a completion is as an edit: a valid tool call, a broken one, or no edit at all.

One definition, shared by the simulated users (app/simulate/users.py, which react to it) and
the gate's monitors (app/controller/monitors.py, which count it), so the monitor measures
exactly what the users see. Imports nothing from any role.

    classify("return a + b\\n")          # -> "edit"
    classify("return f(x")              # -> "broken"   (the edit does not apply: it won't parse)
    classify("# which bound is inclusive?")  # -> "no_edit"  (a question or remark, no code)
    classify("'Clamp to [lo, hi]?'")    # -> "no_edit"  (a lone docstring)
    classify("")                        # -> "empty"

- `broken`: brackets or quotes of the code do not balance (the tool call that carries the edit
  fails to parse). Comments (from `#` outside a string to the end of the line) are not code.
- `no_edit`: text that parses but holds no code, only comments and string literals (a
  docstring): a clarifying question or a remark instead of an edit. The byte-level policy's
  form of "ask instead of edit" (the pretrained base writes a lone docstring ~7% of the time,
  so a reward that pays for it can be found by sampling; a lone comment it almost never writes).
- `empty`: nothing but whitespace.

`is_valid` (not broken) and `is_no_edit` (empty, or only comments and strings: nothing to apply) are the
rates the gate compares between candidate and champion.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["empty", "no_edit", "broken", "edit"]
_CLOSE = {")": "(", "]": "[", "}": "{"}


def balanced(text: str) -> bool:
    """Brackets and quotes of `text` balance; `#` outside a string comments out the rest of its line."""
    stack: list[str] = []
    quote: str | None = None
    comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
            continue
        if quote:
            if ch == quote:
                quote = None
            continue
        if ch == "#":
            comment = True
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in _CLOSE:
            if not stack or stack.pop() != _CLOSE[ch]:
                return False
    return not stack and quote is None


def has_code(text: str) -> bool:
    """Some non-blank character of `text` lies outside every comment and string literal."""
    quote: str | None = None
    comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
        elif quote:
            quote = None if ch == quote else quote
        elif ch == "#":
            comment = True
        elif ch in "\"'":
            quote = ch
        elif not ch.isspace():
            return True
    return False


def classify(text: str) -> Kind:
    """Empty, broken (won't parse), no edit (only comments and strings), or an edit."""
    body = text.strip()
    if not body:
        return "empty"
    if not balanced(body):
        return "broken"
    return "edit" if has_code(body) else "no_edit"


def is_valid(text: str) -> bool:
    """The tool call carrying this completion parses (empty text and text without code trivially do)."""
    return classify(text) != "broken"


def is_no_edit(text: str) -> bool:
    """Nothing to apply: empty, or only comments and string literals."""
    return classify(text) in ("empty", "no_edit")
