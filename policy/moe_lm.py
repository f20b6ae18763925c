"""The built-in policy: a small byte-level decoder with top-k MoE feed-forward layers.

Pre-norm transformer (RMSNorm, learned absolute positions, tied input/output embeddings), every
layer's FFN a mixture of `n_experts` SiLU MLPs with top-`top_k` routing (kernels/moe.py). Default
size (d_model 128, 4 layers, 4 heads, 4 experts top-2, context 256) is ~1.2M parameters and
trains at a useful speed on two CPU cores.

Numerics (docs/NUMERICS.md): compute dtype float32; parameters are fp32 masters but every
forward uses their bf16-rounded values (straight-through: the gradient reaches the fp32 master
unchanged), so a trainer holding fp32 masters and a replica holding the bf16 serving weights run
the identical forward. With `kernels="invariant"` (kernels/invariant.py) every op is batch- and
length-invariant; with route replay, `logprobs()` reproduces `generate()`'s behaviour log-probs
bit for bit. `kernels="default"` uses plain torch ops (BLAS, SDPA): faster, not invariant.

Sequences are `[bos] + prompt + completion`. Routes of completion token j are the expert ids
used at the position that *predicted* it (input position len(prompt) + j, counting bos as 0), so
routes[j] is known when token j is sampled and covers exactly the positions whose outputs give
the completion's log-probs.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

import policy.sampling as sampling
from kernels.exact_matmul import mark_derived
from kernels.invariant import COMPUTE_DTYPE, get_ops
from kernels.logprobs import log_probs, token_logprobs
from kernels.moe import load_balance_loss, moe_ffn, route
from policy.base import OnStep, Policy, Sample, replayed_rows
from policy.sampling import Prefill
from policy.tokenizer import ByteTokenizer


class MoEConfig(BaseModel):
    """Architecture and numerics of the built-in policy (JSON in every checkpoint)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["moe-byte"] = Field("moe-byte", description="Policy type for build_policy.")
    vocab_size: int = Field(259, description="Token ids; byte-v1 has 256 bytes + bos/eos/pad.")
    d_model: int = Field(128, ge=8, description="Residual stream width.")
    n_layers: int = Field(4, ge=1, description="Transformer blocks (every one has an MoE FFN).")
    n_heads: int = Field(4, ge=1, description="Attention heads; d_model must divide by it.")
    d_ff: int = Field(256, ge=8, description="Hidden width of each expert MLP.")
    n_experts: int = Field(4, ge=1, description="Experts per MoE layer.")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to.")
    max_context: int = Field(
        256, ge=8, description="Max tokens incl. bos (prompt + completion); a power of two."
    )
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    kernels: Literal["invariant", "default"] = Field(
        "invariant",
        description="invariant: batch-invariant fp32 kernels (bit-exact contract); default: plain torch ops.",
    )
    init_seed: int = Field(0, description="Seed of the parameter initialisation.")

    @field_validator("max_context")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"max_context must be a power of two, got {v}")
        return v

    def model_post_init(self, _ctx: Any) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k {self.top_k} > n_experts {self.n_experts}")


class _RoundToBF16(torch.autograd.Function):
    """Forward: the value rounded to bf16 (exactly representable in fp32). Backward: identity."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return w.to(torch.bfloat16).to(COMPUTE_DTYPE)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


_ROUNDED: dict[
    int, tuple[weakref.ref, int, torch.Tensor]
] = {}  # id(param) -> (param, version, rounded)


def serving_weight(w: torch.Tensor) -> torch.Tensor:
    """The bf16-rounded value of an fp32 master weight, with a straight-through gradient.

    Without autograd (generation, evaluation) the rounded copy is cached per parameter and
    refreshed whenever the parameter changes (its in-place version counter moves).
    """
    if torch.is_grad_enabled() and w.requires_grad:
        return mark_derived(_RoundToBF16.apply(w), w, "bf16")
    hit = _ROUNDED.get(id(w))
    if hit is None or hit[0]() is not w or hit[1] != w._version:
        with torch.no_grad():
            hit = (
                weakref.ref(w, lambda _r, key=id(w): _ROUNDED.pop(key, None)),
                w._version,
                mark_derived(w.detach().to(torch.bfloat16).to(COMPUTE_DTYPE), w, "bf16"),
            )
        _ROUNDED[id(w)] = hit
    return hit[2]


class _Block(torch.nn.Module):
    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        d = c.d_model
        self.ln1 = torch.nn.Parameter(torch.ones(d))
        self.wqkv = torch.nn.Parameter(torch.randn(d, 3 * d) / math.sqrt(d))
        self.wo = torch.nn.Parameter(torch.randn(d, d) / math.sqrt(d) / math.sqrt(2 * c.n_layers))
        self.ln2 = torch.nn.Parameter(torch.ones(d))
        self.router = torch.nn.Parameter(torch.randn(d, c.n_experts) * 0.02)
        self.w1 = torch.nn.Parameter(torch.randn(c.n_experts, d, c.d_ff) / math.sqrt(d))
        self.w2 = torch.nn.Parameter(
            torch.randn(c.n_experts, c.d_ff, d) / math.sqrt(c.d_ff) / math.sqrt(2 * c.n_layers)
        )


class MoEPolicy(Policy):
    """Byte-level MoE decoder implementing the Policy interface (see module docstring)."""

    def __init__(self, config: MoEConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or MoEConfig()
        self.tokenizer = ByteTokenizer()
        assert c.vocab_size == self.tokenizer.vocab_size, (
            f"vocab_size {c.vocab_size} != byte-v1 {self.tokenizer.vocab_size}"
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(c.init_seed)
            self.tok_emb = torch.nn.Parameter(
                torch.randn(c.vocab_size, c.d_model) / math.sqrt(c.d_model)
            )
            self.pos_emb = torch.nn.Parameter(torch.randn(c.max_context, c.d_model) * 0.1)
            self.blocks = torch.nn.ModuleList(_Block(c) for _ in range(c.n_layers))
            self.ln_f = torch.nn.Parameter(torch.ones(c.d_model))
        self.ops = get_ops(c.kernels)
        self.aux_loss = torch.zeros(())  # load-balance loss of the last forward (training only)

    # --- config ---------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        return self.config.model_dump()

    def set_kernels(self, name: Literal["invariant", "default"]) -> None:
        """Switch the kernel set (e.g. pretrain with `default` for speed, serve with `invariant`)."""
        self.ops = get_ops(name)
        self.config = self.config.model_copy(update={"kernels": name})

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    @property
    def top_k(self) -> int:
        return self.config.top_k

    # --- the forward ----------------------------------------------------------------------------
    def forward_hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        replay_ids: torch.Tensor | None = None,
        replay_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens/positions [B, S] int64 -> (final-normed hidden [B, S, D] fp32, routes [B, S, L, k] int64).

        Without a cache, position j attends to keys 0..j of this call (causal). With a cache (one
        (k, v) pair of [B, H, max_context, d_head] per layer, see `new_cache`), this call's keys and
        values are written at `positions` first and the queries attend to cache keys 0..position.
        replay_ids [B, S, L, k] replace the router's choice where replay_mask [B, S] is True.
        """
        c, ops = self.config, self.ops
        b, s = tokens.shape
        h_dim, d_head = c.n_heads, c.d_model // c.n_heads
        assert int(positions.max()) < c.max_context, (
            f"position {int(positions.max())} >= max_context {c.max_context}"
        )
        x = serving_weight(self.tok_emb)[tokens] + serving_weight(self.pos_emb)[positions]
        routes, aux = [], []
        flat_mask = None if replay_mask is None else replay_mask.reshape(-1)
        for li, blk in enumerate(self.blocks):
            a = ops.rms_norm(x, serving_weight(blk.ln1), c.norm_eps)
            qkv = ops.matmul(a, serving_weight(blk.wqkv)).view(b, s, 3, h_dim, d_head)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, S, d]
            if cache is not None:
                ck, cv = cache[li]
                bidx = torch.arange(b)[:, None]
                ck.permute(0, 2, 1, 3)[bidx, positions] = k.transpose(1, 2).detach()
                cv.permute(0, 2, 1, 3)[bidx, positions] = v.transpose(1, 2).detach()
                n_keys = int(positions.max()) + 1
                k, v = ck[:, :, :n_keys], cv[:, :, :n_keys]
            att = ops.attention(q, k, v, positions).transpose(1, 2).reshape(b, s, c.d_model)
            x = x + ops.matmul(att, serving_weight(blk.wo))
            m = ops.rms_norm(x, serving_weight(blk.ln2), c.norm_eps).reshape(b * s, c.d_model)
            logits = ops.matmul(m, serving_weight(blk.router))
            rid = None if replay_ids is None else replay_ids[:, :, li].reshape(b * s, c.top_k)
            ids, gates = route(logits, c.top_k, ops, rid, flat_mask)
            x = x + moe_ffn(
                m, ids, gates, serving_weight(blk.w1), serving_weight(blk.w2), ops
            ).view(b, s, c.d_model)
            routes.append(ids.view(b, s, c.top_k))
            if torch.is_grad_enabled():
                aux.append(load_balance_loss(logits, ids))
        self.aux_loss = torch.stack(aux).mean() if aux else torch.zeros(())
        return ops.rms_norm(x, serving_weight(self.ln_f), c.norm_eps), torch.stack(routes, dim=2)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits [..., V] through the tied embedding."""
        return self.ops.matmul(hidden, serving_weight(self.tok_emb).t())

    def new_cache(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        shape = (batch, c.n_heads, c.max_context, c.d_model // c.n_heads)
        return [
            (torch.zeros(shape, dtype=COMPUTE_DTYPE), torch.zeros(shape, dtype=COMPUTE_DTYPE))
            for _ in range(c.n_layers)
        ]

    # --- the Policy interface -------------------------------------------------------------------
    def check_lengths(self, n_prompt: int, n_completion: int) -> None:
        """Raise ValueError unless bos + prompt + completion fit `max_context`."""
        if 1 + n_prompt + n_completion > self.config.max_context:
            raise ValueError(
                f"bos + prompt ({n_prompt}) + completion ({n_completion}) tokens exceed max_context "
                f"{self.config.max_context}; truncate the prompt from the left"
            )

    @property
    def route_shape(self) -> tuple[int, int]:
        """(n_layers, top_k) of the routes `generate` logs."""
        return self.config.n_layers, self.config.top_k

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        on_step: OnStep | None = None,
        top_logprobs: int = 0,
        constraint: Any = None,
    ) -> list[Sample]:
        return sampling.generate(
            self,
            prompts,
            max_tokens,
            temperature,
            seed,
            on_step,
            top_logprobs=top_logprobs,
            constraint=constraint,
        )

    def prefill(self, prompts: list[list[int]]) -> Prefill:
        """`[bos] + prompt` rows, right-padded, through a fresh cache (`new_cache`): each row's
        prompt at positions 0.., its completion after it; see policy/sampling.py."""
        tok = self.tokenizer
        b = len(prompts)
        lens = torch.tensor([1 + len(p) for p in prompts])
        width = int(lens.max())
        tokens = torch.full((b, width), tok.pad_id, dtype=torch.int64)
        for i, p in enumerate(prompts):
            tokens[i, : 1 + len(p)] = torch.tensor([tok.bos_id, *p], dtype=torch.int64)
        positions = torch.arange(width).expand(b, width)
        cache = self.new_cache(b)
        hidden, routes = self.forward_hidden(tokens, positions, cache)
        rows = torch.arange(b)

        def decode(nxt: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            hidden, routes = self.forward_hidden(nxt[:, None], (lens + step)[:, None], cache)
            return self.lm_logits(hidden[:, 0]), routes[:, 0]

        last = lens - 1
        return Prefill(self.lm_logits(hidden[rows, last]), routes[rows, last], decode)

    def completion_logits(
        self,
        prompt_tokens: list[list[int]],
        completion_tokens: list[list[int]],
        routes: list[np.ndarray | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits that predict each completion token: (logits [B, T_max, V] fp32, targets [B, T_max]
        int64, valid [B, T_max] bool). Differentiable; routes replayed as in `logprobs`."""
        assert len(prompt_tokens) == len(completion_tokens), (
            f"{len(prompt_tokens)} prompts vs {len(completion_tokens)} completions"
        )
        c, tok = self.config, self.tokenizer
        b = len(prompt_tokens)
        if routes is not None:
            assert len(routes) == b, f"{len(routes)} routes for {b} sequences"
        for p, comp in zip(prompt_tokens, completion_tokens):
            self.check_lengths(len(p), len(comp))
        seqs = [[tok.bos_id, *p, *comp] for p, comp in zip(prompt_tokens, completion_tokens)]
        width = max(len(s) for s in seqs)
        t_max = max(1, max(len(comp) for comp in completion_tokens))
        tokens = torch.full((b, width), tok.pad_id, dtype=torch.int64)
        pred_pos = torch.zeros((b, t_max), dtype=torch.int64)
        targets = torch.full((b, t_max), tok.pad_id, dtype=torch.int64)
        valid = torch.zeros((b, t_max), dtype=torch.bool)
        replay_ids = replay_mask = None
        if routes is not None and any(r is not None for r in routes):
            replay_ids = torch.zeros((b, width, c.n_layers, c.top_k), dtype=torch.int64)
            replay_mask = torch.zeros((b, width), dtype=torch.bool)
        for i, (p, comp) in enumerate(zip(prompt_tokens, completion_tokens)):
            tokens[i, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.int64)
            n = len(comp)
            pred_pos[i, :n] = torch.arange(len(p), len(p) + n)
            targets[i, :n] = torch.tensor(comp, dtype=torch.int64)
            valid[i, :n] = True
            r = None if routes is None else routes[i]
            if r is not None:
                r = np.asarray(r)
                assert r.shape == (n, c.n_layers, c.top_k), (
                    f"routes[{i}] has shape {r.shape}, expected {(n, c.n_layers, c.top_k)}"
                )
                replay_ids[i, len(p) : len(p) + n] = torch.from_numpy(r.astype(np.int64))
                replay_mask[i, len(p) : len(p) + n] = torch.from_numpy(replayed_rows(r))
        positions = torch.arange(width).expand(b, width)
        hidden, _ = self.forward_hidden(tokens, positions, None, replay_ids, replay_mask)
        h = hidden[torch.arange(b)[:, None], pred_pos]  # [B, T_max, D]
        return self.lm_logits(h), targets, valid

    def logprobs(
        self,
        prompt_tokens: list[list[int]],
        completion_tokens: list[list[int]],
        routes: list[np.ndarray | None] | None = None,
        temperature: float | torch.Tensor = 1.0,
    ) -> torch.Tensor:
        logits, targets, valid = self.completion_logits(prompt_tokens, completion_tokens, routes)
        logp = token_logprobs(logits, targets, temperature, self.ops)
        return torch.where(valid, logp, torch.zeros_like(logp))

    def completion_log_probs(
        self,
        prompt_tokens: list[list[int]],
        completion_tokens: list[list[int]],
        routes: list[np.ndarray | None] | None = None,
        temperature: float | torch.Tensor = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full log-distributions log_softmax(logits / T) [B, T_max, V] at each completion position,
        with targets [B, T_max] and valid [B, T_max] (for KL and self-distillation terms)."""
        logits, targets, valid = self.completion_logits(prompt_tokens, completion_tokens, routes)
        return log_probs(logits, temperature, self.ops), targets, valid

    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}

    def load_serving_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or extra:
            raise ValueError(
                f"serving state dict does not match the architecture: missing {missing}, unexpected {extra}"
            )
        with torch.no_grad():
            for k, v in own.items():
                if state[k].shape != v.shape:
                    raise ValueError(
                        f"{k}: shape {tuple(state[k].shape)}, expected {tuple(v.shape)}"
                    )
                v.copy_(state[k].to(v.dtype))
