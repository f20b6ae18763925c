"""A synthetic code corpus: small Python functions, deterministic from a seed.

The base checkpoint is pretrained on it (trainer/pretrain.py) so that the RL loop starts from a
policy that writes plausible code-like text: `def`/`return`/`if`/`for`/`while`, arithmetic,
comparisons, variable names, docstrings and comments. Each document is one function (sometimes
preceded by a comment line), so training sequences are `[bos] + document + [eos]`.

    from trainer.corpus import documents
    docs = documents(seed=0, n=1000)     # same seed -> same list, byte for byte
"""

from __future__ import annotations

import random
from collections.abc import Iterator

NOUNS = [
    "value",
    "item",
    "count",
    "total",
    "index",
    "name",
    "size",
    "score",
    "price",
    "node",
    "key",
    "line",
    "word",
    "row",
    "limit",
    "step",
    "result",
    "data",
    "number",
    "offset",
    "width",
    "height",
]
PLURALS = {
    "value": "values",
    "item": "items",
    "name": "names",
    "score": "scores",
    "price": "prices",
    "node": "nodes",
    "key": "keys",
    "line": "lines",
    "word": "words",
    "row": "rows",
    "number": "numbers",
}
VERBS = [
    "compute",
    "get",
    "find",
    "count",
    "sum",
    "scale",
    "filter",
    "clamp",
    "check",
    "update",
    "merge",
    "parse",
    "build",
    "make",
    "load",
    "average",
    "normalize",
]
ARITH = ["+", "-", "*", "//", "%"]
CMP = ["<", ">", "<=", ">=", "==", "!="]
COMMENTS = [
    "# helper",
    "# TODO: handle empty input",
    "# fast path",
    "# keep it simple",
    "# edge case",
    "# validate the input",
    "# accumulate",
    "# note: inclusive bound",
]


def _name(rng: random.Random) -> str:
    return rng.choice(NOUNS) + (str(rng.randint(1, 3)) if rng.random() < 0.1 else "")


def _func_name(rng: random.Random, noun: str) -> str:
    return f"{rng.choice(VERBS)}_{noun}" + (f"_{rng.choice(NOUNS)}" if rng.random() < 0.3 else "")


def _expr(rng: random.Random, names: list[str], depth: int = 0) -> str:
    if depth > 1 or rng.random() < 0.4:
        return rng.choice(names) if rng.random() < 0.7 else str(rng.randint(0, 20))
    return f"{_expr(rng, names, depth + 1)} {rng.choice(ARITH)} {_expr(rng, names, depth + 1)}"


def _sum_loop(rng: random.Random) -> str:
    noun = rng.choice(list(PLURALS))
    coll, acc, lim = PLURALS[noun], rng.choice(["total", "result", "count", "acc"]), _name(rng)
    cond = f"{noun} {rng.choice(CMP)} {lim}"
    upd = rng.choice([f"{acc} += {noun}", f"{acc} += 1", f"{acc} = {acc} + {noun} * 2"])
    return (
        f"def {_func_name(rng, noun)}({coll}, {lim}):\n"
        f'    """Return the {acc} of {coll} where {cond}."""\n'
        f"    {acc} = 0\n"
        f"    for {noun} in {coll}:\n"
        f"        if {cond}:\n"
        f"            {upd}\n"
        f"    return {acc}\n"
    )


def _arith(rng: random.Random) -> str:
    a, b = rng.sample(NOUNS, 2)
    tmp = rng.choice(["result", "out", "tmp", "y"])
    body = f"    {tmp} = {_expr(rng, [a, b])}\n"
    if rng.random() < 0.5:
        body += f"    {tmp} = {tmp} {rng.choice(ARITH)} {rng.randint(1, 9)}\n"
    doc = (
        f'    """{rng.choice(["Compute", "Return", "Combine"])} {a} and {b}."""\n'
        if rng.random() < 0.7
        else ""
    )
    return f"def {_func_name(rng, a)}({a}, {b}):\n{doc}{body}    return {tmp}\n"


def _branch(rng: random.Random) -> str:
    x, lo, hi = rng.sample(NOUNS, 3)
    return (
        f"def clamp_{x}({x}, {lo}, {hi}):\n"
        f'    """Clamp {x} to the range [{lo}, {hi}]."""\n'
        f"    if {x} < {lo}:\n"
        f"        return {lo}\n"
        f"    elif {x} > {hi}:\n"
        f"        return {hi}\n"
        f"    return {x}\n"
    )


def _search(rng: random.Random) -> str:
    noun = rng.choice(list(PLURALS))
    coll, target = PLURALS[noun], rng.choice(["target", "key", "needle", "goal"])
    miss = rng.choice(["-1", "None", "0"])
    return (
        f"def find_{noun}({coll}, {target}):\n"
        f'    """Return the index of {target} in {coll}, or {miss}."""\n'
        f"    for i, {noun} in enumerate({coll}):\n"
        f"        if {noun} == {target}:\n"
        f"            return i\n"
        f"    return {miss}\n"
    )


def _while(rng: random.Random) -> str:
    n, step = rng.choice(["n", "count", "size", "number"]), rng.randint(2, 5)
    return (
        f"def {_func_name(rng, 'steps')}({n}):\n"
        f"    steps = 0\n"
        f"    while {n} > {rng.randint(0, 2)}:\n"
        f"        {n} = {n} // {step}\n"
        f"        steps += 1\n"
        f"    return steps\n"
    )


def _build_list(rng: random.Random) -> str:
    noun = rng.choice(list(PLURALS))
    coll = PLURALS[noun]
    op = rng.choice(ARITH)
    k = rng.randint(1, 10)
    if rng.random() < 0.5:
        body = f"    return [{noun} {op} {k} for {noun} in {coll}]\n"
    else:
        body = f"    out = []\n    for {noun} in {coll}:\n        out.append({noun} {op} {k})\n    return out\n"
    return f"def {_func_name(rng, noun)}({coll}):\n{body}"


def _predicate(rng: random.Random) -> str:
    a, b = rng.sample(NOUNS, 2)
    return (
        f"def is_{a}_{rng.choice(['valid', 'small', 'large', 'even', 'ready'])}({a}, {b}={rng.randint(0, 100)}):\n"
        f"    return {a} {rng.choice(CMP)} {b} and {a} % 2 == {rng.randint(0, 1)}\n"
    )


TEMPLATES = [_sum_loop, _arith, _branch, _search, _while, _build_list, _predicate]


def document(rng: random.Random) -> str:
    """One function, sometimes preceded by a comment line."""
    doc = rng.choice(TEMPLATES)(rng)
    return (rng.choice(COMMENTS) + "\n" + doc) if rng.random() < 0.2 else doc


def iter_documents(seed: int) -> Iterator[str]:
    """An endless, seed-determined stream of documents."""
    rng = random.Random(seed)
    while True:
        yield document(rng)


def documents(seed: int, n: int) -> list[str]:
    """The first `n` documents of the stream for `seed`."""
    it = iter_documents(seed)
    return [next(it) for _ in range(n)]
