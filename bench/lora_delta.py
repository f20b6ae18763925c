"""LoRA adapter size and adapter delta size against the full bf16 checkpoint, on 50-150M HF models.

    .venv/bin/python -m bench.lora_delta                   # hf-dense and hf-moe, r 8 and 16
    .venv/bin/python -m bench.lora_delta --tiny --ranks 8 --steps 1   # smoke test

Measured with `peft` directly (not through a Flywheel policy): the briefly trained models of
bench/hf_models.py loaded with `AutoModelForCausalLM` (fp32), wrapped by `get_peft_model` with
`LoraConfig(r, lora_alpha = 2 r, dropout 0)` on the attention and MLP projections (`q_proj k_proj
v_proj o_proj gate_proj up_proj down_proj`) and, for the MoE model, `target_parameters` on the
fused experts (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Only the adapter trains:
AdamW with the trainer's betas / weight decay / clipping on next-token NLL of the repo text.
After a warm-up of `--warmup` steps at lr 1e-3 (so B != 0 and Adam's moments are not at init),
each lr restarts from the warm adapter; for 1 and 10 steps the table prints: the adapter's bf16
size, Flywheel's delta codec (kernels.delta.encode_delta, the one bench/delta.py measures) on the
adapter's bf16 tensors from the warm one, and both against the full bf16 checkpoint (what a
full fine-tune ships) and the adapter's bf16 size.
"""

from __future__ import annotations

import argparse
import copy
import time

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="hf-dense,hf-moe")
    p.add_argument("--tiny", action="store_true", help="hidden-64 models (smoke tests)")
    p.add_argument("--ranks", default="8,16")
    p.add_argument("--lrs", default="1e-5,1e-4")
    p.add_argument("--steps", default="1,10")
    p.add_argument("--warmup", type=int, default=5, help="adapter steps at lr 1e-3 first")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def lora_model(path, rank: int, moe: bool):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    kwargs = {"experts_implementation": "eager"} if moe else {}
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs)
    full_bf16 = sum(t.numel() * 2 for t in base.state_dict().values() if t.is_floating_point())
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=ATTN_MLP if not moe else ATTN_MLP[:4],
        target_parameters=FUSED_EXPERTS if moe else None,
    )
    torch.manual_seed(0)
    return get_peft_model(base, cfg), full_bf16


def adapter_bf16(model) -> dict:
    """The trainable (adapter) tensors, bf16, by name."""
    import torch

    return {
        n: p.detach().to(torch.bfloat16).contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


class AdapterTrainer:
    def __init__(self, model, data, batch: int, seq: int):
        import torch

        from trainer.config import TrainerConfig

        tc = TrainerConfig()
        self.torch, self.model, self.data = torch, model, data
        self.batch, self.seq, self.clip = batch, seq, tc.max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            self.params, lr=1e-3, betas=tuple(tc.betas), weight_decay=tc.weight_decay
        )
        self.gen = torch.Generator().manual_seed(1)

    def step(self, lr: float) -> float:
        torch = self.torch
        for g in self.opt.param_groups:
            g["lr"] = lr
        ix = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[i : i + self.seq + 1] for i in ix])
        loss = self.model(input_ids=x, labels=x).loss
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        return float(loss.detach())

    def snapshot(self):
        return [p.detach().clone() for p in self.params], copy.deepcopy(self.opt.state_dict())

    def restore(self, snap) -> None:
        with self.torch.no_grad():
            for p, v in zip(self.params, snap[0]):
                p.copy_(v)
        self.opt.load_state_dict(snap[1])


def main() -> None:
    args = parse_args()
    import torch
    from rich.console import Console
    from rich.table import Table

    from bench.hf_models import model_dir, token_stream
    from kernels.delta import DEFAULT_LEVEL, encode_delta

    torch.set_num_threads(args.threads)
    console = Console(width=170)
    ranks = [int(x) for x in args.ranks.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    steps = sorted({int(x) for x in args.steps.split(",")})
    table = Table(
        title="LoRA adapter (peft) vs the full bf16 checkpoint: adapter bytes and its delta "
        f"(Flywheel's codec, zstd level {DEFAULT_LEVEL}) between versions"
    )
    for col in (
        "model",
        "full bf16 MB",
        "r",
        "adapter params",
        "adapter bf16 KB",
        "full / adapter",
        "lr",
        "steps",
        "delta KB",
        "full / delta",
        "adapter / delta",
    ):
        table.add_column(col, justify="right")
    for name in args.models.split(","):
        path = model_dir(name, "tiny" if args.tiny else "full", console)
        data = token_stream(path)
        for rank in ranks:
            model, full = lora_model(path, rank, moe=name == "hf-moe")
            tr = AdapterTrainer(model, data, args.batch, args.seq)
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                tr.step(1e-3)
            warm = tr.snapshot()
            base = adapter_bf16(model)
            size = sum(t.numel() * 2 for t in base.values())
            n_adapter = sum(t.numel() for t in base.values())
            for lr in lrs:
                tr.restore(warm)
                done = 0
                for s in steps:
                    while done < s:
                        tr.step(lr)
                        done += 1
                    blob = encode_delta(base, adapter_bf16(model), level=DEFAULT_LEVEL)
                    table.add_row(
                        name,
                        f"{full / 1e6:.1f}",
                        str(rank),
                        f"{n_adapter:,}",
                        f"{size / 1024:.0f}",
                        f"{full / size:.0f}x",
                        f"{lr:g}",
                        str(s),
                        f"{len(blob) / 1024:.1f}",
                        f"{full / len(blob):,.0f}x",
                        f"{size / len(blob):.1f}x",
                    )
            experts = sum(t.numel() for n, t in base.items() if ".experts." in n)
            console.print(
                f"{name} r={rank}: {n_adapter:,} adapter parameters ({experts:,} on fused experts), "
                f"{time.perf_counter() - t0:.0f} s of training"
            )
            del model, tr
    console.print(table)


if __name__ == "__main__":
    main()
