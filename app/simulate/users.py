"""Simulated users: hidden preferences turned into the editor events a real user would send.

A user sees a completion for a code prompt and reacts the way editor telemetry records it:
accept or reject, how much of an accepted edit persists, an occasional rating, a frustrated
follow-up after a bad one, and a tool error when the completion does not even parse.

The preference is hidden from the model and deliberately something a byte-level policy can
learn from reward alone, yet rare enough in the base model to leave room to learn: users like
a completion that *directly returns*, a single line that starts with `return` (the pretrained
base writes one about 30% of the time; it prefers multi-line bodies). Short ones are liked a
little more, and ones that do not even parse (unbalanced brackets or quotes) are disliked.
`acceptance_probability` is the expected acceptance of one completion; the held-out
evaluation averages it over completions, so its estimate has low variance. Users differ
slightly (their own pickiness and length tolerance), so held-out users are new draws from the
same population.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field


class Preference(BaseModel):
    """The population's hidden taste (weights of a logistic acceptance model)."""

    w_direct: float = Field(4.5, description="Log-odds bonus for a one-line completion that starts with `return`.")
    short_bytes: int = Field(24, description="A completion this short or shorter (stripped) counts as short.")
    w_short: float = Field(0.5, description="Log-odds bonus for a short, non-empty completion.")
    w_broken: float = Field(-1.5, description="Log-odds penalty when brackets/quotes do not balance (it won't parse).")
    bias: float = Field(-2.5, description="Log-odds of accepting a completion with none of the liked properties.")
    user_spread: float = Field(0.3, description="Std-dev of per-user variation of bias and short_bytes (x16).")


def _balanced(text: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    quote: str | None = None
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and quote is None


def features(text: str, short_bytes: int) -> dict[str, bool]:
    body = text.strip()
    return {
        "empty": not body,
        "short": 0 < len(body) <= short_bytes,
        "direct": body.startswith("return") and "\n" not in body,
        "broken": not _balanced(body),
    }


@dataclass
class SimulatedUser:
    """One user; `seed` fixes both their quirks and their random reactions."""

    user_id: str
    pref: Preference = field(default_factory=Preference)
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        quirk = random.Random(self.seed ^ 0x5EED)
        self.bias = self.pref.bias + quirk.gauss(0.0, self.pref.user_spread)
        self.short_bytes = max(8, int(self.pref.short_bytes + 8 * quirk.gauss(0.0, self.pref.user_spread)))

    def acceptance_probability(self, completion: str) -> float:
        f = features(completion, self.short_bytes)
        if f["empty"]:
            return 0.02
        z = self.bias + self.pref.w_direct * f["direct"] + self.pref.w_short * f["short"] + self.pref.w_broken * f["broken"]
        return 1.0 / (1.0 + math.exp(-z))

    def react(self, completion: str) -> list[dict[str, Any]]:
        """Feedback events (without envelope fields) for one shown completion, in the order sent."""
        p = self.acceptance_probability(completion)
        f = features(completion, self.short_bytes)
        events: list[dict[str, Any]] = []
        if f["broken"] and self.rng.random() < 0.5:
            idx = max(0, len(completion.encode()) - 1)
            events.append({"type": "tool_error", "message": "SyntaxError: unbalanced brackets or quotes",
                           "hint": "close every (, [, { and quote you open", "token_index": idx})
        if self.rng.random() < p:
            events.append({"type": "accept"})
            keep = min(1.0, max(0.0, self.rng.gauss(0.6 + 0.35 * p, 0.1)))
            events.append({"type": "edit_persistence", "fraction": round(keep, 3), "after_s": 30.0})
            if self.rng.random() < 0.2:
                events.append({"type": "rating", "value": 1})
        else:
            events.append({"type": "reject"})
            if self.rng.random() < 0.15:
                events.append({"type": "rating", "value": -1})
            if self.rng.random() < 0.25:
                events.append({"type": "followup", "sentiment": round(-0.3 - 0.6 * self.rng.random(), 3)})
        return events


def population(n: int, seed: int, pref: Preference | None = None, prefix: str = "user") -> list[SimulatedUser]:
    """`n` users drawn from the population; a different `seed` gives held-out users."""
    pref = pref or Preference()
    return [SimulatedUser(f"{prefix}-{seed}-{i}", pref, seed=seed * 100_003 + i) for i in range(n)]


def expected_acceptance(users: list[SimulatedUser], completions: list[str]) -> float:
    """Mean acceptance probability of `completions` over `users` (the held-out metric)."""
    assert users and completions, "need users and completions"
    return sum(u.acceptance_probability(c) for u in users for c in completions) / (len(users) * len(completions))
