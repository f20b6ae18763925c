"""A Hugging Face `transformers` causal LM behind the Policy interface (dense or mixture-of-experts).

    policy = build_policy({"type": "hf", "model_dir": "/models/my-qwen-moe"})

The directory is what `save_pretrained` writes (config.json, *.safetensors) plus the tokenizer
files; a registered version names it by `files_sha256` instead (policy/hf_files.py: the
non-weight files, materialized from the registry) and its weights come from the version's serving
weights (`load_serving_state_dict`; the model is built with `from_config` when the directory holds
no weights). The model is loaded with `AutoModelForCausalLM` as fp32 master weights, eager attention and
eager (per-expert loop) MoE experts.

Numerics: the same contract as the built-in policy (policy/base.py, docs/NUMERICS.md).
Every forward uses the bf16-rounded values of the fp32 masters (`serving_weight`, straight-through
gradient), so a trainer holding fp32 masters and a replica holding the bf16 serving weights run the
same forward; the model's forwards in `generate()` and `logprobs()` run inside
`kernels.hf_mode.batch_invariant_mode()` (kernels="invariant"), and log-probs are
kernels/logprobs.py at the sampling temperature.

Sequences are `[start] + prompt + completion`, `start` being the tokenizer's bos (its eos when it has
none), so a prompt may be empty; `max_context` counts the start token.

MoE routes: every MoE layer's router (a module with `weight`, `top_k` and `num_experts` returning
`(router_logits, gate_weights, expert_ids)`: Qwen2-MoE, Qwen3-MoE, Mixtral in transformers 5.x)
gets a forward hook. Capturing, it records the expert ids; replaying, it substitutes logged ids
where a mask says so and recomputes their gate weights from the live router logits (softmax,
gather, renormalised when the router normalises its top-k), so the router keeps its gradient. The
experts themselves (fused `experts.gate_up_proj` / `experts.down_proj` parameters) are untouched:
they receive the ids and weights from the router. Routes of completion token j are the ids at the
input position that predicted it (`len(prompt) + j`, start token = 0), as in moe_lm.py:
int32 [T, n_moe_layers, top_k].

LoRA: a config with `lora` builds policy/lora.py's `LoraPolicy` (a peft adapter on this
policy's model, the base weights among the model files); everything above holds for it.

Serving weights: bf16, under the names and layout `save_pretrained` writes (tied weights dropped,
fused experts reverted to per-expert tensors by transformers' own conversion), so a serving state
dict saved with safetensors next to the config and tokenizer loads with
`AutoModelForCausalLM.from_pretrained`. `load_serving_state_dict` inverts that layout with an
element map computed once by passing element indices through the same conversion.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

import policy.sampling as sampling
from kernels.hf_mode import batch_invariant_mode
from kernels.invariant import get_ops
from kernels.logprobs import log_probs, token_logprobs
from policy.base import OnStep, Policy, Sample, Tokenizer, replayed_rows
from policy.hf_files import TOKENIZER_FILES
from policy.lora_spec import LoraSpec
from policy.moe_lm import serving_weight
from policy.sampling import Prefill

TOKENIZER_ID_MAX = 64  # app/contracts/events.py GenerationEvent.tokenizer
HASH_HEX = 16


def tokenizer_files(model_dir: str | Path) -> list[Path]:
    """The tokenizer files of a model directory, in sorted name order."""
    d = Path(model_dir)
    return sorted((d / n for n in TOKENIZER_FILES if (d / n).is_file()), key=lambda p: p.name)


def tokenizer_id(model_dir: str | Path, name: str) -> str:
    """`<name>@<first 16 hex of SHA-256 over the tokenizer files>` (at most 64 characters).

    The hash covers each file's name, length and bytes, in sorted name order, so renaming,
    editing, adding or removing a tokenizer file changes the id."""
    files = tokenizer_files(model_dir)
    if not files:
        raise FileNotFoundError(
            f"{model_dir} holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})"
        )
    h = hashlib.sha256()
    for f in files:
        data = f.read_bytes()
        h.update(f.name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "hf"
    clean = clean[: TOKENIZER_ID_MAX - HASH_HEX - 1]
    return f"{clean}@{h.hexdigest()[:HASH_HEX]}"


class HFTokenizer(Tokenizer):
    """A model directory's tokenizer; `name` is its id (`tokenizer_id`), recorded in events."""

    def __init__(self, model_dir: str | Path, vocab_size: int, name: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        cfg_file = Path(model_dir) / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        given = str(cfg.get("name_or_path") or "")
        base = name or (
            given if given and not Path(given).is_absolute() else Path(model_dir).resolve().name
        )
        self.name = tokenizer_id(model_dir, base.rstrip("/").split("/")[-1])
        self.vocab_size = int(vocab_size)
        if self.hf.eos_token_id is None:
            raise ValueError(f"the tokenizer of {model_dir} has no eos token")
        self.eos_id = int(self.hf.eos_token_id)
        self.bos_id = None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)
        self.pad_id = int(self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id)
        self.start_id = self.bos_id if self.bos_id is not None else self.eos_id
        self._n_tokens = len(self.hf)  # ids past it are embedding rows with no token

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        return self.hf.decode(
            [t for t in tokens if 0 <= t < self._n_tokens], skip_special_tokens=True
        )

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The model's own chat template, with the tools. An assistant's call `arguments` go to the
        template as the object they encode (Hugging Face templates, like vLLM's front, expect a
        mapping: Qwen2.5's writes `arguments | tojson`)."""
        if not self.has_chat_template:
            return super().apply_chat_template(messages, tools)
        msgs = [_template_message(m) for m in messages]
        return self.hf.apply_chat_template(
            msgs, tools=tools or None, tokenize=False, add_generation_prompt=True
        )


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": calls}


class HFConfig(BaseModel):
    """How to build an HF policy (JSON in every checkpoint and registry version)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["hf"] = Field("hf", description="Policy type for build_policy.")
    model_dir: str | None = Field(
        None,
        description="Directory with config.json, the tokenizer and (optionally) safetensors; None = "
        "the cache directory of files_sha256 (policy/hf_files.py).",
    )
    files_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 of the non-weight model files (policy/hf_files.py); the "
        "directory's files must hash to it. Set in every registered version.",
    )
    name: str | None = Field(
        None,
        description="The tokenizer id's name part; None = the tokenizer's relative name_or_path, "
        "else the directory's name. Registered versions record it (their directory is a hash).",
    )
    max_context: int | None = Field(
        None,
        ge=2,
        description="Max tokens incl. the start token; None = the model's max_position_embeddings.",
    )
    kernels: Literal["invariant", "default"] = Field(
        "invariant",
        description="invariant: forwards inside kernels.hf_mode.batch_invariant_mode and invariant "
        "log-probs (bit-exact contract); default: plain torch ops.",
    )
    lora: LoraSpec | None = Field(
        None,
        description="A LoRA adapter on the frozen base (policy/lora.py); the model files "
        "then carry the base weights (model.safetensors, covered by files_sha256).",
    )


def _is_router(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (
        isinstance(w, torch.nn.Parameter)
        and w.ndim == 2
        and isinstance(getattr(m, "top_k", None), int)
        and isinstance(getattr(m, "num_experts", None), int)
        and w.shape[0] == m.num_experts
    )


class _RouteState:
    """Per-router state of one forward: replay ids/mask in, captured ids out. Kept per thread
    (`router._flywheel_routes[thread id]`), so concurrent forwards never see each other's."""

    def __init__(self, replay_ids: torch.Tensor | None, replay_mask: torch.Tensor | None):
        self.replay_ids, self.replay_mask = replay_ids, replay_mask
        self.captured: torch.Tensor | None = None


def router_gate_weights(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    """The gate weights the router gives experts `ids` [N, k]: softmax of the logits gathered at the
    ids, renormalised over the k when the router normalises (Mixtral always does)."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _router_hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
    state = module._flywheel_routes.get(threading.get_ident())
    if state is None:
        return None
    logits, gates, ids = output
    if state.replay_ids is not None:
        ids = torch.where(state.replay_mask[:, None], state.replay_ids, ids)
        gates = router_gate_weights(module, logits, ids)
        output = (logits, gates, ids)
    state.captured = ids
    return output


class HFPolicy(Policy):
    """`AutoModelForCausalLM` from a local directory implementing the Policy interface."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        from policy.hf_files import resolve

        path = resolve(config.model_dir, config.files_sha256, weights=config.lora is not None)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}/config.json not found: not a model directory")
        hf_config = AutoConfig.from_pretrained(str(path))
        limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        if config.max_context is None:
            config = config.model_copy(update={"max_context": limit or 2048})
        elif limit and config.max_context > limit:
            raise ValueError(
                f"max_context {config.max_context} > the model's max_position_embeddings {limit}"
            )
        self.config = config
        kwargs = {
            "dtype": torch.float32,
            "attn_implementation": "eager",
            **({"experts_implementation": "eager"} if _has_experts(hf_config) else {}),
        }
        if any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
            self.model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        else:  # a registry version's files (hf_files.py): the weights come with load_serving_state_dict
            self.model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
        self.model.eval()
        rows = int(self.model.get_input_embeddings().weight.shape[0])
        self.tokenizer = HFTokenizer(path, vocab_size=rows, name=config.name)
        self.routers = [m for m in self.model.modules() if _is_router(m)]
        for r in self.routers:
            r._flywheel_routes = {}  # thread id -> _RouteState of that thread's forward
            r.register_forward_hook(_router_hook)
        self.ops = get_ops(config.kernels)
        self.aux_loss = torch.zeros(())
        self._serving_map: dict[str, _Placement] | None = None

    # --- config ---------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        """The config; `files_sha256` and `name` only when set (a plain directory's config is as
        it always was, so its canonical hash does not change)."""
        d = self.config.model_dump()
        return {
            k: v for k, v in d.items() if v is not None or k not in ("files_sha256", "name", "lora")
        }

    def set_kernels(self, name: Literal["invariant", "default"]) -> None:
        """Switch between the batch-invariant mode and plain torch ops (e.g. the gate's statistics)."""
        self.ops = get_ops(name)
        self.config = self.config.model_copy(update={"kernels": name})

    @property
    def moe_spec(self) -> tuple[int, int, int] | None:
        """(MoE layers, top_k, experts per layer) of the routes, None for a dense model."""
        if not self.routers:
            return None
        return len(self.routers), self.routers[0].top_k, self.routers[0].num_experts

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(MoE layers, top_k) of the routes `generate` logs, None for a dense model."""
        spec = self.moe_spec
        return None if spec is None else (spec[0], spec[1])

    # --- the forward ----------------------------------------------------------------------------
    def _mode(self):
        return batch_invariant_mode() if self.config.kernels == "invariant" else nullcontext()

    @contextmanager
    def _routing(
        self, replay_ids: torch.Tensor | None, replay_mask: torch.Tensor | None
    ) -> Iterator[list[_RouteState]]:
        """Arm every router for one forward; replay_ids [N, L, k] / replay_mask [N] over the forward's
        flattened (batch, position) rows."""
        states = [
            _RouteState(None if replay_ids is None else replay_ids[:, li], replay_mask)
            for li in range(len(self.routers))
        ]
        me = threading.get_ident()
        for r, s in zip(self.routers, states):
            r._flywheel_routes[me] = s
        try:
            yield states
        finally:
            for r in self.routers:
                r._flywheel_routes.pop(me, None)

    def forward_logits(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any = None,
        replay_ids: torch.Tensor | None = None,
        replay_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens/positions [B, S] int64, attention_mask [B, S_cache + S] -> (logits [B, S, V] fp32,
        routes [B, S, L, k] int64 or None for a dense model), on the bf16-rounded weights.
        replay_ids [B, S, L, k] replace the routers' choice where replay_mask [B, S] is True."""
        b, s = tokens.shape
        flat_ids = None if replay_ids is None else replay_ids.reshape(b * s, *replay_ids.shape[2:])
        flat_mask = None if replay_mask is None else replay_mask.reshape(b * s)
        params = self._forward_params()
        with self._routing(flat_ids, flat_mask) as states, self._mode():
            out = torch.func.functional_call(
                self.model,
                params,
                args=(),
                kwargs={
                    "input_ids": tokens,
                    "attention_mask": attention_mask,
                    "position_ids": positions,
                    "past_key_values": cache,
                    "use_cache": cache is not None,
                },
            )
        routes = None
        if states:
            assert all(st.captured is not None for st in states), "a MoE router did not run"
            routes = torch.stack([st.captured.view(b, s, -1) for st in states], dim=2)
        return out.logits.float(), routes

    def _forward_params(self) -> dict[str, torch.Tensor]:
        """The parameters every forward substitutes: all of them, bf16-rounded (`serving_weight`)."""
        return {n: serving_weight(p) for n, p in self.model.named_parameters()}

    # --- the Policy interface -------------------------------------------------------------------
    def check_lengths(self, n_prompt: int, n_completion: int) -> None:
        """Raise ValueError unless the start token + prompt + completion fit `max_context`."""
        if 1 + n_prompt + n_completion > self.config.max_context:
            raise ValueError(
                f"start token + prompt ({n_prompt}) + completion ({n_completion}) tokens exceed "
                f"max_context {self.config.max_context}; truncate the prompt from the left"
            )

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
        """`[start] + prompt` rows, left-padded, through a fresh `DynamicCache`; positions count
        from each row's start token. See policy/sampling.py."""
        from transformers import DynamicCache

        tok = self.tokenizer
        b = len(prompts)
        lens = torch.tensor([1 + len(p) for p in prompts])
        width = int(lens.max())
        tokens = torch.full((b, width), tok.pad_id, dtype=torch.int64)
        mask = torch.zeros((b, width), dtype=torch.int64)
        # Left padding: each row's keys in the cache are then pads, its prompt, its completion:
        # one contiguous block after exact zeros, which the invariant reductions sum as the
        # full forward does (right padding would put the pads between prompt and completion).
        for i, p in enumerate(prompts):
            tokens[i, width - 1 - len(p) :] = torch.tensor([tok.start_id, *p], dtype=torch.int64)
            mask[i, width - 1 - len(p) :] = 1
        positions = (torch.cumsum(mask, dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits, routes = self.forward_logits(tokens, mask, positions, cache)

        def decode(nxt: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            nonlocal mask
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.int64)], dim=1)
            logits, routes = self.forward_logits(nxt[:, None], mask, (lens + step)[:, None], cache)
            return logits[:, 0], None if routes is None else routes[:, 0]

        return Prefill(logits[:, -1], None if routes is None else routes[:, -1], decode)

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
        tok, spec = self.tokenizer, self.moe_spec
        b = len(prompt_tokens)
        if routes is not None:
            assert len(routes) == b, f"{len(routes)} routes for {b} sequences"
        for p, comp in zip(prompt_tokens, completion_tokens):
            self.check_lengths(len(p), len(comp))
        seqs = [[tok.start_id, *p, *comp] for p, comp in zip(prompt_tokens, completion_tokens)]
        width = max(len(s) for s in seqs)
        t_max = max(1, max(len(comp) for comp in completion_tokens))
        tokens = torch.full((b, width), tok.pad_id, dtype=torch.int64)
        mask = torch.zeros((b, width), dtype=torch.int64)
        pred_pos = torch.zeros((b, t_max), dtype=torch.int64)
        targets = torch.full((b, t_max), tok.pad_id, dtype=torch.int64)
        valid = torch.zeros((b, t_max), dtype=torch.bool)
        replay_ids = replay_mask = None
        if spec is not None and routes is not None and any(r is not None for r in routes):
            replay_ids = torch.zeros((b, width, spec[0], spec[1]), dtype=torch.int64)
            replay_mask = torch.zeros((b, width), dtype=torch.bool)
        for i, (p, comp) in enumerate(zip(prompt_tokens, completion_tokens)):
            tokens[i, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.int64)
            mask[i, : len(seqs[i])] = 1
            n = len(comp)
            pred_pos[i, :n] = torch.arange(len(p), len(p) + n)
            targets[i, :n] = torch.tensor(comp, dtype=torch.int64)
            valid[i, :n] = True
            r = None if routes is None else routes[i]
            if r is not None:
                assert spec is not None, "routes given for a model without MoE layers"
                r = np.asarray(r)
                assert r.shape == (n, spec[0], spec[1]), (
                    f"routes[{i}] has shape {r.shape}, expected {(n, spec[0], spec[1])}"
                )
                replay_ids[i, len(p) : len(p) + n] = torch.from_numpy(r.astype(np.int64))
                replay_mask[i, len(p) : len(p) + n] = torch.from_numpy(replayed_rows(r))
        positions = torch.arange(width).expand(b, width)
        logits, _ = self.forward_logits(tokens, mask, positions, None, replay_ids, replay_mask)
        return logits[torch.arange(b)[:, None], pred_pos], targets, valid

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

    # --- serving weights ------------------------------------------------------------------------
    def _to_saved_layout(
        self, state: dict[str, torch.Tensor], model: torch.nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        """What `save_pretrained` would write for `state` (a state dict of `model`, default
        self.model, tied tensors sharing storage): tied copies dropped, transformers' weight
        conversions reverted."""
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        model = self.model if model is None else model
        state = remove_tied_weights_from_state_dict(dict(state), model)
        return revert_weight_conversion(model, state)

    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        return self._bf16_saved_state(self.model)

    def _bf16_saved_state(
        self, model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """`model`'s weights (or `state`, a full state dict of it, tied keys sharing one tensor:
        trainer/fsdp.py's gathered state) in bf16 under the names `save_pretrained` writes."""
        own = model.state_dict() if state is None else state
        bf16: dict[int, torch.Tensor] = {}  # one bf16 copy per storage, so ties stay ties
        state = {}
        for k, v in own.items():
            key = v.untyped_storage().data_ptr()
            if key not in bf16:
                bf16[key] = v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()
            state[k] = bf16[key]
        return {k: v.contiguous() for k, v in self._to_saved_layout(state, model).items()}

    def _saved_layout_map(self) -> dict[str, _Placement]:
        """saved name -> where its elements live in the model's state dict, from element indices
        passed through `_to_saved_layout`; every element of every model tensor is covered once."""
        if self._serving_map is not None:
            return self._serving_map
        own = self.model.state_dict()
        index: dict[str, torch.Tensor] = {}
        by_storage: dict[int, torch.Tensor] = {}
        starts, names, offset = [], [], 0
        for k, v in own.items():
            key = v.untyped_storage().data_ptr()
            if key not in by_storage:
                by_storage[key] = torch.arange(offset, offset + v.numel()).view(v.shape)
                starts.append(offset)
                names.append(k)
                offset += v.numel()
            index[k] = by_storage[key]
        seen = torch.zeros(offset, dtype=torch.int32)
        mapping: dict[str, _Placement] = {}
        for saved, idx in self._to_saved_layout(index).items():
            flat = idx.reshape(-1)
            seen.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
            src = bisect.bisect_right(starts, int(flat[0])) - 1 if flat.numel() else 0
            rel = flat - starts[src]
            n_src = own[names[src]].numel()
            assert bool((rel >= 0).all()) and bool((rel < n_src).all()), (
                f"saved tensor {saved} mixes elements of several model tensors"
            )
            first = int(rel[0]) if rel.numel() else 0
            run = torch.equal(rel, torch.arange(first, first + rel.numel()))
            mapping[saved] = _Placement(names[src], tuple(idx.shape), first, None if run else rel)
        assert bool((seen == 1).all()), "the saved layout does not cover every weight exactly once"
        self._serving_map = mapping
        return mapping

    def load_serving_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mapping = self._saved_layout_map()
        missing, extra = sorted(set(mapping) - set(state)), sorted(set(state) - set(mapping))
        if missing or extra:
            raise ValueError(
                f"serving state dict does not match the architecture: missing {missing}, "
                f"unexpected {extra}"
            )
        own = self.model.state_dict()
        with torch.no_grad():
            for saved, at in mapping.items():
                value = state[saved]
                if tuple(value.shape) != at.shape:
                    raise ValueError(f"{saved}: shape {tuple(value.shape)}, expected {at.shape}")
                flat, src = own[at.name].view(-1), value.reshape(-1)
                if at.index is None:  # one run: converted as it is copied, no temporary
                    flat[at.start : at.start + src.numel()].copy_(src)
                else:
                    flat[at.index] = src.to(flat.dtype)


@dataclass(frozen=True)
class _Placement:
    """Where a saved tensor's elements live: model tensor `name`, flat elements
    `start .. start + numel` in order, or at `index` [numel] when they are not one run."""

    name: str
    shape: tuple[int, ...]  # the saved tensor's shape
    start: int
    index: torch.Tensor | None


def _has_experts(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0))
