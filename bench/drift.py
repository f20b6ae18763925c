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
from pathlib import Path
from types import SimpleNamespace

import torch

from app.edits import is_no_edit, is_valid
from app.simulate.evaluate import scores
from app.simulate.prompts import is_hard
from app.simulate.prompts import prompts as prompt_pool
from app.simulate.users import Preference, population
from streams.reward import KNOWN_SPECS, RewardSpec, compute_reward
from trainer import objective as obj
from trainer.batch import scatter_teacher, teacher_inputs
from trainer.policy import build_policy


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


def main() -> None:
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
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    spec = RewardSpec(version=args.spec, weights=KNOWN_SPECS[args.spec])
    policy = load(args.config, args.base)
    behaviour = load(args.config, args.base)
    served = load(args.config, args.base)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    pref = Preference(w_broken=args.w_broken) if args.w_broken is not None else None
    users = population(64, seed=args.seed, pref=pref)
    train_prompts = prompt_pool(512, seed=args.seed)
    eval_prompts, eval_users = (
        prompt_pool(48, seed=10_001, held_out=True),
        population(32, seed=10_001, pref=pref, prefix="heldout"),
    )
    tok = policy.tokenizer
    h0 = heldout(policy, eval_prompts, eval_users, args.hard_fraction)
    curve = [{"version": 0, "step": 0, "heldout": h0["heldout_acceptance"], "figures": h0}]
    print(f"{args.behaviour}/{args.distill}: v0 {_figures(h0)}", flush=True)
    g = torch.Generator().manual_seed(args.seed)
    grad_norms: list[float] = []
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        groups = args.batch // 2
        if args.fill == "random":
            groups = int(torch.randint(1, groups + 1, (1,), generator=g))
        idx = torch.randint(0, len(train_prompts), (groups,), generator=g).tolist()
        ptoks = [tok.encode(train_prompts[i]) for i in idx for _ in range(2)]
        with torch.no_grad():
            smp = behaviour.generate(
                ptoks, max_tokens=48, temperature=1.0, seed=args.seed * 100_000 + step
            )
        labels = [
            label(
                users[(step * 7 + j) % len(users)],
                s.text,
                spec,
                is_hard(train_prompts[idx[j // 2]], args.hard_fraction),
            )
            for j, s in enumerate(smp)
        ]
        rewards = torch.tensor([r for r, _ in labels])
        comps = [s.tokens for s in smp]
        t_max = max(len(c) for c in comps)
        behav = torch.zeros(len(comps), t_max)
        mask = torch.zeros(len(comps), t_max)
        for i, s in enumerate(smp):
            behav[i, : len(s.tokens)] = torch.tensor(s.logprobs)
            mask[i, : len(s.tokens)] = 1.0
        policy.train()
        logp = policy.logprobs(ptoks, comps, None, 1.0)
        w = obj.importance_weights(logp, behav, mask)
        adv = obj.advantages(rewards, [f"g{i // 2}" for i in range(len(comps))], args.adv_scale)
        loss = obj.policy_gradient_loss(logp, adv, w, mask)
        with torch.no_grad():
            ref = behaviour.logprobs(ptoks, comps, None, 1.0)
        kl = obj.kl_k3(logp, ref, w)
        loss = loss + args.kl_coef * kl
        dkl = 0.0
        if args.distill != "off":
            rolls = [
                SimpleNamespace(prompt_tokens=p, completion_tokens=c, tool_errors=e)
                for p, c, (_, e) in zip(ptoks, comps, labels)
            ]
            t = teacher_inputs(rolls, tok, policy.config_dict().get("max_context"))
            if t.rows:
                with torch.no_grad():
                    t_lp = policy.logprobs(t.prompts, t.tails, None, 1.0)
                teacher, dmask = scatter_teacher(t_lp, t, tuple(logp.shape))
                dl, dkl = obj.distill_loss(
                    logp, teacher, dmask, w, mask if args.distill == "batch" else None
                )
                loss = loss + args.distill_coef * dl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        for group in opt.param_groups:
            group["lr"] = args.lr * obj.partial_batch_lr_scale(
                len(comps), args.batch, args.partial_lr
            )
        opt.step()
        grad_norms.append(gn)
        if step % args.version_steps == 0:
            policy.eval()
            v = step // args.version_steps
            if args.behaviour == "follow" and v % args.promote_every == 0:
                behaviour.load_serving_state_dict(policy.serving_state_dict())
            figs = heldout(policy, eval_prompts, eval_users, args.hard_fraction)
            acc = figs["heldout_acceptance"]
            served.load_serving_state_dict(
                policy.serving_state_dict()
            )  # bf16, as a replica serves it
            acc_served = heldout(served, eval_prompts, eval_users, args.hard_fraction)[
                "heldout_acceptance"
            ]
            gmax = max(grad_norms[-args.version_steps :])
            curve.append(
                {
                    "version": v,
                    "step": step,
                    "heldout": acc,
                    "kl": float(kl.detach()),
                    "masked": w.masked_fraction,
                    "reward_mean": float(rewards.mean()),
                    "max_grad_norm": gmax,
                    "heldout_served": acc_served,
                    "figures": figs,
                }
            )
            print(
                f"{args.behaviour}/{args.distill}: v{v} step {step} held-out {acc:.3f} (served bf16 {acc_served:.3f}) kl {float(kl.detach()):.3f} "
                f"masked {w.masked_fraction:.2f} max grad norm {gmax:.1f} batch reward {float(rewards.mean()):+.3f} "
                f"{_figures(figs)} ({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}, indent=1
            )
        )


if __name__ == "__main__":
    main()
