"""Constrained decoding (tool calls) on the built-in engine: what the grammar mask costs, and the
log-prob gap it opens between the behaviour policy and the unmasked model.

    .venv/bin/python -m bench.constrained --quick      # tiny policy, seconds
    .venv/bin/python -m bench.constrained              # the default built-in policy
    .venv/bin/python -m bench.constrained --rows 8 --tokens 160 --reps 5 --json /tmp/c.json

On the built-in policy with random weights (default config: invariant kernels, what a replica
serves; `--quick`: a tiny one), a two-tool `tool_choice: "required"` grammar with parallel calls
(policy/constrain.py `tool_call_grammar`), measured side by side in one run:

1. **Throughput.** The same prompts and `max_tokens`, plain and constrained, in interleaved
   repetitions (median of each): ms per decoding step of the batch, generated tokens/s (tokens of
   rows still live), and the mask's own time (`Constraint.mask_logits` + `accept`) per step.
   Rows end at eos at other steps in the two modes (a plain untrained row samples eos at random,
   a constrained one only where the grammar allows it), and the batch runs until its last row
   ends, so ms/step is the like-for-like figure; tokens/s also counts steps of ended rows.
2. **First-token latency.** Prefill + first step (`max_tokens=1`) plain, and what compiling the
   grammar adds in front of it: cold (cache cleared: llguidance builds the matcher) and cached (an
   LRU hit), with (first token + compile) / first token.
3. **Numerics.** Over every constrained token: behaviour log-prob (the masked softmax, sampled
   from) minus the unmasked model's log-prob of the same token (`policy.logprobs`, routes
   replayed: what a trainer scoring the model computes) = -log Z, Z the mass the mask left:
   mean, p50, p99, max, and the fraction of tokens where the mask removed more than 0.1% of the
   mass (docs/NUMERICS.md, "Constrained decoding").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import percentile

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 48, "n_experts": 4, "top_k": 2}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny policy, 4 rows x 96 tokens, 2 reps")
    p.add_argument("--rows", type=int, default=8, help="completions per generate call")
    p.add_argument("--tokens", type=int, default=160, help="max_tokens of every call")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median)")
    p.add_argument("--compiles", type=int, default=10, help="cold and cached compiles timed")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.tokens, args.reps, args.compiles = 4, 96, 2, 3
    assert args.rows >= 1 and args.tokens >= 1 and args.reps >= 1, "sizes must be >= 1"
    return args


class Timed:
    """A Constraint as generate drives it, timing its calls and counting the steps."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds, self.steps = inner, 0.0, 0

    def mask_logits(self, step: int, logits: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner.mask_logits(step, logits)
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        return out

    def accept(self, step: int, tokens: list[int | None]) -> None:
        t0 = time.perf_counter()
        self.inner.accept(step, tokens)
        self.seconds += time.perf_counter() - t0


def run_once(policy: Any, prompts: list[list[int]], tokens: int, seed: int, compiled: Any) -> dict:
    """One generate call, plain (`compiled` None) or constrained: wall s, steps, tokens, mask s."""
    steps = [0]

    def count(step: int, _tokens: list[int | None]) -> bool:
        steps[0] = step + 1
        return True

    timed = None if compiled is None else Timed(compiled.start(len(prompts)))
    t0 = time.perf_counter()
    samples = policy.generate(prompts, tokens, 1.0, seed=seed, on_step=count, constraint=timed)
    wall = time.perf_counter() - t0
    return {
        "wall": wall,
        "steps": steps[0],
        "tokens": sum(len(s.tokens) for s in samples),
        "mask_s": 0.0 if timed is None else timed.seconds,
        "samples": samples,
    }


def throughput(policy: Any, prompts: list[list[int]], compiled: Any, args: Any) -> dict:
    """Interleaved plain / constrained runs (same seeds): medians and the constrained samples."""
    runs: dict[str, list[dict]] = {"plain": [], "constrained": []}
    run_once(policy, prompts, 4, 0, None)  # warm-up
    for rep in range(args.reps):
        runs["plain"].append(run_once(policy, prompts, args.tokens, rep, None))
        runs["constrained"].append(run_once(policy, prompts, args.tokens, rep, compiled))
    out: dict[str, Any] = {}
    for kind, rs in runs.items():
        out[kind] = {
            "ms_per_step": statistics.median(1e3 * r["wall"] / r["steps"] for r in rs),
            "tokens_per_s": statistics.median(r["tokens"] / r["wall"] for r in rs),
            "mask_ms_per_step": statistics.median(1e3 * r["mask_s"] / r["steps"] for r in rs),
            "steps": statistics.median(r["steps"] for r in rs),
        }
    out["samples"] = [s for r in runs["constrained"] for s in r["samples"]]
    return out


def first_token(policy: Any, prompts: list[list[int]], grammar: str, args: Any) -> dict:
    """Median ms of prefill + first step, of a cold compile and of a cached one."""
    from policy.constrain import clear_cache, compile_grammar

    first, cold, cached = [], [], []
    for rep in range(args.compiles):
        t0 = time.perf_counter()
        policy.generate(prompts, 1, 1.0, seed=rep)
        first.append(time.perf_counter() - t0)
        clear_cache()
        t0 = time.perf_counter()
        compile_grammar(policy.tokenizer, grammar)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compile_grammar(policy.tokenizer, grammar)
        cached.append(time.perf_counter() - t0)
    return {
        k: 1e3 * statistics.median(v)
        for k, v in (("first", first), ("cold", cold), ("cached", cached))
    }


def log_z_gap(policy: Any, prompts: list[list[int]], samples: list[Any]) -> dict:
    """Behaviour (masked) minus unmasked log-prob of every constrained token (= -log Z >= 0)."""
    import torch

    rows = len(prompts)
    gaps: list[float] = []
    for i in range(0, len(samples), rows):
        batch = samples[i : i + rows]
        with torch.no_grad():
            lp = policy.logprobs(prompts, [s.tokens for s in batch], [s.routes for s in batch], 1.0)
        for j, s in enumerate(batch):
            gaps += [b - float(u) for b, u in zip(s.logprobs, lp[j, : len(s.tokens)])]
    return {
        "tokens": len(gaps),
        "mean": statistics.fmean(gaps),
        "p50": percentile(gaps, 0.5),
        "p99": percentile(gaps, 0.99),
        "max": max(gaps),
        "min": min(gaps),
        "frac_masked": sum(g > 1e-3 for g in gaps) / len(gaps),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    import torch

    from policy import build_policy
    from policy.constrain import compile_grammar, ll_tokenizer, tool_call_grammar

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    policy = build_policy(dict(TINY) if args.quick else None).eval()
    tok = policy.tokenizer
    prompts = [tok.encode(f"user: weather or sum #{i}?\nassistant: ") for i in range(args.rows)]
    grammar = tool_call_grammar(TOOLS, None, parallel=True)
    t0 = time.perf_counter()
    ll_tokenizer(tok)
    ll_ms = 1e3 * (time.perf_counter() - t0)
    compiled = compile_grammar(tok, grammar)
    kind = "tiny" if args.quick else "default"
    print(
        f"built-in policy ({kind}, {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M "
        f"params, kernels {policy.config.kernels}), {args.rows} rows x {args.tokens} tokens, "
        f"T = 1, {args.reps} reps, {args.threads} thread(s); grammar {len(grammar)} bytes"
    )
    tp = throughput(policy, prompts, compiled, args)
    p, c = tp["plain"], tp["constrained"]
    print("throughput (median)         plain    constrained   ratio")
    print(
        f"  ms / decoding step    {p['ms_per_step']:10.2f} {c['ms_per_step']:12.2f}   "
        f"{c['ms_per_step'] / p['ms_per_step']:.3f}x"
    )
    print(
        f"  generated tokens/s    {p['tokens_per_s']:10.1f} {c['tokens_per_s']:12.1f}   "
        f"{c['tokens_per_s'] / p['tokens_per_s']:.3f}x"
    )
    print(
        f"  mask + accept ms/step {'-':>10} {c['mask_ms_per_step']:12.3f}   "
        f"{c['mask_ms_per_step'] / c['ms_per_step']:.1%} of a constrained step"
    )
    print(f"  steps per call        {p['steps']:10.0f} {c['steps']:12.0f}")
    ft = first_token(policy, prompts, grammar, args)
    print(f"first token (median of {args.compiles}): prefill + 1 step {ft['first']:.2f} ms")
    print(
        f"  + cold compile {ft['cold']:.2f} ms: {(ft['first'] + ft['cold']) / ft['first']:.2f}x; "
        f"+ cached {ft['cached']:.4f} ms: {(ft['first'] + ft['cached']) / ft['first']:.4f}x; "
        f"cold / cached {ft['cold'] / max(ft['cached'], 1e-9):.0f}x "
        f"(llguidance tokenizer, once per tokenizer: {ll_ms:.1f} ms)"
    )
    gap = log_z_gap(policy, prompts, tp["samples"])
    print(
        f"-log Z = behaviour lp - unmasked lp over {gap['tokens']} constrained tokens: mean "
        f"{gap['mean']:.3f}, p50 {gap['p50']:.3f}, p99 {gap['p99']:.3f}, max {gap['max']:.3f} "
        f"nats (min {gap['min']:.2g}); mask removed > 0.1% of the mass at "
        f"{gap['frac_masked']:.1%} of tokens"
    )
    figures = {"throughput": {k: tp[k] for k in ("plain", "constrained")}, "first_token_ms": ft}
    figures.update(log_z=gap, ll_tokenizer_ms=ll_ms, grammar_bytes=len(grammar))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
