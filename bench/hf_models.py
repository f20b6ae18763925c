"""Hugging Face models of a size that means something (50-150M parameters), built offline and cached.

    from bench.hf_models import HFTrainer
    tr = HFTrainer("hf-dense")        # or "hf-moe"; size="tiny" for smoke tests
    tr.step(1e-6); tr.serving()       # the bench/training.Trainer interface (bench/delta.py)

What is built, exactly as a user would hand a model to Flywheel:
- a byte-level BPE tokenizer (vocab 8192) trained with `tokenizers` on this repository's text
  (tests/hf_models.py's `train_bpe_tokenizer`, same special tokens and chat template);
- `hf-dense`: a Qwen2 (`Qwen2Config`: hidden 640, 12 layers, 10 heads / 2 KV heads, MLP 1792,
  untied lm_head) of ~63.6M parameters;
- `hf-moe`: a Qwen3-MoE (`Qwen3MoeConfig`: hidden 512, 8 layers, 8 heads / 2 KV heads, 16 experts
  top-2 of width 384 in every layer, fused `experts.gate_up_proj` / `down_proj`) of ~89M parameters
  (~23M active per token);
both saved with `save_pretrained` next to the tokenizer, loaded back through Flywheel's HF policy
(`build_policy({"type": "hf", "model_dir": ...})`), and trained `TRAIN_STEPS` AdamW steps at lr 1e-3
(next-token NLL on the repo text, the trainer's betas / weight decay / clipping) so that weights
and Adam moments are not at init. The trained fp32 weights are written back with save_pretrained
and the optimizer state beside them, under `bench/.cache/hf-models/<kind>-<size>-<recipe hash>/`
(gitignored): a rerun loads the cache in seconds. `size="tiny"` builds the same architectures at
hidden 64 / 2 layers (smoke tests: tests/unit/test_bench_hf.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from bench.training import Trainer

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "bench" / ".cache" / "hf-models"
TRAIN_STEPS = 40  # AdamW steps at TRAIN_LR before the model counts as "briefly trained"
TRAIN_LR = 1e-3
KINDS = ("hf-dense", "hf-moe")

# (architecture, size) -> config fields; vocab and special token ids come from the tokenizer
SHAPES: dict[tuple[str, str], dict[str, Any]] = {
    ("hf-dense", "full"): {
        "hidden_size": 640,
        "intermediate_size": 1792,
        "num_hidden_layers": 12,
        "num_attention_heads": 10,
        "num_key_value_heads": 2,
    },
    ("hf-moe", "full"): {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "moe_intermediate_size": 384,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 2,
    },
    ("hf-dense", "tiny"): {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    ("hf-moe", "tiny"): {
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
}
VOCAB = {"full": 8192, "tiny": 300}
TRAIN_BATCH = {"full": (4, 64), "tiny": (2, 16)}  # (sequences, tokens) per warm-up step


def _recipe(kind: str, size: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "shape": SHAPES[(kind, size)],
        "vocab": VOCAB[size],
        "steps": TRAIN_STEPS if size == "full" else 3,
        "lr": TRAIN_LR,
        "batch": TRAIN_BATCH[size],
        "version": 1,  # bump when the recipe's code changes
    }


def _hf_config(kind: str, size: str, tokenizer_dir: Path):
    from transformers import Qwen2Config, Qwen3MoeConfig

    from tests.hf_models import _special_ids

    fields = {**SHAPES[(kind, size)], **_special_ids(tokenizer_dir)}
    fields["max_position_embeddings"] = 1024
    if kind == "hf-dense":
        return Qwen2Config(tie_word_embeddings=False, **fields)
    return Qwen3MoeConfig(
        tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1, **fields
    )


def model_dir(kind: str, size: str = "full", console: Any = None) -> Path:
    """The cached, briefly trained model directory of `kind` (built and trained on first use)."""
    assert kind in KINDS, f"unknown HF bench model {kind!r}; expected one of {KINDS}"
    recipe = _recipe(kind, size)
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    out = CACHE / f"{kind}-{size}-{digest}"
    if (out / "optimizer.pt").is_file():
        return out
    _build(out, kind, size, recipe, console)
    return out


def _build(out: Path, kind: str, size: str, recipe: dict, console: Any) -> None:
    import time

    import torch

    from tests.hf_models import _save_model, train_bpe_tokenizer

    say = console.print if console is not None else print
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok_dir = train_bpe_tokenizer(tmp / "tokenizer", vocab_size=recipe["vocab"])
    _save_model(_hf_config(kind, size, tok_dir), tmp / "model", tok_dir, seed=0)
    tr = HFTrainer.__new__(HFTrainer)
    tr._setup(tmp / "model", *recipe["batch"], opt_state=None)
    say(
        f"built {kind} ({tr.n_params():,} parameters); training {recipe['steps']} AdamW steps at "
        f"lr {recipe['lr']:g}, batch {tr.batch} x {tr.seq} tokens…"
    )
    t0, loss = time.perf_counter(), float("nan")
    first = None
    for _ in range(recipe["steps"]):
        loss = tr.step(recipe["lr"])
        first = loss if first is None else first
    say(f"  loss {first:.3f} -> {loss:.3f} in {time.perf_counter() - t0:.0f} s")
    tr.model.model.save_pretrained(str(tmp / "model"))  # the trained fp32 weights
    torch.save(tr.opt.state_dict(), tmp / "model" / "optimizer.pt")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    (tmp / "model").rename(out)
    shutil.rmtree(tmp, ignore_errors=True)


def token_stream(model_dir_: Path):
    """The repo's .py/.md text (tests/hf_models.TEXT_DIRS) as one int64 tensor of token ids."""
    import torch
    from transformers import AutoTokenizer

    from tests.hf_models import _training_files

    tok = AutoTokenizer.from_pretrained(str(model_dir_))
    text = "\n".join(Path(f).read_text(errors="replace") for f in _training_files())
    return torch.tensor(tok(text)["input_ids"], dtype=torch.int64)


class HFTrainer(Trainer):
    """bench/training.Trainer (its optimizer, snapshot and restore) over Flywheel's HF policy: AdamW (the trainer's betas,
    weight decay, clipping) on next-token NLL of the repo text; `serving()` is the bf16 serving
    state dict (save_pretrained names), `model` the HFPolicy (kernels "default": training speed)."""

    def __init__(self, kind: str, batch: int = 4, seq: int = 64, size: str = "full", console=None):
        import torch

        path = model_dir(kind, size, console)
        self._setup(path, batch, seq, opt_state=torch.load(path / "optimizer.pt"))
        self.kind = f"HF {kind} ({type(self.model.model).__name__}, trained {_recipe(kind, size)['steps']} steps)"

    def _setup(self, path: Path, batch: int, seq: int, opt_state: dict | None) -> None:
        import torch

        from policy import build_policy

        self.torch = torch
        self.path = path
        self.model = build_policy({"type": "hf", "model_dir": str(path), "kernels": "default"})
        self.data = token_stream(path)
        self.batch, self.seq = batch, seq
        self.gen = torch.Generator().manual_seed(1)
        self._optimizer()
        if opt_state is not None:
            self.opt.load_state_dict(opt_state)

    def sample(self) -> list[list[int]]:
        """`batch` windows of `seq + 1` tokens from the repo text."""
        torch = self.torch
        ix = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=self.gen)
        return [self.data[i : i + self.seq + 1].tolist() for i in ix]

    def loss(self):
        rows = self.sample()
        return -self.model.logprobs([r[:1] for r in rows], [r[1:] for r in rows]).mean()

    def step(self, lr: float) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.model.train()
        loss = self.loss()
        self.opt.zero_grad()
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.model.eval()
        return float(loss.detach())

    def serving(self) -> dict:
        return {k: v.clone() for k, v in self.model.serving_state_dict().items()}
