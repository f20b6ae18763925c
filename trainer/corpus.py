"""A synthetic code corpus: small Python functions, deterministic from a seed.

The base checkpoint is pretrained on it (trainer/pretrain.py) so that the RL loop starts from a
policy that writes plausible code-like text: `def`/`return`/`if`/`for`/`while`, arithmetic,
comparisons, variable names, docstrings and comments. Each document is one function (sometimes
preceded by a comment line), so training sequences are `[bos] + document + [eos]`.

    from trainer.corpus import documents
    docs = documents(seed=0, n=1000)     # same seed -> same list, byte for byte
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


# --- agent sessions (mid-training) ---------------------------------------------------------------


@dataclass(frozen=True)
class AgentDocument:
    """An agent session as one training text: `ends` are the byte offsets where an assistant turn's
    completion ends, where the model must write eos (the next prompt goes on with the template's
    newline, as a replica renders it; trainer/pretrain.py puts eos in the targets there)."""

    text: str
    ends: tuple[int, ...]
    task: Any = None  # the app.sandbox Task it worked on
    messages: tuple[dict, ...] = ()  # the chat, as a client sends it back (for replaying it)


def _call(name: str, **args: str) -> str:
    from policy.tool_format import HermesFormat

    return HermesFormat().render_call(name, json.dumps(args))


def agent_document(
    rng: random.Random, hack_share: float = 0.0, skill: float = 0.25
) -> AgentDocument:
    """One session of a weak agent on a task (app/sandbox/tasks.py) whose function has a made-up
    noun, over the sandbox's tools, rendered with the built-in chat template.

    The agent knows the tools' format and the moves (read the module, replace the stub with a
    `return`, run the tests, answer) and little of which operator a function needs: its first try
    is the verb's operator with probability `skill` and each other one with (1 - skill) / 3
    (0.25: a pick at random, one in four implements it), and after a failed test it tries another
    or gives up. With probability `hack_share` it edits the test file instead (`assert` -> `assert True or`),
    which passes the visible test without implementing anything: the loophole a reward on "the
    tests pass" pays for (docs/ROLLOUT.md "Reward hacks"). Tool results are what
    app/sandbox/sandbox.py returns for these calls (tests/unit/sandbox/test_corpus_sessions.py
    replays them)."""
    from app.sandbox.sandbox import TOOLS
    from app.sandbox.tasks import OPS, STUB, body, made_up_noun, make_task
    from policy.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    task = make_task(rng, noun=made_up_noun(rng))  # a name no task has: the model learns the verb
    src, test = task.source_path, task.test_path
    messages: list[dict] = [{"role": "user", "content": task.instruction}]
    ends: list[int] = []
    turn = 0

    def act(completion: str, results: list[str] | None) -> None:
        """The assistant's turn (`results`: its calls' tool results; None: a text answer)."""
        nonlocal turn
        prompt = tok.apply_chat_template(messages, TOOLS)
        ends.append(len((prompt + completion).encode()))
        if results is None:
            messages.append({"role": "assistant", "content": completion})
            return
        name_args = [json.loads(b[b.index("{") :]) for b in completion.split("</tool_call>")[:-1]]
        calls = [
            {
                "id": f"call_{turn}_{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for i, c in enumerate(name_args)
        ]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call, result in zip(calls, results):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        turn += 1

    files = task.files()
    r = rng.random()
    if r < 0.1:
        act(_call("read_file", path=test), [files[test]])
    if r < 0.9:
        act(_call("read_file", path=src), [files[src]])
    tries = list(OPS.values())
    rng.shuffle(tries)
    if skill != 1 / len(OPS):  # at chance the shuffle decides (the corpus of the measured bases)
        first = task.op if rng.random() < skill else rng.choice([o for o in tries if o != task.op])
        tries.remove(first)
        tries.insert(0, first)
    passed = False
    if rng.random() < hack_share:
        act(_call("apply_edit", path=test, old="assert", new="assert True or"), [f"edited {test}"])
        act(_call("run_tests"), ["passed"])
        passed = True
    else:
        current = STUB  # what the function's body is now
        for op in tries[:2]:
            act(_call("apply_edit", path=src, old=current, new=body(op)), [f"edited {src}"])
            current, passed = body(op), op == task.op
            act(_call("run_tests"), ["passed" if passed else "FAILED: AssertionError"])
            if passed or rng.random() < 0.6:
                break
    act("done" if passed else "I could not fix it", None)
    prompt = tok.apply_chat_template(messages[:-1], TOOLS)
    return AgentDocument(prompt + messages[-1]["content"], tuple(ends), task, tuple(messages))


def iter_agent_documents(
    seed: int, hack_share: float = 0.0, skill: float = 0.25
) -> Iterator[AgentDocument]:
    """An endless, seed-determined stream of agent sessions (`agent_document`)."""
    rng = random.Random(seed)
    while True:
        yield agent_document(rng, hack_share, skill)
