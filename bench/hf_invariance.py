"""Train/infer mismatch and the cost of invariance on 50-150M-parameter HF models (and the built-in policy).

    .venv/bin/python -m bench.hf_invariance                       # hf-dense, hf-moe, builtin
    .venv/bin/python -m bench.hf_invariance --models hf-dense --profile
    .venv/bin/python -m bench.hf_invariance --tiny --repeats 1    # smoke test (hidden-64 models)

For each HF model of bench/hf_models.py (built, briefly trained and cached on first use), loaded
through Flywheel's HF policy (`build_policy({"type": "hf", ...})`):
1. mismatch: behaviour log-probs logged by `HFPolicy.generate()` (KV cache, left-padded batch,
   T = 1, MoE routes logged) against `logprobs()` of the same tokens (full forward, routes
   replayed), with `kernels: "default"` and `"invariant"`: max and mean |Δ| and the fraction of
   tokens whose float32 bits differ. The invariant row must be exactly 0: the benchmark exits
   non-zero if it is not.
2. cost: training tokens/s of forward + backward of `logprobs()` (`-mean`, batch x seq tokens of the
   repo text) with the default kernels and inside the invariant mode, each invariant matmul
   scheme of kernels/exact_matmul.py (`float64`: float64 slices on `torch.bmm`, the default and
   the contract; `int8`: int8 slices on `torch._int_mm`, experimental), interleaved round by round
   in the same process (the
   median of `--repeats`); ratio = default tokens/s / invariant tokens/s (target <= 1.35x).
   The mismatch (1) is measured with the default scheme; `--mismatch-int8` measures it with int8 too.
   The built-in policy (`builtin`: policy's default config, 1.4M parameters, its own
   invariant kernels of kernels/invariant.py, not the dispatch mode) is measured the same way,
   its invariant matmul as the exact-integer kernel (what it runs) and as the halving tree.
3. `--profile`: torch.profiler over one invariant forward + backward per scheme: the aten ops by
   self CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="hf-dense,hf-moe,builtin", help="comma-separated")
    p.add_argument("--tiny", action="store_true", help="hidden-64 HF models (smoke tests)")
    p.add_argument("--batch", type=int, default=4, help="sequences per training batch")
    p.add_argument("--seq", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    p.add_argument("--gen-prompts", type=int, default=4, help="prompts for the mismatch")
    p.add_argument("--gen-tokens", type=int, default=24, help="completion tokens per prompt")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--profile", action="store_true", help="torch.profiler of the invariant step")
    p.add_argument("--no-cost", action="store_true", help="the mismatch only")
    p.add_argument(
        "--mismatch-int8",
        action="store_true",
        help="also measure the mismatch with exact_matmul.SCHEME = int8 (reported, not enforced)",
    )
    return p.parse_args()


# ------------------------------------------------------------------ mismatch


def mismatch(policy, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """generate()'s behaviour log-probs vs logprobs() of the same tokens (routes replayed)."""
    import torch

    samples = policy.generate(prompts, max_tokens, temperature=1.0, seed=0)
    with torch.no_grad():
        lp = policy.logprobs(
            prompts, [s.tokens for s in samples], [s.routes for s in samples], temperature=1.0
        )
    got, want = [], []
    for i, s in enumerate(samples):
        want.append(torch.tensor(s.logprobs, dtype=torch.float32))
        got.append(lp[i, : len(s.tokens)].to(torch.float32))
    d = (torch.cat(got) - torch.cat(want)).abs()
    return {
        "tokens": d.numel(),
        "max": float(d.max()),
        "mean": float(d.mean()),
        "frac": float((d != 0).float().mean()),
    }


# ------------------------------------------------------------------ cost


def train_step(policy, rows: list[list[int]]) -> None:
    """Forward + backward of the mean next-token NLL through `logprobs()`."""
    policy.zero_grad(set_to_none=True)
    loss = -policy.logprobs([r[:1] for r in rows], [r[1:] for r in rows]).mean()
    loss.backward()


def variants(policy) -> dict[str, Any]:
    """name -> a context-free setter: default kernels, and the invariant ones per matmul scheme."""
    from kernels import exact_matmul

    def setter(kernels: str, scheme: str | None):
        def apply() -> None:
            policy.set_kernels(kernels)
            if scheme is not None:
                exact_matmul.SCHEME = scheme

        return apply

    if getattr(policy.config, "type", None) == "hf":
        return {
            "default": setter("default", None),
            "invariant fixed": setter("invariant", "fixed"),
            "invariant int8": setter("invariant", "int8"),
            "invariant float64": setter("invariant", "float64"),
        }
    from kernels import invariant

    exact, tree = invariant._matmul_inv, invariant._matmul_tree

    def builtin(kernels: str, matmul, scheme: str = "fixed"):
        def apply() -> None:
            policy.set_kernels(kernels)
            invariant._matmul_inv = matmul
            exact_matmul.SCHEME = scheme

        return apply

    return {
        "default": builtin("default", exact),
        "invariant (fixed-order matmul)": builtin("invariant", exact),
        "invariant (float64 exact matmul)": builtin("invariant", exact, "float64"),
        "invariant (tree matmul)": builtin("invariant", tree),
    }


def cost(policy, rows: list[list[int]], repeats: int) -> dict[str, float]:
    """tokens/s of `train_step` per variant, rounds interleaved, median of `repeats`."""
    from kernels import exact_matmul, invariant

    scheme, matmul = exact_matmul.SCHEME, invariant._matmul_inv
    times: dict[str, list[float]] = {}
    sets = variants(policy)
    policy.train()
    try:
        for apply in sets.values():  # warm-up round (weight slice caches, allocator)
            apply()
            train_step(policy, rows)
        for _ in range(repeats):
            for name, apply in sets.items():
                apply()
                t0 = time.perf_counter()
                train_step(policy, rows)
                times.setdefault(name, []).append(time.perf_counter() - t0)
    finally:
        exact_matmul.SCHEME, invariant._matmul_inv = scheme, matmul
        policy.eval()
    n_tokens = sum(len(r) - 1 for r in rows)
    return {name: n_tokens / statistics.median(ts) for name, ts in times.items()}


def profile(policy, rows: list[list[int]], console, top: int = 12) -> None:
    """Self CPU time by aten op of one invariant forward + backward per scheme."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kernels import exact_matmul

    scheme = exact_matmul.SCHEME
    policy.train()
    try:
        for name, apply in variants(policy).items():
            if name == "default":
                continue
            apply()
            train_step(policy, rows)
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                train_step(policy, rows)
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in events)
            console.print(
                f"[bold]{name}[/]: fwd+bwd {total / 1e6:.2f} s of self CPU time, top ops:"
            )
            for e in events[:top]:
                console.print(
                    f"  {e.key:<42} {e.self_cpu_time_total / 1e6:7.3f} s  "
                    f"{e.self_cpu_time_total / total:6.1%}  {e.count:6d} calls"
                )
    finally:
        exact_matmul.SCHEME = scheme
        policy.eval()


# ------------------------------------------------------------------ models


def load(name: str, tiny: bool, console):
    """(policy, token stream) for `name`: an HF model of bench/hf_models.py or `builtin`."""
    import torch

    from policy import build_policy

    if name == "builtin":
        from bench.training import load_text_bytes

        torch.manual_seed(0)
        return build_policy({}), torch.tensor(list(load_text_bytes(400_000)), dtype=torch.long)
    from bench.hf_models import model_dir, token_stream

    path = model_dir(name, "tiny" if tiny else "full", console)
    return build_policy({"type": "hf", "model_dir": str(path)}), token_stream(path)


def windows(data, n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(0, len(data) - length, (n,), generator=g)
    return [data[i : i + length].tolist() for i in ix]


def main() -> None:
    args = parse_args()
    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    console = Console(width=170)
    mis = Table(title="train/infer mismatch: generate() behaviour log-probs vs logprobs()")
    for col in ("model", "params", "kernels", "tokens", "max |Δ|", "mean |Δ|", "tokens differing"):
        mis.add_column(col, justify="right")
    cst = Table(
        title=f"cost of invariance: training tokens/s (fwd+bwd of logprobs, batch {args.batch} x "
        f"{args.seq} tokens, {args.threads} thread(s), median of {args.repeats}, interleaved)"
    )
    for col in ("model", "params", "kernels", "tokens/s", "ratio vs default"):
        cst.add_column(col, justify="right")
    failures = []
    for name in args.models.split(","):
        policy, data = load(name, args.tiny, console)
        n = sum(p.numel() for p in policy.parameters())
        params = f"{n / 1e6:.1f}M"
        if name != "builtin":
            prompts = windows(data, args.gen_prompts, 12, seed=2)
            prompts = [p[: 4 + 3 * i] for i, p in enumerate(prompts)]  # mixed lengths: left padding
            from kernels import exact_matmul

            default_scheme = exact_matmul.SCHEME
            runs = [("default", None), ("invariant", None)]
            runs += [("invariant", "int8")] if args.mismatch_int8 else []
            for kernels, scheme in runs:
                policy.set_kernels(kernels)
                exact_matmul.SCHEME = scheme or default_scheme
                try:
                    r = mismatch(policy, prompts, args.gen_tokens)
                finally:
                    exact_matmul.SCHEME = default_scheme
                mis.add_row(
                    name,
                    params,
                    kernels + (f" ({scheme})" if scheme else ""),
                    str(r["tokens"]),
                    f"{r['max']:.3g}",
                    f"{r['mean']:.3g}",
                    f"{r['frac']:.1%}",
                )
                if kernels == "invariant" and scheme is None and r["max"] != 0:
                    failures.append(f"{name}: invariant mismatch max |Δ| {r['max']:.3g}")
        rows = windows(data, args.batch, args.seq + 1, seed=3)
        tps = {} if args.no_cost else cost(policy, rows, args.repeats)
        for kernels, v in tps.items():
            cst.add_row(name, params, kernels, f"{v:,.0f}", f"{tps['default'] / v:.2f}x")
        if args.profile and name != "builtin":
            profile(policy, rows, console)
        del policy
    console.print(mis)
    console.print(cst)
    if failures:
        console.print("[red bold]FAILED: invariant kernels must give exactly 0 mismatch[/]")
        for f in failures:
            console.print(f"  {f}")
        raise SystemExit(1)
    if any(name != "builtin" for name in args.models.split(",")):
        console.print("invariant kernels: generate() == logprobs() bit for bit on every HF model")


if __name__ == "__main__":
    main()
