"""Trainer-side numerics benchmark: training-step throughput and train/infer log-prob mismatch.

1. Tokens/s of one training step (log-probs with replayed routes -> policy-gradient surrogate
   loss -> backward -> AdamW step) with the batch-invariant kernels and with the default (BLAS,
   SDPA) kernels, measured side by side on the same model and batch; prints both and the ratio.
2. Mismatch between the behaviour log-probs logged by `generate()` and the trainer's recomputed
   `logprobs()`: max |delta logprob| and the fraction of tokens whose bits differ, for default /
   invariant kernels x route replay off / on.

3. `--nproc 1,2`: the trainer's own distributed step (`Trainer.forward_backward` on ranks started
   by torchrun, bench/trainer_ranks.py) on one global batch: tokens/s per rank count, the scaling
   efficiency tokens/s(N) / (N x tokens/s(1)), and one process with N threads as the baseline
   that uses the same cores, all measured in the same run.

    .venv/bin/python -m bench.trainer --quick
    .venv/bin/python -m bench.trainer --checkpoint .flywheel/base --threads 2
    .venv/bin/python -m bench.trainer --nproc 1,2
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


def ranks_tokens_per_s(nproc: int, threads: int, batch: int, steps: int) -> float:
    """Global-batch tokens/s of the trainer step on `nproc` ranks (torchrun), `threads` each."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        # --max-restarts: on a loaded machine gloo's first connection can fail; a restart redoes it
        argv += [f"--nproc-per-node={nproc}", "--max-restarts=2", "-m", "bench.trainer_ranks"]
        argv += ["--out", out]
        argv += ["--batch", str(batch), "--steps", str(steps), "--threads", str(threads)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        r = json.loads(open(out).read())
    return r["tokens"] / statistics.median(r["step_s"])


def scaling(nprocs: list[int], quick: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    batch, steps = (8, 2) if quick else (32, 5)
    t = Table(
        title=f"trainer step on N ranks (torchrun, gloo), global batch {batch} rollouts, tokens/s"
    )
    for col in ("ranks", "threads/rank", "tokens/s", "speed-up vs 1 rank", "efficiency"):
        t.add_column(col, justify="right")
    base = ranks_tokens_per_s(1, 1, batch, steps)
    for n in nprocs:
        tps = base if n == 1 else ranks_tokens_per_s(n, 1, batch, steps)
        t.add_row(str(n), "1", f"{tps:,.0f}", f"{tps / base:.2f}x", f"{tps / (n * base):.0%}")
        if n > 1:  # the same cores in one process: the baseline a rank count has to beat
            one = ranks_tokens_per_s(1, n, batch, steps)
            t.add_row("1", str(n), f"{one:,.0f}", f"{one / base:.2f}x", "-")
    Console().print(t)


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
    ap.add_argument(
        "--nproc",
        help="Comma-separated rank counts (e.g. 1,2): measure the distributed trainer step instead.",
    )
    args = ap.parse_args()
    if args.nproc:
        scaling([int(x) for x in args.nproc.split(",")], args.quick)
        return

    import torch
    from rich.console import Console
    from rich.table import Table

    from policy import build_policy, load_policy

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
