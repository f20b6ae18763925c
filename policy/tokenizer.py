"""`byte-v1`: the built-in tokenizer. Ids 0..255 are the UTF-8 bytes; 256 bos, 257 eos, 258 pad.

Text round-trips exactly (`decode(encode(s)) == s`); decoding drops special ids and replaces
invalid UTF-8 (a completion can stop mid-character) with U+FFFD.

Chat template (`apply_chat_template`, used by the replica's `POST /v1/chat/completions`): each
message becomes `"<role>: <content>\n"` in order, then `"assistant: "` where the reply begins:

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    -> "system: Be brief.\nuser: hi\nassistant: "
"""

from __future__ import annotations

from policy.base import Tokenizer


class ByteTokenizer(Tokenizer):
    name = "byte-v1"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    @property
    def has_chat_template(self) -> bool:
        return True

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
