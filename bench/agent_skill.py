"""Does a policy hold the agent tasks' skill? The operator its edit writes, given the verb.

An agent task (app/sandbox/tasks.py) is decided by one byte: the operator that replaces the stub,
which the function's verb names (add +, sub -, mul *, div //). `probe` measures how much of that
a saved policy holds, without sampling noise: on 48 held-out tasks it renders the session as a
replica would (the task, the module read, then the `apply_edit` call written up to
`"new": "return a `) and reads the policy's next-byte distribution over `+ - * /` (normalised over
the four; `mass` is what the four had before). A policy that ignores the verb puts the same
distribution on every verb; one that holds the skill puts its mass on the verb's operator.

`sft` is the supervised bound: it fine-tunes a saved policy on sessions of an agent that is always
right, 8 a step at `--lr` (trainer/pretrain.py `midtrain`, the mid-training of
`flywheel pretrain --mid-steps`), and probes every `--every` steps, saving the policy there with `--save PREFIX`
(`PREFIX-<step>`, a mid-trained base that `bench/agent_rl.py` or `flywheel run --agents` can start
from). Measured on the 2-core machine: docs/TRAINER.md "Why it falls short".

    .venv/bin/python -m bench.agent_skill probe /tmp/agent-base [/tmp/other-base ...]
    .venv/bin/python -m bench.agent_skill sft /tmp/agent-base --steps 200 --every 25 --save /tmp/mid
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from app.sandbox.sandbox import TOOLS
from app.sandbox.tasks import OPS, STUB, Task, tasks
from policy.base import Policy, Tokenizer
from policy.checkpoint import load_policy, save_policy
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
    edit = HermesFormat().render_call(
        "apply_edit", json.dumps({"path": src, "old": STUB, "new": "return a + b"})
    )
    return tok.apply_chat_template(messages, TOOLS) + edit[: edit.index("+")]


def probe(policy: Policy, n_tasks: int = PROBE_TASKS) -> dict:
    """{"by_verb": {verb: [p(+), p(-), p(*), p(/)] averaged over its tasks}, "p_right": mean p of
    the verb's operator, "mass": mean mass of the four bytes before normalising, "tasks": n}."""
    tok = policy.tokenizer
    ids = [tok.encode(o) for o in OPS_BYTES]
    assert all(len(i) == 1 for i in ids), "the probe reads one byte-level token per operator"
    by_verb: dict[str, list[torch.Tensor]] = {v: [] for v in OPS}
    right, mass = [], []
    was_training = policy.training
    policy.eval()
    for t in tasks(n_tasks, PROBE_SEED, held_out=True):
        context = tok.encode(probe_context(t, tok))
        with torch.no_grad():  # the operator's byte as the completion's only token
            p = policy.logprobs([context] * len(ids), ids)[:, 0].exp()
        mass.append(float(p.sum()))
        dist = p / p.sum()
        by_verb[t.verb].append(dist)
        right.append(float(dist[OPS_BYTES.index(OPS[t.verb][0])]))
    policy.train(was_training)
    return {
        "by_verb": {
            v: [round(x, 3) for x in torch.stack(d).mean(0).tolist()]
            for v, d in by_verb.items()
            if d
        },
        "p_right": round(sum(right) / len(right), 3),
        "mass": round(sum(mass) / len(mass), 3),
        "tasks": len(right),
    }


def sft(
    policy: Policy,
    steps: int,
    every: int,
    lr: float,
    save: str | None,
    seed: int,
    probe_tasks: int = PROBE_TASKS,
) -> list[tuple[int, dict]]:
    """Mid-train (trainer/pretrain.py `midtrain`); the probe at step 0 and every `every` steps."""
    from trainer.pretrain import midtrain

    curve = [(0, probe(policy, probe_tasks))]
    print(f"step 0: {json.dumps(curve[-1][1])}", flush=True)
    t0 = time.perf_counter()

    def on_step(k: int, loss: float) -> None:
        step = k + 1
        if step % every and step != steps:
            return
        curve.append((step, probe(policy, probe_tasks)))
        if save:
            policy.eval()
            save_policy(policy, Path(f"{save}-{step}"))
            policy.train()
        took = time.perf_counter() - t0
        print(f"step {step} (loss {loss:.3f}, {took:.0f}s): {json.dumps(curve[-1][1])}", flush=True)

    midtrain(policy, steps, lr, seed, on_step=on_step)
    policy.eval()
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe", help="p(operator | verb) of saved policies")
    p.add_argument("policies", nargs="+")
    s = sub.add_parser("sft", help="the supervised bound: fine-tune on always-right sessions")
    s.add_argument("base", help="a saved policy directory")
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--every", type=int, default=25)
    s.add_argument("--lr", type=float, default=3e-4)
    s.add_argument("--seed", type=int, default=12345, help="the sessions' seed")
    s.add_argument("--save", default=None, help="save the policy at each probe as SAVE-<step>")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.cmd == "probe":
        for path in a.policies:
            print(f"{path}: {json.dumps(probe(load_policy(path)))}", flush=True)
    else:
        sft(load_policy(a.base), a.steps, a.every, a.lr, a.save, a.seed)


if __name__ == "__main__":
    main()
