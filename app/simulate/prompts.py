"""Code prompts for the simulated editor: the start of a function whose body the model completes.

Training prompts and held-out prompts come from disjoint name pools, so the held-out
evaluation measures the preference, not memorised prompts.
"""

from __future__ import annotations

import random

_VERBS = ["add", "scale", "count", "merge", "clamp", "parse", "total", "pick", "shift", "mean", "diff", "flip",
          "wrap", "trim", "join", "split", "limit", "score", "round", "pack"]
_NOUNS = ["items", "values", "rows", "names", "pairs", "xs", "nums", "words", "keys", "data", "parts", "cells"]
_ARGS = ["a, b", "x", "xs", "items, n", "value, lo, hi", "text", "rows, key", "n", "data, k", "left, right"]


def make_prompt(rng: random.Random, verbs: list[str]) -> str:
    verb, noun, args = rng.choice(verbs), rng.choice(_NOUNS), rng.choice(_ARGS)
    style = rng.random()
    if style < 0.4:
        return f"def {verb}_{noun}({args}):\n    "
    if style < 0.7:
        return f'def {verb}_{noun}({args}):\n    """{verb.capitalize()} the {noun}."""\n    '
    return f"def {verb}({args}):\n    result = {args.split(',')[0]}\n    "


def prompts(n: int, seed: int, held_out: bool = False) -> list[str]:
    """`n` prompts; training and held-out prompts use disjoint verb pools."""
    rng = random.Random(seed)
    verbs = _VERBS[len(_VERBS) // 2:] if held_out else _VERBS[: len(_VERBS) // 2]
    return [make_prompt(rng, verbs) for _ in range(n)]
