"""Agent tasks: a stubbed function to implement, a test that fails until it is, and hidden tests.

Each task is a repository of two files:

    calc.py         def add_rows(a, b):
                        raise NotImplementedError
    test_calc.py    from calc import add_rows
                    assert add_rows(7, 3) == 10

The user asks "implement add_rows in calc.py". The function's verb says what it should do (`OPS`:
add +, sub -, mul *, div //): the edit replaces the stub (`STUB`) with `return a + b`. Why a stub
and not a wrong operator to find: a wrong operator's edit must copy the module's operator into
`old`, and the built-in 1.4M-parameter policy pretrained for minutes does not copy (its `old`
is the same spread over +, -, * whatever the module has; docs/TRAINER.md "Agents"), so nearly
every session failed on a copy, not on the skill. The visible test checks one pair of numbers;
the hidden tests (never in the repository)
check the function on other pairs, so a result that only passes the visible test (the test
edited, a special case) does not pass them. Training and held-out tasks use disjoint nouns in
their function names, so the held-out evaluation measures the skill, not memorised tasks.

    from app.sandbox.tasks import tasks
    for task in tasks(8, seed=0, held_out=True): ...
"""

from __future__ import annotations

import random
from dataclasses import dataclass

OPS = {"add": "+", "sub": "-", "mul": "*", "div": "//"}
_TRAIN_NOUNS = (
    "rows", "items", "cells", "parts", "nums", "keys", "pairs", "words", "nodes", "edges",
    "files", "users", "orders", "prices", "scores", "points", "blocks", "pages", "tasks", "jobs",
)  # fmt: skip
_HELDOUT_NOUNS = (
    "sizes", "costs", "steps", "units", "bins", "lines", "votes", "rates", "loads", "hits",
)  # fmt: skip
assert not set(_TRAIN_NOUNS) & set(_HELDOUT_NOUNS), "training and held-out nouns are disjoint"
# every repository's module is calc.py (and its test test_calc.py): the task's names are its
# function's (verb_noun). A byte-level model of 1.4M parameters pretrained for minutes did not
# learn to copy unseen file names into its calls (0.0 held-out task success with the module named
# after the noun, docs/TRAINER.md "Agents"); the verb, which decides the fix, it reads.
MODULE = "calc"
# made-up nouns have the shapes of English nouns (clusters, a leading vowel, a plural -s):
# a corpus of CV syllables alone ("kavo") left the pretrained model unsure how to start a session
# for a task on "units" or "costs" (p of "<tool_call>" 0.27 against 1.0, docs/TRAINER.md "Agents")
_ONSETS = (
    "", "", "b", "bl", "br", "c", "ch", "cl", "cr", "d", "dr", "f", "fl", "fr", "g", "gl", "gr",
    "h", "j", "k", "l", "m", "n", "p", "pl", "pr", "r", "s", "sc", "sh", "sk", "sl", "sn", "sp",
    "st", "str", "t", "th", "tr", "v", "w", "z",
)  # fmt: skip
_NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
_CODAS = (
    "", "", "", "b", "ck", "d", "ft", "g", "k", "l", "ld", "m", "mp", "n", "nd", "ng", "nk", "nt",
    "p", "r", "rd", "rk", "rm", "rn", "rt", "s", "sk", "st", "t", "x",
)  # fmt: skip


_TASK_NOUNS = frozenset(_TRAIN_NOUNS) | frozenset(_HELDOUT_NOUNS)


def made_up_noun(rng: random.Random) -> str:
    """A pronounceable made-up noun ("kavo", "units"-like "ostems", "blands"): names no task uses,
    for the pretraining corpus's sessions (trainer/corpus.py), so what a model learns there is the
    verb's part and the moves, not the tasks' names."""
    while True:
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
            for _ in range(rng.choice((1, 1, 2, 2, 2, 3)))
        )
        word += "s" if rng.random() < 0.5 and not word.endswith(("s", "x")) else ""
        if 3 <= len(word) <= 9 and word not in _TASK_NOUNS:
            return word


STUB = "raise NotImplementedError"  # the body of every task's function before the edit


def body(op: str) -> str:
    """The function's body computing `a op b`: what an implementing edit writes."""
    return f"return a {op} b"


def apply_op(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b, "//": a // b}[op]


def _distinct_pair(rng: random.Random) -> tuple[int, int]:
    """Numbers on which the four operators give four different results (so a wrong fix fails)."""
    while True:
        a, b = rng.randint(5, 30), rng.randint(2, 9)
        if len({apply_op(op, a, b) for op in OPS.values()}) == len(OPS):
            return a, b


@dataclass(frozen=True)
class Task:
    task_id: str
    module: str  # "calc": the file calc.py (`MODULE`)
    function: str  # "add_rows"
    verb: str  # "add": OPS[verb] is the right operator
    visible: tuple[int, int]  # the test file's numbers
    hidden: tuple[tuple[int, int], ...]  # the hidden tests' numbers

    @property
    def source_path(self) -> str:
        return f"{self.module}.py"

    @property
    def test_path(self) -> str:
        return f"test_{self.module}.py"

    @property
    def op(self) -> str:
        return OPS[self.verb]

    @property
    def instruction(self) -> str:
        """What the user asks for: the first user message of the session."""
        return f"implement {self.function} in {self.source_path}"

    def files(self) -> dict[str, str]:
        """The repository: path -> text."""
        a, b = self.visible
        return {
            self.source_path: f"def {self.function}(a, b):\n    {STUB}\n",
            self.test_path: (
                f"from {self.module} import {self.function}\n"
                f"assert {self.function}({a}, {b}) == {apply_op(self.op, a, b)}\n"
            ),
        }

    def hidden_test(self) -> str:
        """A test script of the right behaviour on the hidden pairs (run against the module)."""
        lines = [f"from {self.module} import {self.function}"]
        lines += [
            f"assert {self.function}({a}, {b}) == {apply_op(self.op, a, b)}" for a, b in self.hidden
        ]
        return "\n".join(lines) + "\n"

    def the_fix(self) -> tuple[str, str]:
        """(old, new) of the edit that implements the function."""
        return STUB, body(self.op)


def make_task(
    rng: random.Random, held_out: bool = False, index: int = 0, noun: str | None = None
) -> Task:
    """A task on function `<verb>_<noun>`: `noun` when given, else a training (or held-out) noun."""
    noun = noun or rng.choice(_HELDOUT_NOUNS if held_out else _TRAIN_NOUNS)
    verb = rng.choice(sorted(OPS))
    visible = _distinct_pair(rng)
    hidden = tuple(_distinct_pair(rng) for _ in range(3))
    prefix = "heldout" if held_out else "task"
    return Task(f"{prefix}-{index}", MODULE, f"{verb}_{noun}", verb, visible, hidden)


def tasks(n: int, seed: int, held_out: bool = False) -> list[Task]:
    """`n` tasks, the same for the same arguments; held-out tasks use other nouns."""
    rng = random.Random(seed * 7919 + held_out)
    return [make_task(rng, held_out, i) for i in range(n)]
