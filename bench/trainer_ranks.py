"""One rank of `bench/trainer.py --nproc N`: time the trainer's own step (`Trainer.forward_backward`,
the rank path under torchrun) on this rank's share of a fixed global batch.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.trainer_ranks \\
        --out results.json --batch 16 --steps 5

Rank 0 writes {"ranks", "threads", "tokens", "step_s": [...]} to --out. The rollouts are real
`Rollout` records over the synthetic code corpus whose behaviour log-probs are the policy's own
(importance ratio 1), so every sequence contributes to the loss as in on-policy training.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=16, help="Global batch (rollouts per step).")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompt-bytes", type=int, default=48)
    ap.add_argument("--completion-bytes", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank.")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from bench.trainer import _batch
    from policy import build_policy
    from trainer import objective as obj
    from trainer.config import TrainerConfig
    from trainer.distributed import World, allocate
    from trainer.loop import Trainer
    from trainer.rollout_record import Rollout
    from trainer.rollouts import Batch

    world = World.from_env()
    torch.manual_seed(0)
    policy = build_policy(None)
    prompts, comps = _batch(policy, args.batch, args.prompt_bytes, args.completion_bytes, seed=0)
    with torch.no_grad():
        behav = policy.logprobs(prompts, comps)
    rollouts = [
        Rollout(
            request_id=f"r{i}",
            session_id="s",
            model_version="1",
            prompt_tokens=p,
            completion_tokens=c,
            logprobs=[float(x) for x in behav[i, : len(c)]],
            reward=float(i % 3) - 1.0,
        )
        for i, (p, c) in enumerate(zip(prompts, comps))
    ]
    share = allocate([args.batch] * world.size, args.batch)
    start = sum(share[: world.rank])
    mine = rollouts[start : start + share[world.rank]]

    cfg = TrainerConfig(lr=1e-6, distill_coef=0.0, kl_coef=0.0, metrics_port=0)
    t = Trainer.__new__(Trainer)  # the step's code without Kafka or MLflow around it
    t.cfg, t.world, t.policy = cfg, world, policy
    t.optimizer = t._make_optimizer()
    t.kl_ctl = obj.AdaptiveKL(0.0, None)
    t.ref_policy, t.ref_version, t.sharded = None, None, False

    times = []
    for _ in range(args.steps + 1):  # the first step warms up
        world.barrier("bench step")
        t0 = time.perf_counter()
        t.forward_backward(Batch(rollouts=mine, staleness=[0] * len(mine)))
        times.append(time.perf_counter() - t0)
    slowest = [max(x) for x in zip(*world.all_gather(times[1:]))]  # a step ends on its slowest rank
    if world.is_main:
        tokens = sum(len(p) + len(c) for p, c in zip(prompts, comps))
        with open(args.out, "w") as f:
            json.dump(
                {
                    "ranks": world.size,
                    "threads": args.threads,
                    "tokens": tokens,
                    "step_s": slowest,
                },
                f,
            )
    world.close()


if __name__ == "__main__":
    main()
