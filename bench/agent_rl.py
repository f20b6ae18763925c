"""Learning-rate and temperature probe for RL on agent sessions, in one process, no loop around it.

What `flywheel run --agents` does per version, without Kafka, replicas, gate or canary, so one
setting costs minutes instead of an hour: sample `--sessions` sessions of the policy on training
tasks (app/sandbox/session.py, real tools in real sandboxes, the chat template and tool-call
reading of a replica) at `--temperature`; reward each as `sessions-v1` pays it with the users'
report taken as the truth (+1 the function is right, -0.5 a wrong one, -1 gave up, -0.5 per turn
whose call failed or was not a call); train on every sampled turn of every session with the
session's advantage (centred and scaled over each batch of `--batch` sessions, as the trainer's
ungrouped rollouts are, or over each `--group` of sessions on one task, as its groups are), on-policy (every importance ratio 1), AdamW as the trainer's (betas 0.9,
0.95, clip 1.0), loss summed over sampled tokens / the batch's sampled tokens; then score the
held-out tasks (app/simulate/agent_eval.py's suite and statistics) every `--eval-every` versions,
with the policy's probability of the right operator on 48 held-out tasks (`p_right_operator`,
bench/agent_skill.py `probe`: the skill itself, without the sampling noise of 32 sessions).

What it leaves out, so read its numbers as the direction of a setting, not the loop's: the KL
term to the champion, self-distillation at tool-error turns, importance weights of stale
rollouts, and the gate. `--reported` rewards what the loop's agent users report (an outcome they
misjudge now and then, ratings now and then) instead of the truth; `--replay-routes` replays the
experts each sampled token was routed to, as the trainer does; `--probe-every K` prints the skill
every K optimizer steps.

    .venv/bin/python -m bench.agent_rl BASE_DIR --lr 3e-5 --temperature 0.6 --versions 3
    .venv/bin/python -m bench.agent_rl BASE_DIR --lr 1e-4 --warmup 8 --threads 1 --eval-tasks 16

BASE_DIR is a saved policy, the agent demo's base as `flywheel run --agents` pretrains it:

    .venv/bin/flywheel pretrain --steps 700 --agent-share 0.7 --policy '{"max_context": 1024}' \
        --threads 2 --out /tmp/agent-base

Measured on the 2-core machine: docs/TRAINER.md "Agents".
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from contextlib import ExitStack

import torch

from app.sandbox.sandbox import Sandbox
from app.sandbox.session import AgentSession, run_sessions
from app.sandbox.tasks import OPS, tasks
from app.simulate.agent_eval import scores
from app.simulate.agents import AgentUser
from bench.agent_skill import probe
from policy.checkpoint import load_policy
from streams.reward import KNOWN_SPECS, compute_reward, outcome_value, resolve_spec
from trainer.objective import (
    ADV_SCALES,
    advantages,
    importance_weights,
    policy_gradient_loss,
    trust_keep,
)

MAX_TOKENS, MAX_TURNS = 192, 6


def sample(policy, sessions, temperature: float, seed: int, record: dict) -> None:
    """`run_sessions`, keeping each turn's (prompt ids, sampled ids, routes) in
    `record[session_id]`."""
    run_sessions(
        policy,
        sessions,
        MAX_TOKENS,
        temperature=temperature,
        seed=seed,
        on_sample=lambda s, ids, sm: record.setdefault(s.session_id, []).append(
            (ids, list(sm.tokens), sm.routes)
        ),
    )


def skill(policy) -> dict:
    """p(right operator) on the held-out probe (bench/agent_skill.py), and per verb: the skill
    itself, without the sampling noise of 32 sessions; a verb the loop lets fall shows here."""
    p = probe(policy)
    right = {verb: dist[list(OPS).index(verb)] for verb, dist in p["by_verb"].items()}
    return {"p_right_operator": p["p_right"], "p_right_by_verb": right}


def reward(v) -> float:
    """sessions-v1 (streams/reward.py `KNOWN_SPECS`) with the truth as the user's report: its
    tool-error weight per turn whose call failed, plus the outcome's weight."""
    w = KNOWN_SPECS["sessions-v1"]
    outcome = "success" if v.fixed else ("abandoned" if v.gave_up else "failure")
    return w.tool_error * v.tool_errors + w.outcome[outcome]


def reported_reward(user: AgentUser, session: AgentSession, v) -> float:
    """sessions-v1 on what an agent user of the loop reports (app/simulate/agents.py `events`:
    tool errors, an outcome the user misjudges now and then, a rating now and then), labelled as
    the streams label it: each turn's `compute_reward` plus the session's `outcome_value`."""
    spec = resolve_spec("sessions-v1")
    events = user.events(session, v)
    outcome = next((e["outcome"] for e in events if e["type"] == "session_outcome"), None)
    by_turn: dict[str, list[dict]] = {}
    for k, e in enumerate(events):
        if e["type"] != "session_outcome":
            by_turn.setdefault(e["request_id"], []).append(
                {**e, "ts": "2026-01-01T00:00:00Z", "event_id": f"{k:06d}"}
            )
    turns = sum(compute_reward(spec, fb).reward for fb in by_turn.values())
    return turns + (outcome_value(spec, outcome) or 0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="a saved policy directory")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=0, help="linear lr warmup steps")
    ap.add_argument("--sessions", type=int, default=128, help="sessions per version")
    ap.add_argument("--batch", type=int, default=16, help="sessions per optimizer step")
    ap.add_argument(
        "--group",
        type=int,
        default=1,
        help="sessions per task sharing a group baseline (GRPO; 1: the batch's mean, as the "
        "trainer's ungrouped rollouts); a batch holds whole groups",
    )
    ap.add_argument(
        "--negative-scale",
        type=float,
        default=1.0,
        help="factor on negative advantages (1: the trainer's objective; 0: learn from the "
        "sessions that beat their baseline only)",
    )
    ap.add_argument(
        "--adv-scale",
        choices=ADV_SCALES,
        default="group",
        help="the trainer's FLYWHEEL_TRAINER_ADV_SCALE: group (GRPO, / group std) or none",
    )
    ap.add_argument(
        "--reported",
        action="store_true",
        help="reward what the loop's agent users report (misjudged outcomes, ratings) instead of "
        "the truth",
    )
    ap.add_argument(
        "--replay-routes",
        action="store_true",
        help="replay the experts each sampled token was routed to, as the trainer does "
        "(FLYWHEEL_TRAINER_REPLAY_ROUTES), instead of routing with the current router",
    )
    ap.add_argument(
        "--probe-every",
        type=int,
        default=0,
        help="print p(right operator) on the held-out probe every K optimizer steps (0: never)",
    )
    ap.add_argument(
        "--lag",
        type=int,
        default=0,
        help="sample each version's sessions with the policy as it was LAG versions earlier and "
        "train on them with the trainer's importance weights (trainer/objective.py: truncated "
        "token ratios, the sequence mask): the loop's stale behaviour, where the champion serves "
        "while the trainer runs ahead (0: on-policy)",
    )
    ap.add_argument(
        "--trunc-c", type=float, default=2.0, help="the trainer's FLYWHEEL_TRAINER_TRUNC_C"
    )
    ap.add_argument(
        "--clip-high",
        type=float,
        default=0.0,
        help="the trainer's FLYWHEEL_TRAINER_CLIP_HIGH: a token with a positive advantage whose "
        "ratio to the behaviour policy is above 1 + this gets no gradient (0: off)",
    )
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--eval-every", type=int, default=1)
    ap.add_argument("--eval-tasks", type=int, default=16, help="held-out tasks, 2 sessions each")
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def optimizer(policy, lr: float) -> torch.optim.Optimizer:
    """AdamW as the trainer's (betas 0.9, 0.95, no weight decay)."""
    return torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def pg_step(
    opt: torch.optim.Optimizer,
    policy,
    logp: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    logp_behav: torch.Tensor | None = None,
    trunc_c: float = 2.0,
    clip_high: float = 0.0,
) -> None:
    """One step of the trainer's policy gradient (trainer/objective.py) on rows `logp` [B, T]
    with advantages `adv` [B], the gradient clipped to norm 1 as the trainer's. Without
    `logp_behav` the rows are on-policy: every ratio is 1, so the loss is the advantage times
    each sampled token's log-prob over the batch's sampled tokens."""
    behav = logp.detach() if logp_behav is None else logp_behav
    w = importance_weights(logp, behav, mask, trunc_c=trunc_c)
    loss = policy_gradient_loss(logp, adv, w, mask, pg_keep=trust_keep(w, adv, 0.0, clip_high))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    policy = load_policy(a.base)
    behaviour = copy.deepcopy(policy) if a.lag else policy
    snapshots = [copy.deepcopy(policy.state_dict())]  # [k]: the policy at the end of version k
    opt = optimizer(policy, a.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / a.warmup) if a.warmup else 1.0
    )
    t0 = time.perf_counter()

    def evaluate(version: int) -> None:
        policy.eval()
        with ExitStack() as st:
            ss = [
                AgentSession(f"h{t.task_id}-{j}", t, st.enter_context(Sandbox(t)), MAX_TURNS)
                for t in tasks(a.eval_tasks, 10_001, held_out=True)
                for j in range(2)
            ]
            sample(policy, ss, a.temperature, 10_001, {})
            vs = [s.verdict() for s in ss]
        sc = scores(vs, [float(v.fixed) for v in vs], 2)
        figures = {k.removeprefix("heldout_"): round(x, 3) for k, x in sc.items()}
        figures.update(skill(policy))
        print(f"held-out v{version}: {json.dumps(figures)}", flush=True)

    evaluate(0)
    steps = 0
    for version in range(1, a.versions + 1):
        record: dict = {}
        with ExitStack() as st:
            ss = [
                AgentSession(f"s{version}-{i}", t, st.enter_context(Sandbox(t)), MAX_TURNS)
                for i, t in enumerate(
                    t for t in tasks(a.sessions // a.group, 1000 + version) for _ in range(a.group)
                )
            ]
            if a.lag:
                behaviour.load_state_dict(snapshots[max(0, version - 1 - a.lag)])
            behaviour.eval()
            sample(behaviour, ss, a.temperature, 777 * version, record)
            verdicts = [s.verdict() for s in ss]
        if a.reported:
            user = AgentUser(f"bench-{version}", seed=version)
            rewards = [reported_reward(user, s, v) for s, v in zip(ss, verdicts, strict=True)]
        else:
            rewards = [reward(v) for v in verdicts]
        groups = [list(range(g, g + a.group)) for g in range(0, len(ss), a.group)]
        random.Random(version).shuffle(groups)
        order = [i for g in groups for i in g]
        policy.train()
        for b0 in range(0, len(order), a.batch):
            idx = order[b0 : b0 + a.batch]
            # the trainer's advantages (trainer/objective.py), on whole groups of one task
            adv = advantages(
                torch.tensor([rewards[i] for i in idx]),
                [f"g{i // a.group}" if a.group > 1 else None for i in idx],
                a.adv_scale,
                negative_scale=a.negative_scale,
            )
            prompts, comps, routes, advs = [], [], [], []
            for j, i in enumerate(idx):
                for ids, c, r in record[ss[i].session_id]:
                    prompts.append(ids)
                    comps.append(c)
                    routes.append(r)
                    advs.append(float(adv[j]))
            logp = policy.logprobs(
                prompts, comps, routes if a.replay_routes else None, a.temperature
            )
            mask = torch.zeros_like(logp)
            for k, c in enumerate(comps):
                mask[k, : len(c)] = 1
            logp_b = None
            if a.lag:
                with torch.no_grad():
                    logp_b = behaviour.logprobs(
                        prompts, comps, routes if a.replay_routes else None, a.temperature
                    )
            pg_step(opt, policy, logp, mask, torch.tensor(advs), logp_b, a.trunc_c, a.clip_high)
            sched.step()
            steps += 1
            if a.probe_every and steps % a.probe_every == 0:
                print(f"step {steps}: {json.dumps(skill(policy))}", flush=True)
                policy.train()
        if a.lag:
            snapshots.append(copy.deepcopy(policy.state_dict()))
        n = len(verdicts)
        print(
            f"v{version}: sessions {n}, success {sum(v.fixed for v in verdicts) / n:.3f}, "
            f"mean reward {sum(rewards) / n:.3f}, give-ups {sum(v.gave_up for v in verdicts) / n:.2f}"
            f" ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        if version % a.eval_every == 0:
            evaluate(version)


if __name__ == "__main__":
    main()
