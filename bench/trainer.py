"""Trainer-side numerics benchmark: training-step throughput and train/infer log-prob mismatch.

1. Tokens/s of one training step (log-probs with replayed routes -> policy-gradient surrogate
   loss -> backward -> AdamW step) with the batch-invariant kernels and with the default (BLAS,
   SDPA) kernels, measured side by side on the same model and batch; prints both and the ratio.
2. Mismatch between the behaviour log-probs logged by `generate()` and the trainer's recomputed
   `logprobs()`: max |delta logprob| and the fraction of tokens whose bits differ, for default /
   invariant kernels x route replay off / on.

    .venv/bin/python -m bench.trainer --quick
    .venv/bin/python -m bench.trainer --checkpoint .flywheel/base --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time


def _batch(policy, n: int, prompt_bytes: int, completion_bytes: int, seed: int):
    from trainer.corpus import documents

    tok = policy.tokenizer
    docs = documents(seed=seed, n=n)
    prompts = [tok.encode(d)[:prompt_bytes] for d in docs]
    comps = [
        tok.encode(d)[prompt_bytes : prompt_bytes + completion_bytes] or [tok.eos_id] for d in docs
    ]
    return prompts, comps


def train_step_tokens_per_s(policy, prompts, comps, kernels: str, steps: int) -> float:
    """Median tokens/s (prompt + completion tokens) of forward + backward + AdamW step."""
    import torch

    policy.set_kernels(kernels)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    with torch.no_grad():
        routes = [None] * len(prompts)
    adv = torch.linspace(-1, 1, len(prompts))[:, None]
    n_tokens = sum(1 + len(p) + len(c) for p, c in zip(prompts, comps))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lp = policy.logprobs(prompts, comps, routes)
        loss = -(lp * adv).sum() / max(1, sum(len(c) for c in comps))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    policy.eval()
    return n_tokens / statistics.median(times)


def mismatch(
    policy, prompts, kernels: str, replay: bool, max_tokens: int, seed: int
) -> tuple[float, float, int]:
    """(max |dlogprob|, fraction of tokens with differing bits, tokens) of logprobs() vs generate()."""
    import numpy as np
    import torch

    policy.set_kernels(kernels)
    samples = policy.generate(prompts, max_tokens=max_tokens, temperature=1.0, seed=seed)
    with torch.no_grad():
        lp = policy.logprobs(
            prompts,
            [s.tokens for s in samples],
            [s.routes for s in samples] if replay else None,
            temperature=1.0,
        )
    d = np.concatenate(
        [
            np.abs(lp[i, : len(s.tokens)].numpy() - np.asarray(s.logprobs, np.float32))
            for i, s in enumerate(samples)
        ]
    )
    return float(d.max()), float((d > 0).mean()), int(d.size)


def route_drift(
    policy, prompts, lr: float, max_tokens: int, seed: int
) -> tuple[float, float, float]:
    """After one AdamW step at `lr` (weights moved, as between a generation and its training step):
    (fraction of logged routes the current router would now choose differently, mean |dlogprob|
    without replay, mean |dlogprob| with replay). Invariant kernels."""
    import copy

    import numpy as np
    import torch

    policy.set_kernels("invariant")
    samples = policy.generate(prompts, max_tokens=max_tokens, temperature=1.0, seed=seed)
    moved = copy.deepcopy(policy)
    opt = torch.optim.AdamW(moved.parameters(), lr=lr)
    moved.logprobs(prompts, [s.tokens for s in samples]).sum().neg().backward()
    opt.step()
    moved.eval()
    flips = total = 0
    with torch.no_grad():
        for p, s in zip(prompts, samples):
            seq = torch.tensor([[policy.tokenizer.bos_id, *p, *s.tokens]])
            _, routes = moved.forward_hidden(seq, torch.arange(seq.shape[1])[None])
            now = routes[0, len(p) : len(p) + len(s.tokens)].sort(-1).values.numpy()
            flips += int((now != np.sort(s.routes, -1)).any(-1).sum())
            total += now.shape[0] * now.shape[1]
        comps = [s.tokens for s in samples]
        lp_off = moved.logprobs(prompts, comps)
        lp_on = moved.logprobs(prompts, comps, [s.routes for s in samples])
    ref = [np.asarray(s.logprobs, np.float32) for s in samples]
    d_off = np.concatenate(
        [np.abs(lp_off[i, : len(r)].numpy() - r) for i, r in enumerate(ref)]
    ).mean()
    d_on = np.concatenate(
        [np.abs(lp_on[i, : len(r)].numpy() - r) for i, r in enumerate(ref)]
    ).mean()
    return flips / max(1, total), float(d_off), float(d_on)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="Small batch, few steps (CI smoke run).")
    ap.add_argument(
        "--checkpoint",
        help="Policy checkpoint dir (default: a freshly initialised default policy).",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from trainer.policy import build_policy, load_policy

    torch.set_num_threads(args.threads)
    console = Console()
    policy = load_policy(args.checkpoint) if args.checkpoint else build_policy(None)
    n_seq, p_len, c_len, steps = (4, 32, 32, 2) if args.quick else (16, 64, 64, 5)
    prompts, comps = _batch(policy, n_seq, p_len, c_len, args.seed)

    console.print(
        f"policy: {policy.config_dict()}  batch: {n_seq} x ({p_len} prompt + {c_len} completion) bytes, "
        f"threads {args.threads}"
    )
    tps = {
        k: train_step_tokens_per_s(policy, prompts, comps, k, steps)
        for k in ("default", "invariant")
    }
    t = Table(title="training step (forward + backward + AdamW), tokens/s")
    t.add_column("kernels")
    t.add_column("tokens/s", justify="right")
    for k, v in tps.items():
        t.add_row(k, f"{v:,.0f}")
    console.print(t)
    console.print(
        f"invariant / default throughput ratio: {tps['invariant'] / tps['default']:.3f} "
        f"(slowdown {tps['default'] / tps['invariant']:.1f}x)"
    )

    gen_prompts = prompts if not args.quick else prompts[:4]
    max_tokens = 32 if args.quick else 64
    m = Table(
        title=f"train/infer mismatch: logprobs() vs generate() behaviour log-probs ({len(gen_prompts)} sequences)"
    )
    for col in ("kernels", "route replay", "max |dlogprob|", "tokens differing", "tokens"):
        m.add_column(col, justify="right")
    for kernels in ("default", "invariant"):
        for replay in (False, True):
            mx, frac, n = mismatch(policy, gen_prompts, kernels, replay, max_tokens, args.seed)
            m.add_row(kernels, "on" if replay else "off", f"{mx:.3g}", f"{frac:.1%}", str(n))
    console.print(m)

    lr = 1e-5
    flip, d_off, d_on = route_drift(policy, gen_prompts, lr, max_tokens, args.seed)
    console.print(
        f"after one AdamW step at lr {lr:g} (invariant kernels): {flip:.1%} of logged (token, layer) "
        f"routes differ from the current router's top-{policy.config.top_k}; mean |dlogprob| vs behaviour: "
        f"{d_off:.3g} without replay, {d_on:.3g} with replay"
    )


if __name__ == "__main__":
    main()
