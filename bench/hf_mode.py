"""What batch_invariant_mode costs on Hugging Face models, and what it buys.

For a Llama (dense) and a Qwen2-MoE model built from configs with random weights:
1. forward + backward time of one training batch (right-padded, labels = inputs) with the
   default kernels and inside `batch_invariant_mode()`, side by side, and the ratio;
2. forward-only time of the same batch (what the replica and `logprobs()` pay);
3. the KV-cache decode vs full-forward logit mismatch (max |delta|, fraction of differing
   logits) with each kernel set: the invariant one must print 0;
4. with --profile, where the invariant forward spends its time, per covered aten op.

    .venv/bin/python -m bench.hf_mode
    .venv/bin/python -m bench.hf_mode --hidden 256 --layers 4 --seq 128 --batch 4 --profile
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict


def build(family: str, hidden: int, layers: int, vocab: int, attn: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    heads = max(4, hidden // 64)
    common = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "vocab_size": vocab,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 4096,
        "attn_implementation": attn,
    }
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    cfg = Qwen2MoeConfig(
        **common,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden,
        num_experts=8,
        num_experts_per_tok=2,
    )
    return Qwen2MoeForCausalLM(cfg)


def _batch(vocab: int, batch: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):  # right padding: row i is seq - 3i tokens long
        mask[i, max(1, seq - 3 * i) :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _timed(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_times(model, ids, mask, labels, steps: int, invariant: bool) -> tuple[float, float]:
    """(median s of forward + backward, median s of a no-grad forward)."""
    import contextlib

    import torch

    from kernels.hf_mode import batch_invariant_mode

    ctx = batch_invariant_mode if invariant else contextlib.nullcontext

    def train() -> None:
        model.zero_grad(set_to_none=True)
        with ctx():
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    def forward() -> None:
        with torch.no_grad(), ctx():
            model(input_ids=ids, attention_mask=mask)

    model.train()
    t_train = _timed(train, steps)
    model.eval()
    return t_train, _timed(forward, steps)


def decode_mismatch(model, seq_ids, invariant: bool) -> tuple[float, float]:
    """(max |delta logit|, fraction of logits with other bits) of a KV-cache decode vs the full forward."""
    import contextlib

    import torch
    from transformers import DynamicCache

    from kernels.hf_mode import batch_invariant_mode

    model.eval()
    with torch.no_grad(), batch_invariant_mode() if invariant else contextlib.nullcontext():
        full = model(input_ids=seq_ids[None]).logits[0]
        cache, rows = DynamicCache(config=model.config), []
        for t in range(len(seq_ids)):
            out = model(input_ids=seq_ids[None, t : t + 1], past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1])
    step = torch.stack(rows)
    return (step - full).abs().max().item(), (step != full).float().mean().item()


def profile(model, ids, mask) -> dict[str, float]:
    """Seconds per covered aten op in one invariant no-grad forward."""
    import torch

    from kernels import hf_mode

    spent: dict[str, float] = defaultdict(float)
    saved = dict(hf_mode._OVERRIDES)

    def timed(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0

        return run

    try:
        for op, fn in saved.items():
            hf_mode._OVERRIDES[op] = timed(op.name(), fn)
        model.eval()
        with torch.no_grad(), hf_mode.batch_invariant_mode():
            t0 = time.perf_counter()
            model(input_ids=ids, attention_mask=mask)
            spent["(total forward)"] = time.perf_counter() - t0
    finally:
        hf_mode._OVERRIDES.clear()
        hf_mode._OVERRIDES.update(saved)
    return dict(spent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="llama,moe", help="comma-separated: llama, moe")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=300)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    console = Console(width=200)
    table = Table(title=f"batch_invariant_mode cost ({args.attn}, {args.threads} thread(s))")
    for col in (
        "model",
        "params",
        "fwd+bwd default s",
        "fwd+bwd invariant s",
        "ratio",
        "fwd default s",
        "fwd invariant s",
        "ratio",
        "decode max|Δ| default",
        "differing",
        "decode max|Δ| invariant",
    ):
        table.add_column(col, justify="right")
    ids, mask, labels = _batch(args.vocab, args.batch, args.seq)
    for family in args.models.split(","):
        model = build(family, args.hidden, args.layers, args.vocab, args.attn)
        n_params = sum(p.numel() for p in model.parameters())
        train_d, fwd_d = step_times(model, ids, mask, labels, args.steps, invariant=False)
        train_i, fwd_i = step_times(model, ids, mask, labels, args.steps, invariant=True)
        d_max, d_frac = decode_mismatch(model, ids[0, : min(24, args.seq)], invariant=False)
        i_max, _ = decode_mismatch(model, ids[0, : min(24, args.seq)], invariant=True)
        table.add_row(
            family,
            f"{n_params / 1e6:.2f}M",
            f"{train_d:.4f}",
            f"{train_i:.4f}",
            f"{train_i / train_d:.1f}×",
            f"{fwd_d:.4f}",
            f"{fwd_i:.4f}",
            f"{fwd_i / fwd_d:.1f}×",
            f"{d_max:.2e}",
            f"{d_frac:.1%}",
            f"{i_max:.2e}",
        )
        if args.profile:
            spent = profile(model, ids, mask)
            total = spent.pop("(total forward)")
            console.print(f"[bold]{family}[/] invariant forward {total:.4f} s, by covered op:")
            for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
                console.print(f"  {name:<55} {s:8.4f} s  {s / total:6.1%}")
    console.print(table)


if __name__ == "__main__":
    main()
