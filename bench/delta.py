"""Delta codec benchmark on real successive checkpoints of a transformer trained with AdamW.

    .venv/bin/python -m bench.delta --model policy     # the built-in policy (what the trainer ships)
    .venv/bin/python -m bench.delta                    # the ~0.88M-parameter fallback transformer
    .venv/bin/python -m bench.delta --quick            # short warm-up, lr {1e-6, 1e-5}, 1 step
    .venv/bin/python -m bench.delta --model policy --steps 1,10,100 --lrs 1e-6,1e-5   # docs/DESIGN.md §Delta sync grid
    .venv/bin/python -m bench.delta --model hf-dense   # a 63.6M-parameter Qwen2 (bench/hf_models.py)
    .venv/bin/python -m bench.delta --model hf-moe     # an 89M-parameter Qwen3-MoE (bench/hf_models.py)

The model (`--model`) is a Hugging Face model of bench/hf_models.py (`hf-dense`, `hf-moe`: 50-150M
parameters, built from a config, trained 40 steps at lr 1e-3 and cached, loaded through Flywheel's
HF policy; next-token NLL on the repo text; defaults: no further warm-up, batch 4 x 64 tokens, grid
lr {1e-6*, 1e-5} x {1, 10} steps, the fast codec only, best of 1; `--tiny` builds them at hidden 64
for smoke tests), the built-in policy (`policy`: policy.build_policy, fp32
masters, bf16 serving weights, 1.38M parameters) or the self-contained ~0.88M-parameter
transformer of bench/training.py (`fallback`, the default: ~0.3 s per step). Both are
trained by next-byte NLL on Python's standard-library sources with the TRAINER'S OPTIMIZER:
AdamW with `trainer.config.TrainerConfig`'s betas and weight decay, gradient-norm clipping at
its `max_grad_norm`, and its default learning rate (`TrainerConfig.lr`, 1e-6, marked `*`) in
the grid of learning rates. The trainer's RL objective differs from NLL, but Adam normalises
each element's update to about lr, so the fraction of bf16 values that change per step — what
sets a delta's size — depends on the lr and the steps, not on the loss.

Policy setting (documented choice for a 2-core CPU): the policy trains with its `default`
(BLAS) kernels, as trainer/pretrain.py does; the batch-invariant kernels the trainer uses for RL
change only the floating-point reduction order (not the size of an Adam update) and measured
2.1x slower per step here (4.7 s vs 9.9 s for 8 x 64 bytes on the shared 2 cores). Defaults for
the policy: warm-up 20 steps, batch 8 x 64 bytes, grid lr {1e-6*, 1e-5, 1e-4} x {1, 10} steps
(about 50 steps: a few minutes); `--steps 1,10,100` runs the full grid of docs/DESIGN.md §Delta sync (slower).

After a warm-up at lr 1e-3 (so weights and Adam moments are not at init), each learning rate
restarts from the same warm state and snapshots the serving state dict after each grid point.
For each (lr, steps) pair, measured side by side in this run at the same zstd level:
fraction of bf16 values changed; size ratio of the delta against the full bf16 checkpoint,
against zstd of the full checkpoint and against plain XOR + zstd of the whole checkpoint;
encode/decode throughput (MB/s of bf16 checkpoint, best of 3) of the reference and fast codecs; how many
of the changed tensors the codec entropy-coded (the `ans` layout of delta format 2, see
docs/DELTA.md; the rest use varint gaps / bitmap / dense + zstd); and that decoding is
bit-exact and both codecs wrote the same bytes. Measured on the policy (docs/DELTA.md): at the
trainer's default lr, 1 step, 63x vs bf16 with format 2 against 53x with format 1 (gaps + zstd).
Targets (docs/DESIGN.md §Delta sync): >= 100x vs full bf16 at lr 1e-6 / 1 step; >= 1.5x smaller than XOR + zstd
at every grid point. With the policy, the benchmark then syncs 4 replica processes through 3
successive 1-step versions at the trainer's default lr against the floor (bench/sync_replicas.py).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.training import Trainer

if TYPE_CHECKING:
    from rich.console import Console


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short warm-up, lr {1e-6, 1e-5}, 1 step")
    p.add_argument(
        "--level", type=int, default=None, help="zstd level for the codec and the baselines"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up steps at lr 1e-3 (default: fallback 150, policy 20; quick 5)",
    )
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; hf 4)")
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="bytes (hf: tokens) per sequence (default: fallback 128, policy 64, hf 64)",
    )
    p.add_argument(
        "--lrs", default=None, help="comma-separated learning rates (default 1e-6,1e-5,1e-4)"
    )
    p.add_argument(
        "--steps",
        default=None,
        help="comma-separated optimizer steps between versions (default: fallback 1,10,100; policy 1,10)",
    )
    p.add_argument(
        "--model",
        choices=["policy", "fallback", "hf-dense", "hf-moe"],
        default="fallback",
        help="policy: the built-in policy (policy; ~1.5-5 s per training step on the shared "
        "2 CPU cores); fallback: the ~0.88M-parameter transformer of bench/training.py (~0.3 s per step); "
        "hf-dense / hf-moe: the 50-150M-parameter HF models of bench/hf_models.py",
    )
    p.add_argument(
        "--tiny", action="store_true", help="hf models at hidden 64, 2 layers (smoke tests)"
    )
    p.add_argument(
        "--no-sync", action="store_true", help="skip the replica sync part (policy and hf)"
    )
    p.add_argument(
        "--sync-rounds",
        type=int,
        default=None,
        help="measured replica sync rounds (policy 10, hf 3; one more warm-up round runs first)",
    )
    return p.parse_args()


# ------------------------------------------------------------------ measurements


def measure(
    base: dict,
    target: dict,
    level: int,
    repeats: int = 3,
    impls: tuple[str, ...] = ("reference", "fast"),
) -> dict:
    import numpy as np
    import zstandard

    from kernels.delta import decode_delta, encode_delta, inspect_delta
    from kernels.delta.bits import tensor_bits

    names = sorted(base)
    full_b = b"".join(tensor_bits(base[n]).tobytes() for n in names)
    full_t = b"".join(tensor_bits(target[n]).tobytes() for n in names)
    full = len(full_t)
    zc = zstandard.ZstdCompressor(level=level)
    zfull = len(zc.compress(full_t))
    xor = (np.frombuffer(full_b, np.uint8) ^ np.frombuffer(full_t, np.uint8)).tobytes()
    xorz = len(zc.compress(xor))
    changed = sum(int((tensor_bits(base[n]) != tensor_bits(target[n])).sum()) for n in names)
    numel = sum(base[n].numel() for n in names)
    out = {"frac": changed / numel, "full": full, "zfull": zfull, "xorz": xorz}
    blobs = {}
    for impl in impls:
        enc_s, dec_s = [], []
        for _ in range(repeats):  # best of `repeats`: the shared cores' load only ever slows a run
            t0 = time.perf_counter()
            blobs[impl] = encode_delta(base, target, level=level, impl=impl)
            t1 = time.perf_counter()
            dec = decode_delta(base, blobs[impl], impl=impl)
            t2 = time.perf_counter()
            enc_s.append(t1 - t0)
            dec_s.append(t2 - t1)
        assert all(np.array_equal(tensor_bits(dec[n]), tensor_bits(target[n])) for n in names), (
            "not bit-exact"
        )
        out[f"enc_{impl}"] = full / 1e6 / min(enc_s)
        out[f"dec_{impl}"] = full / 1e6 / min(dec_s)
    out["same_bytes"] = blobs["reference"] == blobs["fast"] if "reference" in blobs else None
    out["delta"] = len(blobs["fast"])
    changed = [t for t in inspect_delta(blobs["fast"]).tensors if t.op == "delta"]
    out["ans"] = f"{sum(t.kind == 'ans' for t in changed)}/{len(changed)}"
    return out


# ------------------------------------------------------------------ the run


@dataclass(frozen=True)
class Grid:
    """What a run trains and measures: warm-up, grid of learning rates x steps, the chain of
    versions for the replica sync (`sync_steps` steps at the trainer's default lr; 0: none), and
    the codec settings."""

    level: int
    warmup: int
    steps: tuple[int, ...]
    lrs: tuple[float, ...]
    default_lr: float
    sync_steps: int
    impls: tuple[str, ...]
    repeats: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, default_lr: float) -> Grid:
        from kernels.delta import DEFAULT_LEVEL

        policy = args.model == "policy"
        hf = args.model.startswith("hf-")
        warmup = (
            args.warmup
            if args.warmup is not None
            else (0 if hf else 5 if args.quick else 20 if policy else 150)
        )
        if args.steps:
            steps = tuple(sorted({int(x) for x in args.steps.split(",")}))
        else:
            steps = (1,) if args.quick else (1, 10) if policy or hf else (1, 10, 100)
        lrs = (
            tuple(float(x) for x in args.lrs.split(","))
            if args.lrs
            else ((1e-6, 1e-5) if args.quick or hf else (1e-6, 1e-5, 1e-4))
        )
        # the reference codec and 3 repeats cost minutes on a 100+ MB checkpoint: hf times the fast one once
        impls, repeats = (("fast",), 1) if hf else (("reference", "fast"), 3)
        # versions one step apart at the default lr: a warm-up round + the measured ones
        sync_rounds = args.sync_rounds if args.sync_rounds is not None else (3 if hf else 10)
        sync_steps = 1 + sync_rounds if (policy or hf) and not args.no_sync else 0
        if sync_steps and default_lr not in lrs:
            lrs = tuple(sorted(lrs + (default_lr,)))
        return cls(
            args.level or DEFAULT_LEVEL,
            warmup,
            steps,
            lrs,
            default_lr,
            sync_steps,
            impls,
            repeats,
        )

    def steps_at(self, lr: float) -> int:
        """Optimizer steps taken at `lr` after the warm-up."""
        return max(max(self.steps), self.sync_steps if lr == self.default_lr else 0)

    def lr_label(self, lr: float) -> str:
        return f"{lr:g}{'*' if lr == self.default_lr else ''}"


@dataclass
class Checkpoints:
    """The serving state dicts a run trained."""

    pairs: dict[tuple[float, int], tuple[dict, dict]]  # (lr, steps) -> (base, target)
    chain: list[dict]  # successive versions one step apart at the default lr (replica sync)
    warmup_loss: float


def make_trainer(args: argparse.Namespace, console: Console) -> Trainer:
    if args.model.startswith("hf-"):
        from bench.hf_models import HFTrainer

        return HFTrainer(
            args.model, args.batch or 4, args.seq or 64, "tiny" if args.tiny else "full", console
        )
    return Trainer(args.model, args.batch or 8, args.seq or (64 if args.model == "policy" else 128))


def train(tr: Trainer, grid: Grid, console: Console) -> Checkpoints:
    """Warm up at lr 1e-3, then from that same warm state for each lr: snapshot the serving state
    at each grid point (and at every step of the sync chain at the default lr)."""
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("warm-up", total=grid.warmup)
        loss = float("nan")
        for _ in range(grid.warmup):
            loss = tr.step(1e-3)
            progress.advance(task)
        warm = tr.snapshot()
        pairs, chain = {}, []
        for lr in grid.lrs:
            tr.restore(warm)
            base, done = tr.serving(), 0
            last = grid.steps_at(lr)
            task = progress.add_task(f"lr {lr:g}", total=last)
            if lr == grid.default_lr:
                chain = [base]
            while done < last:
                tr.step(lr)
                done += 1
                progress.advance(task)
                if done in grid.steps:
                    pairs[(lr, done)] = (base, tr.serving())
                if lr == grid.default_lr and done <= grid.sync_steps:
                    chain.append(tr.serving())
    return Checkpoints(pairs, chain, loss)


def measure_grid(
    pairs: dict[tuple[float, int], tuple[dict, dict]], grid: Grid, console: Console
) -> dict[tuple[float, int], dict]:
    """`measure` of every (lr, steps) pair, printed as a table."""
    from rich.table import Table

    table = Table(title="delta codec vs baselines (ratios = baseline bytes / delta bytes)")
    for col in (
        "lr",
        "steps",
        "changed",
        "delta KB",
        "vs bf16",
        "vs zstd(full)",
        "vs XOR+zstd",
        "XOR+zstd vs bf16",
        "enc ref MB/s",
        "enc fast MB/s",
        "dec ref MB/s",
        "dec fast MB/s",
        "ans",
        "same bytes",
    ):
        table.add_column(col, justify="right")
    results = {}
    for (lr, s), (base, target) in sorted(pairs.items()):
        r = measure(base, target, grid.level, grid.repeats, grid.impls)
        results[(lr, s)] = r
        table.add_row(
            grid.lr_label(lr),
            str(s),
            f"{100 * r['frac']:.2f}%",
            f"{r['delta'] / 1024:.1f}",
            f"{r['full'] / r['delta']:.1f}x",
            f"{r['zfull'] / r['delta']:.1f}x",
            f"{r['xorz'] / r['delta']:.2f}x",
            f"{r['full'] / r['xorz']:.1f}x",
            f"{r['enc_reference']:.1f}" if "enc_reference" in r else "-",
            f"{r['enc_fast']:.1f}",
            f"{r['dec_reference']:.1f}" if "dec_reference" in r else "-",
            f"{r['dec_fast']:.1f}",
            r["ans"],
            str(r["same_bytes"]),
        )
    console.print(table)
    return results


def print_targets(
    results: dict[tuple[float, int], dict], grid: Grid, n_params: int, console: Console
) -> None:
    """The targets of docs/DESIGN.md §Delta sync, the published anchors, and the ratios by lr."""
    first = results.get((1e-6, 1))
    ok_xor = all(r["xorz"] / r["delta"] >= 1.5 for r in results.values())
    if first is not None:
        ok_100 = first["full"] / first["delta"] >= 100
        console.print(
            f"target >= 100x vs bf16 at lr 1e-6 / 1 step: {'MET' if ok_100 else 'MISSED'} "
            f"({first['full'] / first['delta']:.0f}x)"
        )
    console.print(
        f">= 1.5x vs XOR+zstd everywhere: {'MET' if ok_xor else 'MISSED'} "
        f"(min {min(r['xorz'] / r['delta'] for r in results.values()):.2f}x)"
    )
    if first is not None:
        console.print(
            f"published anchors: TRL sparse weight sync ~34-60x, PULSE ~130x (7B model); "
            f"here {first['full'] / first['delta']:.0f}x at lr 1e-6 / 1 step on {n_params / 1e6:.1f}M "
            "parameters"
        )
    d = results.get((grid.default_lr, 1))
    if d is not None:
        console.print(
            f"trainer default lr {grid.default_lr:g}, 1 step between versions: {100 * d['frac']:.2f}% changed, "
            f"{d['full'] / d['delta']:.0f}x vs bf16, {d['zfull'] / d['delta']:.0f}x vs zstd(full), "
            f"{d['xorz'] / d['delta']:.2f}x vs XOR+zstd; fast codec encode {d['enc_fast']:.0f} MB/s, "
            f"decode {d['dec_fast']:.0f} MB/s"
        )
    for s in grid.steps:
        row = [(lr, results[(lr, s)]) for lr in grid.lrs if (lr, s) in results]
        console.print(
            f"{s} step(s), ratio vs bf16 by lr: "
            + ", ".join(
                f"{grid.lr_label(lr)} -> {r['full'] / r['delta']:.0f}x "
                f"({100 * r['frac']:.1f}% changed)"
                for lr, r in row
            )
        )


def main() -> None:
    args = parse_args()
    from rich.console import Console

    hf = args.model.startswith("hf-")
    console = Console(width=170)
    tr = make_trainer(args, console)
    grid = Grid.from_args(args, tr.default_lr)
    console.print(
        f"model: {tr.kind}, {tr.n_params():,} parameters; warm-up {grid.warmup} steps at lr 1e-3; "
        f"batch {tr.batch} x {tr.seq} {'tokens' if hf else 'bytes'}; zstd level {grid.level}; trainer optimizer (AdamW betas "
        f"{tuple(tr.opt.defaults['betas'])}, weight decay {tr.opt.defaults['weight_decay']}, clip "
        f"{tr.max_grad_norm}); * = trainer default lr {tr.default_lr:g}"
    )
    t_train = time.perf_counter()
    ckpts = train(tr, grid, console)
    console.print(
        (f"warm-up loss {ckpts.warmup_loss:.3f}; " if grid.warmup else "")
        + f"training took {time.perf_counter() - t_train:.0f} s "
        f"({grid.warmup + sum(grid.steps_at(lr) for lr in grid.lrs)} steps)"
    )
    results = measure_grid(ckpts.pairs, grid, console)
    print_targets(results, grid, tr.n_params(), console)
    # ---- time to sync 4 local replicas vs the floor (payload / measured loopback
    # bandwidth + apply time), on versions one step apart at the trainer's default lr;
    # bench/sync_replicas.py starts its own Kafka + MLflow and 4 replica processes.
    if not (args.model == "policy" or hf):
        console.print("[yellow]replica sync: needs the built-in policy or an HF model[/]")
    elif grid.sync_steps:
        from bench import sync_replicas

        sync_replicas.bench_pair(
            {**tr.model.config_dict(), "kernels": "invariant"}, ckpts.chain, console
        )


if __name__ == "__main__":
    main()
