"""How much of the agent tasks' skill a policy holds: the operator its edit writes, given the verb.

An agent task (app/sandbox/tasks.py) is decided by one byte: the operator that replaces the stub,
which the function's verb names (add +, sub -, mul *, div //). `probe` measures how much of that
a policy holds, without sampling noise: on 48 held-out tasks it renders the session as a replica
would (the task, the module read, then the `apply_edit` call written up to `"new": "return a `)
and reads the policy's next-byte distribution over `+ - * /` (normalised over the four; `mass` is
what the four had before). A policy that ignores the verb puts the same distribution on every
verb; one that holds the skill puts its mass on the verb's operator.

Mid-training (trainer/pretrain.py `midtrain`) probes as it goes: it stops at a target p(right),
or trains to a peak and is scaled back to the target (`scale_back`); bench/agent_skill.py measures
saved policies with it (docs/TRAINER.md "Why it falls short").

`call_closing` reads the other byte the built-in policy was seen to get wrong: after the edit's
`"new": "return a OP b"}`, the brace that closes the call. A policy that ends its calls by length
rather than by the braces it opened puts mass on a newline there for `//`, the one operator of two
bytes (docs/TRAINER.md "Why it falls short", run 15).
"""

from __future__ import annotations

import json

import torch

from app.sandbox.sandbox import TOOLS
from app.sandbox.tasks import OPS, STUB, Task, tasks
from policy.base import Policy, Tokenizer
from policy.tool_format import HermesFormat

PROBE_TASKS, PROBE_SEED = 48, 0
OPS_BYTES = ("+", "-", "*", "/")  # `//` is told apart from the others by its first byte


def probe_context(task: Task, tok: Tokenizer) -> str:
    """The text a replica has given the policy when it writes `task`'s operator: the chat (the
    task, the module read) rendered with the tools, then the `apply_edit` call up to `"return a `,
    as the pretraining corpus's sessions write it (trainer/corpus.py)."""
    src = task.source_path
    call = {"id": "call_0_0", "type": "function"}
    call["function"] = {"name": "read_file", "arguments": json.dumps({"path": src})}
    messages = [
        {"role": "user", "content": task.instruction},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": task.files()[src]},
    ]
    edit = _edit_call(task, "+")
    return tok.apply_chat_template(messages, TOOLS) + edit[: edit.index("+")]


def _edit_call(task: Task, op: str) -> str:
    """The `apply_edit` call that writes `op` into `task`'s stub, as the model writes it."""
    return HermesFormat().render_call(
        "apply_edit",
        json.dumps({"path": task.source_path, "old": STUB, "new": f"return a {op} b"}),
    )


def _next_token_logprobs(policy: Policy, contexts: list[list[int]]) -> torch.Tensor:
    """[B, V] log-probs of the token after each context, in one eval-mode forward (the policy's
    train/eval mode is put back)."""
    was_training = policy.training
    policy.eval()
    with torch.no_grad():
        logp, _, _ = policy.completion_log_probs(contexts, [[0]] * len(contexts))
    policy.train(was_training)
    return logp[:, 0]


def closing_context(task: Task, tok: Tokenizer) -> tuple[str, str]:
    """(the text a replica has given the policy when the edit call's `new` argument and its
    object are written, with the verb's right operator; the byte that closes the call)."""
    edit = _edit_call(task, OPS[task.verb])
    at = edit.index(' b"}') + len(' b"}')
    # probe_context is this call written up to "return a " (the operator's byte comes next)
    return probe_context(task, tok) + edit[edit.index("return a ") + len("return a ") : at], edit[
        at
    ]


def call_closing(policy: Policy, n_tasks: int = PROBE_TASKS) -> dict[str, float]:
    """Per verb, the mean p of the byte that closes the edit call (`closing_context`) on the held-out
    probe tasks: 1 minus it is how often the call ends one brace short."""
    tok = policy.tokenizer
    probed = tasks(n_tasks, PROBE_SEED, held_out=True)
    heads = [closing_context(t, tok) for t in probed]
    nxt = [tok.encode(b) for _, b in heads]
    assert all(len(i) == 1 for i in nxt), "the probe reads one byte-level token"
    logp = _next_token_logprobs(policy, [tok.encode(h) for h, _ in heads])
    by_verb: dict[str, list[float]] = {}
    for t, row, i in zip(probed, logp.exp(), nxt, strict=True):
        by_verb.setdefault(t.verb, []).append(float(row[i[0]]))
    return {v: round(sum(x) / len(x), 3) for v, x in by_verb.items()}


def operator_index(verb: str) -> int:
    """Where `verb`'s operator is in `OPS_BYTES` (and so in a probe's distribution)."""
    return OPS_BYTES.index(OPS[verb][0])


def separation(by_verb: dict[str, torch.Tensor]) -> dict:
    """How far the policy tells the verbs apart: per verb, its operator's p under the verb less the
    most any other verb puts on that operator (`by_verb`: verb -> [p(+), p(-), p(*), p(/)]), and
    the least of those. A policy that reads two verbs as one puts the same distribution on both:
    their separations are near 0 (or below, when the other verb's operator wins on both), and the
    loop's RL moves the two together, to the operator of the one that succeeds more (measured:
    docs/TRAINER.md "Why it falls short")."""
    sep = {}
    for v, d in by_verb.items():
        i = operator_index(v)
        others = [float(o[i]) for u, o in by_verb.items() if u != v]
        sep[v] = float(d[i]) - max(others, default=0.0)
    return {
        "separation": {v: round(x, 3) for v, x in sep.items()},
        "separation_min": round(min(sep.values()), 3) if sep else 0.0,
    }


def probe(policy: Policy, n_tasks: int = PROBE_TASKS) -> dict:
    """{"by_verb": {verb: [p(+), p(-), p(*), p(/)] averaged over its tasks}, "p_right": mean p of
    the verb's operator, "p_right_min": the least of the verbs' p of their operator,
    "separation" / "separation_min": how far it tells the verbs apart (`separation`), "mass": mean
    mass of the four bytes before normalising, "tasks": n}."""
    tok = policy.tokenizer
    ids = [tok.encode(o) for o in OPS_BYTES]
    assert all(len(i) == 1 for i in ids), "the probe reads one byte-level token per operator"
    by_verb: dict[str, list[torch.Tensor]] = {v: [] for v in OPS}
    right, mass = [], []
    probed = tasks(n_tasks, PROBE_SEED, held_out=True)
    contexts = [tok.encode(probe_context(t, tok)) for t in probed]
    logp = _next_token_logprobs(policy, contexts)  # the distribution at the operator
    ops = [i[0] for i in ids]
    for t, row in zip(probed, logp[:, ops].exp(), strict=True):
        mass.append(float(row.sum()))
        dist = row / row.sum()
        by_verb[t.verb].append(dist)
        right.append(float(dist[operator_index(t.verb)]))
    verbs = {v: torch.stack(d).mean(0) for v, d in by_verb.items() if d}
    return {
        **separation(verbs),
        "by_verb": {v: [round(x, 3) for x in d.tolist()] for v, d in verbs.items()},
        "p_right": round(sum(right) / len(right), 3),
        # the verb held least: a base whose mean is one verb learned and the others at chance
        # holds a skill the loop's RL does not spread (docs/TRAINER.md "Why it falls short")
        "p_right_min": round(min(float(d[operator_index(v)]) for v, d in verbs.items()), 3),
        "mass": round(sum(mass) / len(mass), 3),
        "tasks": len(right),
    }
