"""One rank of tests/integration/trainer/test_distributed.py's numerics checks (started by torchrun,
or alone for the one-process reference): the real Trainer step code on a fixed global batch.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/integration/trainer/ddp_worker.py --out DIR --split 4,4
    python tests/integration/trainer/ddp_worker.py --out DIR --split 8

Each rank takes its slice of the same 8 rollouts (sampled from the tiny built-in policy, so their
behaviour log-probs are the replica's), checks that the log-probs it computes for them equal the
behaviour log-probs exactly, runs ONE `Trainer.forward_backward` (the rank path: global
advantages and token counts, gradients summed over ranks), and writes its weights and metrics
to `DIR/rank<R>.pt` / `DIR/rank<R>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from policy import build_policy
from tests.integration.trainer.conftest import TINY_POLICY, rollout_records
from trainer import objective as obj
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.distributed import World
from trainer.loop import Trainer
from trainer.rollouts import Batch, parse_rollout
from trainer.validate import ModelSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--split", required=True, help="rollouts per rank, e.g. 4,4 (sums to 8)")
    args = ap.parse_args()
    torch.manual_seed(0)
    world = World.from_env()
    split = [int(x) for x in args.split.split(",")]
    assert len(split) == world.size and sum(split) == 8, (split, world.size)

    policy = build_policy(TINY_POLICY)
    records = rollout_records(
        policy, 1, 8, lambda text: float(len(text) % 3) - 1.0, seed=11, group_size=2
    )
    spec = ModelSpec.of(policy, replay_routes=True, max_abs_reward=1e6)
    rollouts = []
    for r in records:
        rollout, refusal = parse_rollout(json.dumps(r).encode(), spec)
        assert refusal is None, refusal
        rollouts.append(rollout)
    start = sum(split[: world.rank])
    mine = rollouts[start : start + split[world.rank]]

    cfg = TrainerConfig(policy=TINY_POLICY, lr=1e-2, distill_coef=0.0, kl_coef=0.0, metrics_port=0)
    t = Trainer.__new__(Trainer)  # the step's code without Kafka or MLflow around it
    t.cfg, t.world, t.policy = cfg, world, policy
    t.optimizer = t._make_optimizer()
    t.kl_ctl = obj.AdaptiveKL(cfg.kl_coef, None)
    t.ref_policy, t.ref_version, t.sharded = None, None, False

    exact = True
    if mine:
        c = collate(mine, cfg.temperature)
        with torch.no_grad():
            logp = policy.logprobs(c.prompts, c.completions, c.routes, c.temperatures)
        exact = bool(torch.equal(logp * c.mask, c.behav * c.mask))
    metrics = t.forward_backward(Batch(rollouts=mine, staleness=[0] * len(mine)))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "weights": {k: v.detach().clone() for k, v in policy.state_dict().items()},
            "grads": {
                n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None
            },
        },
        out / f"rank{world.rank}.pt",
    )
    (out / f"rank{world.rank}.json").write_text(
        json.dumps(
            {"exact_logprobs": exact, "metrics": metrics, "rollouts": len(mine), "pid": os.getpid()}
        )
    )
    world.close()


if __name__ == "__main__":
    main()
