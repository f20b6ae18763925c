"""The policy interface: what the trainer, the gate and the replicas need from a model.

The built-in policy is a byte-level decoder with MoE feed-forward layers (`moe_lm.py`),
small enough to train on two CPU cores; a larger causal LM plugs in by implementing this
class. Numerics contract (docs/DESIGN.md §Invariants): with routes replayed and batch-invariant kernels on,
`logprobs()` of a logged generation equals the behaviour log-probs that `generate()` logged,
bit for bit, when both run on the same serving weights.

Conventions
- Tokens are python ints; a tokenizer turns text into them (`tokenizer.name`, e.g. `byte-v1`).
- Log-probs are float32 log-probabilities of the sampled token under the sampling
  distribution softmax(logits / T); for T == 0 (greedy) they are taken at T = 1.
- Routes are int32 arrays of shape [T_completion, n_layers, top_k]: the expert ids each
  completion token was routed to in each MoE layer (None for dense policies). Given to
  `logprobs()`, a row whose every id is `UNROUTED` (-1) is not replayed: that token's position is
  routed by the current router (a trajectory's tokens the model did not sample, which were
  prefilled, not routed at sampling; trainer/batch.py). `replayed_rows` says which rows are.
- The serving state dict is bf16 for floating tensors; `load_serving_state_dict` loads one.
- `generate(..., on_step=fn)` calls `fn(step, tokens)` on the calling thread after every sampling
  step, `tokens[i]` being the token row i just appended (None for a row that had already ended);
  `fn` returning False ends the generation after that step (each Sample holds what was generated
  so far, `meta["finish_reason"] == "stopped"` for the rows that had not ended). The callback
  never changes what is sampled: a generation stopped after k steps is the first k steps of the
  same generation run to the end (same seed), tokens and log-probs bit for bit. Streaming,
  stop sequences and cancellation are built on it (app/replica/openai/generation.py).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

OnStep = Callable[[int, list[int | None]], bool]
"""`on_step(step, tokens) -> keep_going`: see the module docstring."""


UNROUTED = -1
"""The expert id of a routes row that is not replayed (module docstring, Conventions)."""


def replayed_rows(routes: np.ndarray) -> np.ndarray:
    """bool [T]: the rows of routes [T, n_layers, top_k] that are replayed, those not all
    `UNROUTED` (a row partly UNROUTED is replayed, and refused as an id outside the experts)."""
    return ~(np.asarray(routes) == UNROUTED).all(axis=(1, 2))


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template (the model serves plain completions only)."""


class Tokenizer(ABC):
    name: str  # recorded in generation events (`tokenizer`)
    vocab_size: int
    eos_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, tokens: list[int]) -> str: ...

    @property
    def has_chat_template(self) -> bool:
        return False

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text for chat `messages`, ending where the assistant's reply begins. Same name
        and role as Hugging Face tokenizers' `apply_chat_template(..., tokenize=False,
        add_generation_prompt=True)`.

        `messages` are OpenAI's, already validated: `{"role", "content"}` with `content` a string
        (None for an assistant message that only calls tools), an assistant's `tool_calls`
        (`[{"id", "type": "function", "function": {"name", "arguments"}}]`, `arguments` the JSON
        text it was sent as) and a tool message's `tool_call_id`. `tools`: OpenAI function tools,
        rendered in the template's own tool format (policy/tool_format.py reads the calls)."""
        raise NoChatTemplate(f"the tokenizer {self.name} has no chat template")


class SamplingError(ValueError):
    """`generate` refused its arguments: a temperature that is negative or not finite, or so small
    that logits / T is not finite (the sampling distribution would be NaN)."""


class NonFiniteLogits(FloatingPointError):
    """The model itself produced NaN or infinite logits (broken weights, not a bad request)."""


def check_sampling_distribution(
    logits: torch.Tensor,
    logp: torch.Tensor,
    temperature: float,
    masked: torch.Tensor | None = None,
) -> None:
    """Raise unless `logp` = log_softmax(logits / T) [B, V] is finite, so NaN or inf never reaches
    the sampler (torch.multinomial raises on them, argmax silently picks garbage).

    `masked`: the logits a constraint left (policy/sampling.py `mask_logits`), -inf where a
    token is disallowed, and `logp` = log_softmax(masked / T); the model's `logits` must still be
    finite, `masked` finite or -inf with a finite entry in every row, and `logp` finite where
    `masked` is."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(
            f"the model produced non-finite logits ({int((~torch.isfinite(logits)).sum())} of "
            f"{logits.numel()} values)"
        )
    allowed = None if masked is None else torch.isfinite(masked)
    if allowed is not None and not (
        bool((allowed | (masked == -torch.inf)).all()) and bool(allowed.any(dim=-1).all())
    ):
        raise ValueError(
            "masked logits must be finite or -inf, with at least one finite entry in every row"
        )
    finite = torch.isfinite(logp) if allowed is None else torch.isfinite(logp) | ~allowed
    if not bool(finite.all()):
        raise SamplingError(
            f"temperature {temperature!r} is too small for these logits: logits / T is not finite "
            f"in float32 (largest |logit| {float(logits.abs().max()):.4g}); use 0 for greedy"
        )


def check_temperature(temperature: float) -> None:
    try:
        ok = math.isfinite(float(temperature)) and float(temperature) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise SamplingError(f"temperature must be a finite number >= 0, got {temperature!r}")


@dataclass
class Sample:
    """One generated completion with everything the trainer needs to learn from it."""

    tokens: list[int]  # completion tokens (may end with eos)
    logprobs: list[float]  # behaviour log-probs, float32 values, len == len(tokens)
    routes: np.ndarray | None = None  # int32 [len(tokens), n_layers, top_k]
    text: str = ""  # decoded completion
    meta: dict[str, Any] = field(default_factory=dict)
    # with `generate(top_logprobs=k)`: per token, the k most likely (token id, log-prob) of the
    # distribution it was sampled from, most likely first (ties: lower id first)
    top_logprobs: list[list[tuple[int, float]]] | None = None


MAX_TOP_LOGPROBS = 20  # the most alternatives per token `generate` gives (OpenAI's chat limit)


class Policy(ABC, torch.nn.Module):
    """A causal LM policy. Subclasses are torch modules holding fp32 (master) parameters."""

    tokenizer: Tokenizer

    @abstractmethod
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
        """Sample one completion per prompt with a KV cache, logging behaviour log-probs and routes;
        `on_step` as in the module docstring; `top_logprobs` (0..MAX_TOP_LOGPROBS) alternatives
        per token in each Sample's `top_logprobs`. A policy with its own forward implements it
        with policy/sampling.py's loop (`prefill` and a decoding step are all it supplies).

        `constraint`: a grammar's per-row state for constrained decoding (policy/constrain.py
        `Constraint`, started with one row per prompt): every step samples from the model's
        distribution masked to the tokens the grammar allows. That masked distribution is the one
        sampled from, so the behaviour log-probs and `top_logprobs` are of it, not of the model's
        unmasked softmax (docs/NUMERICS.md, "Constrained decoding")."""

    @abstractmethod
    def logprobs(
        self,
        prompt_tokens: list[list[int]],
        completion_tokens: list[list[int]],
        routes: list[np.ndarray | None] | None = None,
        temperature: float | torch.Tensor = 1.0,
    ) -> torch.Tensor:
        """Differentiable log-probs of each completion token given its prompt, under
        softmax(logits / T): `temperature` is one T, or one per completion (a tensor [B]: each
        rollout scored at the temperature it was sampled at; 0 = greedy, scored at T = 1).

        Returns float32 [B, T_max] (right-padded with 0.0 past each completion's length).
        When `routes[i]` is given, MoE layers use those expert ids for completion i's tokens
        (the gate weights are still computed by the current router, so it keeps its gradient),
        except at its `UNROUTED` rows, which the router routes (`replayed_rows`).
        """

    @abstractmethod
    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        """bf16 weights for serving and delta sync (integer buffers keep their dtype)."""

    @abstractmethod
    def load_serving_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load serving weights (e.g. on a replica, or to evaluate a registered version)."""

    @abstractmethod
    def config_dict(self) -> dict[str, Any]:
        """JSON-serialisable config that `build_policy(config)` rebuilds the architecture from."""

    def train_state_dict(self) -> dict[str, torch.Tensor]:
        """What the trainer's local state (trainer/checkpoint.py) keeps of this policy: the fp32
        masters of what trains. Here every tensor; a policy with a frozen part that `build_policy`
        rebuilds from its config (LoRA: the base, verified by `files_sha256`) keeps only the rest."""
        return self.state_dict()

    def load_train_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load what `train_state_dict` returned into a policy `build_policy` made from the same config."""
        self.load_state_dict(state)

    def effective_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights this policy computes with, as a full model's serving state, where that is
        not `serving_state_dict()` itself (LoRA: the adapter merged into the base). None here: the
        serving state is every weight. The gate's weight check compares these across versions of
        different layouts (a full parent, a LoRA child)."""
        return None

    def shadow(self) -> Policy:
        """A policy of the same structure whose state-dict tensors are new and UNINITIALISED, for
        `load_serving_state_dict` to fill (a replica's next version, app/replica/weights.py): copying
        the old weights first would be wasted work, the largest part of building a shadow policy.
        Tied parameters stay tied (deepcopy's memo); non-persistent buffers are copied as they are.
        A policy whose serving state covers only part of its tensors (LoRA: the adapter) overrides
        this to share the rest."""
        import copy

        memo: dict[int, Any] = {}
        for t in self.state_dict(keep_vars=True).values():  # parameters and persistent buffers
            if id(t) not in memo:  # a tied tensor appears under each of its names
                fresh = torch.empty_like(t)
                memo[id(t)] = (
                    torch.nn.Parameter(fresh, requires_grad=t.requires_grad)
                    if isinstance(t, torch.nn.Parameter)
                    else fresh
                )
        return copy.deepcopy(self, memo)
