"""`byte-v1`: the built-in tokenizer. Ids 0..255 are the UTF-8 bytes; 256 bos, 257 eos, 258 pad.

Text round-trips exactly (`decode(encode(s)) == s`); decoding drops special ids and replaces
invalid UTF-8 (a completion can stop mid-character) with U+FFFD.

Chat template (`apply_chat_template`, used by the replica's `POST /v1/chat/completions`): each
message becomes `"<role>: <content>\\n"` in order, then `"assistant: "` where the reply begins:

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    -> "system: Be brief.\\nuser: hi\\nassistant: "

Tools (the `hermes` format, policy/tool_format.py): the tools offered are one line before the
messages, each as its signature, `"tools: read_file(path); apply_edit(path, old, new)\\n"` (a
parameter whose schema type is not `string` is written `name: type`; descriptions, enums and
other schema details are not rendered: every prompt of an agent session carries this line, and
the built-in byte-level policy pays for each byte of it in context, generation and training). The
model calls one by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (several
calls one per line), then eos. In the history an assistant message renders its content and then
its calls, one per line, in that format (`arguments` as the JSON text the client sent back); a tool
result is `"tool: <content>\\n"`:

    tools: read_file(path)
    user: open app.py
    assistant: <tool_call>
    {"name": "read_file", "arguments": {"path": "app.py"}}
    </tool_call>
    tool: print("hi")
    assistant: (the reply begins here)

An assistant message that only calls tools renders exactly what the model generated for it
(without its eos), so the next turn's prompt extends the previous prompt and completion.
"""

from __future__ import annotations

from typing import Any

from policy.base import Tokenizer


def signature(tool: dict[str, Any]) -> str:
    """`name(param, param: type)` of an OpenAI function tool (the built-in template's tool line)."""
    fn = tool.get("function") or {}
    props = (fn.get("parameters") or {}).get("properties") or {}
    params = [
        p if (spec or {}).get("type", "string") == "string" else f"{p}: {spec.get('type')}"
        for p, spec in props.items()
    ]
    return f"{fn.get('name', '')}({', '.join(params)})"


class ByteTokenizer(Tokenizer):
    name = "byte-v1"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    tool_format_name = "hermes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    @property
    def has_chat_template(self) -> bool:
        return True

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        from policy.tool_format import HermesFormat

        fmt = HermesFormat()
        head = f"tools: {'; '.join(map(signature, tools))}\n" if tools else ""
        lines = []
        for m in messages:
            body = m.get("content") or ""
            calls = [
                fmt.render_call(c["function"]["name"], c["function"]["arguments"])
                for c in m.get("tool_calls") or []
            ]
            if calls:
                body = "\n".join([body, *calls] if body else calls)
            lines.append(f"{m['role']}: {body}\n")
        return head + "".join(lines) + "assistant: "
