"""What the checkpoint benchmarks train: successive versions of a model under the trainer's optimizer.

`Trainer(model_kind, batch, seq)` trains the built-in policy (`"policy"`) or the self-contained
~0.88M-parameter fallback transformer (`"fallback"`) by next-byte NLL on Python's
standard-library sources, with `trainer.config.TrainerConfig`'s AdamW betas, weight decay,
gradient clipping and default learning rate. bench/delta.py measures the codec on the versions it
produces; bench/sync_replicas.py syncs replicas through them.
"""

from __future__ import annotations

import copy
import functools
import glob
import sysconfig
from pathlib import Path


def load_text_bytes(limit: int = 4_000_000) -> bytes:
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))
    return b"".join(Path(f).read_bytes() for f in files)[:limit]


class Trainer:
    """AdamW on next-byte NLL; `serving()` is the bf16 serving state dict (`policy_config`:
    fields of the built-in policy's config to change, e.g. a larger model)."""

    def __init__(self, model_kind: str, batch: int, seq: int, policy_config: dict | None = None):
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.data = torch.tensor(list(load_text_bytes()), dtype=torch.long)
        self.batch, self.seq = batch, seq
        self.gen = torch.Generator().manual_seed(1)
        if model_kind == "policy":
            from policy import build_policy

            # plain torch ops: training speed
            self.model = build_policy({**(policy_config or {}), "kernels": "default"})
            self.kind = "built-in policy " + self.model.config_dict()["type"]
        else:
            self.model, self.kind = fallback_lm()(), "fallback transformer"
        self.fallback = model_kind != "policy"
        self._optimizer()

    def _optimizer(self) -> None:
        """The trainer's optimizer on `self.model`: AdamW betas, weight decay, clipping, default lr."""
        from trainer.config import TrainerConfig

        tc = TrainerConfig()
        self.default_lr, self.max_grad_norm = tc.lr, tc.max_grad_norm
        self.opt = self.torch.optim.AdamW(
            self.model.parameters(), lr=1e-3, betas=tuple(tc.betas), weight_decay=tc.weight_decay
        )

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def loss(self):
        torch = self.torch
        ix = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[i : i + self.seq + 1] for i in ix])
        if self.fallback:
            logits = self.model(x[:, :-1])
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
            )
        rows = x.tolist()
        lp = self.model.logprobs([r[:1] for r in rows], [r[1:] for r in rows])
        return -lp.mean()

    def step(self, lr: float) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss = self.loss()
        self.opt.zero_grad()
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        return float(loss.detach())

    def serving(self) -> dict:
        if self.fallback:
            return {
                k: v.detach().to(self.torch.bfloat16).clone()
                for k, v in self.model.state_dict().items()
            }
        return {k: v.clone() for k, v in self.model.serving_state_dict().items()}

    def snapshot(self):
        return copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict())

    def restore(self, snap) -> None:
        self.model.load_state_dict(snap[0])
        self.opt.load_state_dict(snap[1])


@functools.cache
def fallback_lm() -> type:
    """The fallback transformer class (defined on first use: importing torch keeps --help slow)."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self, d: int, h: int, ff: int):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.attn = torch.nn.MultiheadAttention(d, h, batch_first=True)
            self.ff = torch.nn.Sequential(
                torch.nn.Linear(d, ff), torch.nn.GELU(), torch.nn.Linear(ff, d)
            )

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.ff(self.ln2(x))

    class FallbackLM(torch.nn.Module):
        """~0.88M-parameter byte-level transformer (d 128, 4 layers, 4 heads, ff 512)."""

        def __init__(
            self,
            vocab: int = 256,
            d: int = 128,
            layers: int = 4,
            heads: int = 4,
            ff: int = 512,
            ctx: int = 256,
        ):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(ctx, d)
            self.blocks = torch.nn.ModuleList([Block(d, heads, ff) for _ in range(layers)])
            self.lnf, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

        def forward(self, x):
            t = x.shape[1]
            mask = torch.triu(torch.full((t, t), float("-inf")), 1)
            y = self.tok(x) + self.pos(torch.arange(t))
            for b in self.blocks:
                y = b(y, mask)
            return self.head(self.lnf(y))

    return FallbackLM
