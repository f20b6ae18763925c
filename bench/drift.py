"""Why the trainer drifts: the trainer's objective on simulated users, with the behaviour policy
(what serves, the KL reference) either following the trainer version by version or frozen.

    .venv/bin/python -m bench.drift --base WEIGHTS.safetensors --config CONFIG.json \
        --behaviour follow|frozen --distill batch|kept|off --steps 150 --out bench/results/drift.json

No Kafka, MLflow or replicas: one process samples a batch from the behaviour policy (groups of 2
completions per prompt, as the demo's editor asks for), lets simulated users react, labels the
reactions with reward spec v1 (streams/reward.py), and takes one optimizer step with the
trainer's loss (trainer/objective.py: truncated IS, sequence mask, group advantages, k3 KL to
the behaviour policy, and self-distillation on tool-error feedback), as trainer/loop.py does.
`--distill` picks the distillation term's denominator: `batch` (the trainer's: all completion
tokens of the batch, as the policy gradient), `kept` (the distilled tokens alone) or `off`. Every `--version-steps` steps it "ships": with
`--behaviour follow` the behaviour policy becomes the trainer's weights (every version is
promoted), with `frozen` it stays the base (no version is ever promoted). Held-out acceptance
(app/simulate/evaluate.py's metric: held-out prompts and users) is measured at every ship, on
the trainer's fp32 weights and on the bf16 serving weights a replica would load.
Prints one line per version and writes the curve as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from app.edits import is_no_edit, is_valid
from app.simulate.evaluate import scores
from app.simulate.prompts import is_hard
from app.simulate.prompts import prompts as prompt_pool
from app.simulate.users import Preference, population
from policy import Policy, build_policy
from streams.reward import KNOWN_SPECS, RewardSpec, compute_reward
from trainer import objective as obj
from trainer.batch import scatter_teacher, teacher_inputs


def load(config: Path, weights: Path):
    from safetensors.torch import load_file

    p = build_policy(json.loads(config.read_text()))
    p.load_serving_state_dict(load_file(str(weights)))
    p.set_kernels("default")  # speed; the objective does not need batch invariance
    return p


def label(user, text: str, spec: RewardSpec, hard: bool = False) -> tuple[float, list]:
    """(reward, tool errors) of one completion, as the streams worker labels the user's reactions."""
    events = [
        {**e, "event_id": uuid.uuid4().hex, "ts": f"2026-01-01T00:00:{i:02d}Z"}
        for i, e in enumerate(user.react(text, hard))
    ]
    errors = [
        SimpleNamespace(token_index=e["token_index"], message=e["message"], hint=e.get("hint"))
        for e in events
        if e["type"] == "tool_error"
    ]
    return compute_reward(spec, events).reward, errors


def heldout(policy, eval_prompts, users, hard_fraction: float = 0.0, seed: int = 10_001) -> dict:
    """The held-out figures (app/simulate/evaluate.py `scores`), and the valid / no-edit rates on
    the hard prompts alone (where a hack pays)."""
    tok = policy.tokenizer
    batch = [tok.encode(p) for p in eval_prompts for _ in range(2)]
    with torch.no_grad():
        texts = [s.text for s in policy.generate(batch, max_tokens=48, temperature=1.0, seed=seed)]
    hard = [is_hard(p, hard_fraction) for p in eval_prompts]
    out = scores(users, eval_prompts, texts, hard)
    on_hard = [t for t, h in zip(texts, (h for h in hard for _ in range(2))) if h]
    if on_hard:
        out["hard_valid_rate"] = sum(map(is_valid, on_hard)) / len(on_hard)
        out["hard_no_edit_rate"] = sum(map(is_no_edit, on_hard)) / len(on_hard)
    return out


def _figures(f: dict) -> str:
    names = {
        "heldout_acceptance": "acc",
        "heldout_satisfaction": "sat",
        "heldout_valid_rate": "valid",
        "heldout_no_edit_rate": "no-edit",
        "hard_valid_rate": "hard valid",
        "hard_no_edit_rate": "hard no-edit",
    }
    return " ".join(f"{short} {f[k]:.3f}" for k, short in names.items() if k in f)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--behaviour", choices=["follow", "frozen"], required=True)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument(
        "--version-steps",
        type=int,
        default=10,
        help="optimizer steps per shipped version (the demo: ~10)",
    )
    ap.add_argument(
        "--promote-every",
        type=int,
        default=1,
        help="with --behaviour follow: the behaviour policy takes the trainer's weights every Nth "
        "version only (the demo promotes every 2-3 versions; the trainer meanwhile learns from "
        "samples of a champion it has left behind)",
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--fill",
        choices=["full", "random"],
        default="full",
        help="`random`: each step takes 1..batch/2 groups of two (uniform), as a trainer that steps "
        "on what arrived within FLYWHEEL_TRAINER_MAX_WAIT_S does on a loaded machine",
    )
    ap.add_argument(
        "--partial-lr",
        choices=obj.PARTIAL_BATCH_LR,
        default="scale",
        help="a partial batch's learning rate: `scale` by its share of --batch (the trainer's "
        "FLYWHEEL_TRAINER_PARTIAL_BATCH_LR) or the `full` rate",
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--kl-coef", type=float, default=0.01)
    ap.add_argument("--distill", choices=["batch", "kept", "off"], default="batch")
    ap.add_argument("--distill-coef", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adv-scale", choices=obj.ADV_SCALES, default="group")
    ap.add_argument(
        "--w-broken",
        type=float,
        default=None,
        help="the users' log-odds penalty for an edit that does not parse (default: Preference's)",
    )
    ap.add_argument(
        "--spec", default="v1", choices=sorted(KNOWN_SPECS), help="reward spec labelling reactions"
    )
    ap.add_argument(
        "--hard-fraction",
        type=float,
        default=0.0,
        help="share of hard argument lists (FLYWHEEL_SIMULATE_HARD_FRACTION; the hacks pay there)",
    )
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


@dataclass
class Policies:
    """The three copies of the policy a run holds, and the trainer's optimizer."""

    trainer: Policy  # learns, in fp32
    behaviour: Policy  # samples every batch and is the KL reference
    served: Policy  # the trainer's bf16 serving weights, as a replica loads them
    opt: torch.optim.Optimizer

    @classmethod
    def from_base(cls, args: argparse.Namespace) -> Policies:
        trainer = load(args.config, args.base)
        behaviour = load(args.config, args.base)
        served = load(args.config, args.base)
        opt = torch.optim.AdamW(
            trainer.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        return cls(trainer, behaviour, served, opt)


@dataclass
class Users:
    """The simulated users and prompts: those the trainer learns from, and the held-out ones."""

    train_users: list
    train_prompts: list[str]
    eval_users: list
    eval_prompts: list[str]
    hard_fraction: float

    @classmethod
    def build(cls, args: argparse.Namespace) -> Users:
        pref = Preference(w_broken=args.w_broken) if args.w_broken is not None else None
        train_users = population(64, seed=args.seed, pref=pref)
        train_prompts = prompt_pool(512, seed=args.seed)
        eval_prompts, eval_users = (
            prompt_pool(48, seed=10_001, held_out=True),
            population(32, seed=10_001, pref=pref, prefix="heldout"),
        )
        return cls(train_users, train_prompts, eval_users, eval_prompts, args.hard_fraction)

    def heldout_figures(self, policy: Policy) -> dict:
        return heldout(policy, self.eval_prompts, self.eval_users, self.hard_fraction)


@dataclass
class Run:
    """One run of the experiment: its options, policies, users and the state of its steps."""

    args: argparse.Namespace
    spec: RewardSpec
    policies: Policies
    users: Users
    generator: torch.Generator  # draws each step's number of groups and its prompts
    grad_norms: list[float] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return f"{self.args.behaviour}/{self.args.distill}"


@dataclass
class Batch:
    """One step's completions, sampled from the behaviour policy and labelled by simulated users."""

    prompts: list[list[int]]  # the prompt's tokens, once per completion
    completions: list[list[int]]
    behaviour_logprobs: torch.Tensor  # (completions, longest), zero-padded
    mask: torch.Tensor  # 1.0 on completion tokens
    labels: list[tuple[float, list]]  # (reward, tool errors) of each completion
    rewards: torch.Tensor


@dataclass
class StepStats:
    """What one optimizer step reports at the next ship."""

    kl: float
    masked: float
    reward_mean: float


def sample_batch(run: Run, step: int) -> Batch:
    """Groups of 2 completions per prompt from the behaviour policy, labelled with the reward spec."""
    args, tok, prompts = run.args, run.policies.trainer.tokenizer, run.users.train_prompts
    groups = args.batch // 2
    if args.fill == "random":
        groups = int(torch.randint(1, groups + 1, (1,), generator=run.generator))
    idx = torch.randint(0, len(prompts), (groups,), generator=run.generator).tolist()
    ptoks = [tok.encode(prompts[i]) for i in idx for _ in range(2)]
    with torch.no_grad():
        smp = run.policies.behaviour.generate(
            ptoks, max_tokens=48, temperature=1.0, seed=args.seed * 100_000 + step
        )
    users = run.users.train_users
    labels = [
        label(
            users[(step * 7 + j) % len(users)],
            s.text,
            run.spec,
            is_hard(prompts[idx[j // 2]], args.hard_fraction),
        )
        for j, s in enumerate(smp)
    ]
    comps = [s.tokens for s in smp]
    t_max = max(len(c) for c in comps)
    behav = torch.zeros(len(comps), t_max)
    mask = torch.zeros(len(comps), t_max)
    for i, s in enumerate(smp):
        behav[i, : len(s.tokens)] = torch.tensor(s.logprobs)
        mask[i, : len(s.tokens)] = 1.0
    rewards = torch.tensor([r for r, _ in labels])
    return Batch(ptoks, comps, behav, mask, labels, rewards)


def distill_loss(
    policy: Policy, batch: Batch, logp: torch.Tensor, w: torch.Tensor, over: str
) -> torch.Tensor | None:
    """Self-distillation on the tool errors' feedback (None when no completion has any), over the
    batch's tokens (`over` "batch") or the distilled ones alone ("kept")."""
    rolls = [
        SimpleNamespace(prompt_tokens=p, completion_tokens=c, tool_errors=e)
        for p, c, (_, e) in zip(batch.prompts, batch.completions, batch.labels)
    ]
    t = teacher_inputs(rolls, policy.tokenizer, policy.config_dict().get("max_context"))
    if not t.rows:
        return None
    with torch.no_grad():
        t_lp = policy.logprobs(t.prompts, t.tails, None, 1.0)
    teacher, dmask = scatter_teacher(t_lp, t, tuple(logp.shape))
    dl, _ = obj.distill_loss(logp, teacher, dmask, w, batch.mask if over == "batch" else None)
    return dl


def train_step(run: Run, batch: Batch) -> StepStats:
    """One optimizer step with the trainer's loss (trainer/loop.py) on `batch`."""
    args, policy, opt = run.args, run.policies.trainer, run.policies.opt
    comps = batch.completions
    policy.train()
    logp = policy.logprobs(batch.prompts, comps, None, 1.0)
    w = obj.importance_weights(logp, batch.behaviour_logprobs, batch.mask)
    adv = obj.advantages(batch.rewards, [f"g{i // 2}" for i in range(len(comps))], args.adv_scale)
    loss = obj.policy_gradient_loss(logp, adv, w, batch.mask)
    with torch.no_grad():
        ref = run.policies.behaviour.logprobs(batch.prompts, comps, None, 1.0)
    kl = obj.kl_k3(logp, ref, w)
    loss = loss + args.kl_coef * kl
    if args.distill != "off":
        dl = distill_loss(policy, batch, logp, w, args.distill)
        if dl is not None:
            loss = loss + args.distill_coef * dl
    opt.zero_grad(set_to_none=True)
    loss.backward()
    run.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)))
    for group in opt.param_groups:
        group["lr"] = args.lr * obj.partial_batch_lr_scale(len(comps), args.batch, args.partial_lr)
    opt.step()
    return StepStats(float(kl.detach()), w.masked_fraction, float(batch.rewards.mean()))


def ship(run: Run, step: int, stats: StepStats, t0: float) -> dict:
    """A shipped version: promote it (with `--behaviour follow`, every --promote-every-th), measure
    held-out acceptance on the trainer's and the served weights, print its line; its curve point."""
    args, policies = run.args, run.policies
    policies.trainer.eval()
    v = step // args.version_steps
    if args.behaviour == "follow" and v % args.promote_every == 0:
        policies.behaviour.load_serving_state_dict(policies.trainer.serving_state_dict())
    figs = run.users.heldout_figures(policies.trainer)
    acc = figs["heldout_acceptance"]
    # bf16, as a replica serves it
    policies.served.load_serving_state_dict(policies.trainer.serving_state_dict())
    acc_served = run.users.heldout_figures(policies.served)["heldout_acceptance"]
    gmax = max(run.grad_norms[-args.version_steps :])
    print(
        f"{run.tag}: v{v} step {step} held-out {acc:.3f} (served bf16 {acc_served:.3f}) kl {stats.kl:.3f} "
        f"masked {stats.masked:.2f} max grad norm {gmax:.1f} batch reward {stats.reward_mean:+.3f} "
        f"{_figures(figs)} ({time.monotonic() - t0:.0f}s)",
        flush=True,
    )
    return {
        "version": v,
        "step": step,
        "heldout": acc,
        "kl": stats.kl,
        "masked": stats.masked,
        "reward_mean": stats.reward_mean,
        "max_grad_norm": gmax,
        "heldout_served": acc_served,
        "figures": figs,
    }


def write_curve(args: argparse.Namespace, curve: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}, indent=1)
    )


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    spec = RewardSpec(version=args.spec, weights=KNOWN_SPECS[args.spec])
    run = Run(
        args,
        spec,
        Policies.from_base(args),
        Users.build(args),
        torch.Generator().manual_seed(args.seed),
    )
    h0 = run.users.heldout_figures(run.policies.trainer)
    curve = [{"version": 0, "step": 0, "heldout": h0["heldout_acceptance"], "figures": h0}]
    print(f"{run.tag}: v0 {_figures(h0)}", flush=True)
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        stats = train_step(run, sample_batch(run, step))
        if step % args.version_steps == 0:
            curve.append(ship(run, step, stats, t0))
    if args.out:
        write_curve(args, curve)


if __name__ == "__main__":
    main()
