"""One choice's text while it is generated: stop strings and the text that may be streamed.

`stop` (a string or up to `max_stop_sequences`) ends a completion when its decoded text contains
one; the returned text ends before it, and `finish_reason` is "stop" (as for eos); "length" when
`max_tokens` ran out. Text that may be the start of a stop string, or of a character whose bytes
have not all been generated, is held back until it is decided.
"""

from __future__ import annotations

from typing import Any


class ChoiceText:
    """One choice's tokens and text while it is generated (on the generation thread): stop strings,
    and the part of the text that is decided and may be streamed."""

    def __init__(self, tokenizer: Any, stops: list[str], max_tokens: int):
        self.tok, self.stops, self.max_tokens = tokenizer, stops, max_tokens
        self.tokens: list[int] = []
        self.text = ""  # the text so far (final once `ended`)
        self.sent = 0  # characters of `text` handed out as deltas
        self.ended: str | None = None  # "stop" | "length" once decided

    def add(self, token: int) -> str:
        """Append a generated token; returns the newly decided text (may be empty)."""
        self.tokens.append(token)
        full = self.tok.decode(self.tokens)
        if token == self.tok.eos_id:
            self.ended, self.text = "stop", full
        elif (cut := self._stop_at(full)) is not None:
            self.ended, self.text = "stop", full[:cut]
        elif len(self.tokens) >= self.max_tokens:
            self.ended, self.text = "length", full
        else:
            self.text = full
            return self._delta(len(full) - self._undecided(full))
        return self._delta(len(self.text))

    def finish(self) -> str:
        """The rest of the text when generation ended for another reason (cancelled, context)."""
        return self._delta(len(self.text))

    def _delta(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out

    def _stop_at(self, full: str) -> int | None:
        hits = [i for s in self.stops if (i := full.find(s)) >= 0]
        return min(hits) if hits else None

    def _undecided(self, full: str) -> int:
        """How many trailing characters could still change: an incomplete character (U+FFFD while
        its bytes arrive) or the start of a stop string."""
        keep = len(full) - len(full.rstrip("\ufffd"))
        for s in self.stops:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        return keep
