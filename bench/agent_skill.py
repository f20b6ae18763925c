"""Does a policy hold the agent tasks' skill? The operator its edit writes, given the verb.

`probe` (trainer/skill_probe.py) reads a saved policy's next-byte distribution over `+ - * /` where
an agent session writes the operator that decides its task, on 48 held-out tasks, without sampling
noise: p(right) is the mass on the verb's operator; `mass` is what the four operators had before
normalising (1 - mass: the bytes that are no operator, a garbled call); `closes`, per verb, the p of
the brace that closes the edit call after `"return a OP b"}` (`call_closing`).

`sft` is the supervised bound: it fine-tunes a saved policy on sessions of an agent that is always
right, 8 a step at `--lr` (trainer/pretrain.py `midtrain`, the mid-training of
`flywheel pretrain --mid-steps`), and probes every `--every` steps, saving the policy there with `--save PREFIX`
(`PREFIX-<step>`, a mid-trained base that `bench/agent_rl.py` or `flywheel run --agents` can start
from). Measured on the 2-core machine: docs/TRAINER.md "Why it falls short".

    .venv/bin/python -m bench.agent_skill probe /tmp/agent-base [/tmp/other-base ...]
    .venv/bin/python -m bench.agent_skill sft /tmp/agent-base --steps 200 --every 25 --save /tmp/mid

`save` writes registered versions of a running loop (its MLflow, `flywheel run` serves it on
127.0.0.1:5000) as saved policies, to probe or to start a bench from:

    .venv/bin/python -m bench.agent_skill save 1 /tmp/run-v1 --mlflow http://127.0.0.1:5000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from policy.base import Policy
from policy.checkpoint import load_policy, save_policy
from trainer.pretrain import on_line
from trainer.skill_probe import PROBE_TASKS, call_closing, probe


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


def line(
    base: Policy,
    mid: Policy,
    shares: list[float],
    save: str | None,
    probe_tasks: int = PROBE_TASKS,
) -> list[tuple[float, dict]]:
    """The probe at each share `a` of the line base + a × (mid − base); `base` ends at the last."""
    start, end = base.state_dict(), mid.state_dict()
    start = {k: v.clone() for k, v in start.items()}
    out = []
    for a in shares:
        base.load_state_dict(on_line(start, end, a))
        out.append((a, probe(base, probe_tasks)))
        print(f"a={a}: {json.dumps(out[-1][1])}", flush=True)
        if save:
            save_policy(base, Path(f"{save}-{a}"))
    return out


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
    li = sub.add_parser("line", help="probe the line from a base to a mid-trained policy")
    li.add_argument("base", help="a saved policy directory")
    li.add_argument("mid", help="a saved policy of the same architecture, e.g. an `sft --save`")
    li.add_argument("--at", default="0,0.5,0.6,0.7,0.8,1", help="shares, comma-separated")
    li.add_argument("--save", default=None, help="save the policy at each share as SAVE-<a>")
    sv = sub.add_parser("save", help="save a registered version of a running loop as a policy")
    sv.add_argument("version", help="the registered version")
    sv.add_argument("out", help="the directory to write")
    sv.add_argument("--mlflow", default="http://127.0.0.1:5000", help="the loop's MLflow")
    sv.add_argument("--model", default="flywheel-policy", help="the registered model's name")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.cmd == "probe":
        for path in a.policies:
            policy = load_policy(path)
            read = {**probe(policy), "closes": call_closing(policy)}
            print(f"{path}: {json.dumps(read)}", flush=True)
    elif a.cmd == "save":
        from mlflow.tracking import MlflowClient

        from app.controller.gate_io import load_version

        save_policy(load_version(MlflowClient(a.mlflow), a.model, a.version)[0], a.out)
        print(f"saved {a.model} v{a.version} to {a.out}")
    elif a.cmd == "line":
        shares = [float(x) for x in a.at.split(",")]
        line(load_policy(a.base), load_policy(a.mid), shares, a.save)
    else:
        sft(load_policy(a.base), a.steps, a.every, a.lr, a.save, a.seed)


if __name__ == "__main__":
    main()
