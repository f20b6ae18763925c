"""The sampling loop behind every policy's `generate` (policy/base.py has the contract).

A policy supplies what depends on its model, as a `SamplingModel`: how a batch of prompts is laid
out and prefilled into a fresh KV cache (`prefill`), and how one decoding step feeds the sampled
tokens through that cache (`Prefill.decode`). `generate` owns everything else, so every policy
samples the same way:

- argument checks (max_tokens >= 1, `check_temperature`, the model's `check_lengths`);
- a `torch.Generator` seeded with `seed` (or, for None, one draw from torch's global generator,
  taken before the prefill);
- per step: optional `mask_logits` (or `constraint.mask_logits`), log_softmax(logits / T) with
  the model's kernels (T = 1 for greedy), `check_sampling_distribution`, one multinomial draw per
  row from exp(log-probs) (argmax for T == 0), the sampled token's log-prob under that
  distribution;
- per row, until it samples eos: the token, its behaviour log-prob and its routes (and, with
  `top_logprobs=k`, the k most likely tokens of that step's distribution); `constraint.accept`;
  `on_step`;
- the `Sample`s, with `meta` {temperature, kernels, finish_reason: eos | stopped | length}.

`mask_logits(step, logits) -> logits` is where a per-row constraint on the next token plugs in: it
sees the model's logits [B, V] and returns them with the disallowed tokens at -inf. The log-probs,
the draw and the logged behaviour log-probs all come from the masked distribution, the one
actually sampled from. A `constraint` (a grammar's per-row state, policy/constrain.py
`Constraint`) is that hook with memory: its `mask_logits` masks each step, and its
`accept(step, tokens)` sees the tokens each row appended (None for an ended row) right after the
step, before `on_step`, so the next mask follows them. One or the other, not both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kernels.invariant import Ops
from kernels.logprobs import log_probs
from policy.base import (
    MAX_TOP_LOGPROBS,
    OnStep,
    Sample,
    Tokenizer,
    check_sampling_distribution,
    check_temperature,
)

StepOutput = tuple[torch.Tensor, torch.Tensor | None]
"""(logits [B, V] fp32 that predict the next token, routes [B, n_layers, top_k] int64 of the
position that produced them, or None for a model without MoE layers)."""

DecodeStep = Callable[[torch.Tensor, int], StepOutput]
"""`decode(tokens, step) -> StepOutput`: append the tokens [B] int64 sampled at `step` (0-based)
to every row's cache and return what predicts the token of step + 1."""

MaskLogits = Callable[[int, torch.Tensor], torch.Tensor]
"""`mask_logits(step, logits) -> logits`: the [B, V] logits of `step` with the tokens a row may not
sample set to -inf (every other entry finite, at least one per row)."""


class StepConstraint(Protocol):
    """A constraint with per-row state (policy/constrain.py `Constraint`): `mask_logits` as above,
    then `accept(step, tokens)` with the token each row appended at `step` (None: it had ended)."""

    def mask_logits(self, step: int, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, step: int, tokens: list[int | None]) -> None: ...


@dataclass(frozen=True)
class Prefill:
    """A batch after its prompts ran through a fresh KV cache: what predicts the first token, and
    the decoding step bound to that cache."""

    logits: torch.Tensor  # [B, V] fp32 at each row's last prompt position
    routes: torch.Tensor | None  # [B, n_layers, top_k] int64 there; None without MoE layers
    decode: DecodeStep


class SamplingModel(Protocol):
    """What `generate` needs from a policy."""

    @property
    def tokenizer(self) -> Tokenizer:
        """Its eos id ends a row; `decode` gives each Sample's text."""

    @property
    def ops(self) -> Ops:
        """The kernels of the log-probs (their `name` goes into each Sample's meta)."""

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(n_layers, top_k) of the routes, None for a model without MoE layers."""

    def check_lengths(self, n_prompt: int, n_completion: int) -> None:
        """Raise ValueError if a prompt and completion of these lengths do not fit the context."""

    def prefill(self, prompts: list[list[int]]) -> Prefill:
        """Run the prompts (token ids, non-empty batch) through a fresh KV cache."""


@torch.no_grad()
def generate(
    model: SamplingModel,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
    on_step: OnStep | None = None,
    mask_logits: MaskLogits | None = None,
    top_logprobs: int = 0,
    constraint: StepConstraint | None = None,
) -> list[Sample]:
    """Sample one completion per prompt (`Policy.generate`, see the module docstring); with
    `mask_logits` or a `constraint`, every step samples from the masked logits; with
    `top_logprobs` = k > 0, each Sample lists per token the k most likely (id, log-prob) of the
    distribution it was drawn from (masked tokens, at -inf, come last)."""
    assert max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}"
    if constraint is not None:
        if mask_logits is not None:
            raise ValueError("generate takes mask_logits or a constraint, not both")
        mask_logits = constraint.mask_logits
    assert 0 <= top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs {top_logprobs} not in 0..20"
    check_temperature(temperature)
    for p in prompts:
        model.check_lengths(len(p), max_tokens)
    if not prompts:
        return []
    b = len(prompts)
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ())))
    pre = model.prefill(prompts)
    logits, routes = pre.logits, pre.routes
    out_tok: list[list[int]] = [[] for _ in range(b)]
    out_lp: list[list[float]] = [[] for _ in range(b)]
    out_rt: list[list[np.ndarray]] = [[] for _ in range(b)]
    out_top: list[list[list[tuple[int, float]]]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    stopped = False  # on_step asked to end
    for step in range(max_tokens):
        masked = None if mask_logits is None else mask_logits(step, logits)
        nxt, lp, logp = _draw(logits, masked, temperature, gen, model.ops)
        top = _top(logp, top_logprobs) if top_logprobs else None
        appended: list[int | None] = [None] * b
        for i in range(b):
            if not done[i]:
                appended[i] = int(nxt[i])
                out_tok[i].append(int(nxt[i]))
                out_lp[i].append(float(lp[i]))
                if routes is not None:
                    out_rt[i].append(routes[i].to(torch.int32).numpy())
                if top is not None:
                    out_top[i].append(top[i])
        done |= nxt == model.tokenizer.eos_id
        if constraint is not None:
            constraint.accept(step, appended)
        if on_step is not None and not on_step(step, appended):
            stopped = True
            break
        if bool(done.all()) or step == max_tokens - 1:
            break
        logits, routes = pre.decode(nxt, step)
    samples = [
        _sample(model, out_tok[i], out_lp[i], out_rt[i], temperature, stopped, max_tokens)
        for i in range(b)
    ]
    if top_logprobs:
        for sample, top in zip(samples, out_top):
            sample.top_logprobs = top
    return samples


def _draw(
    logits: torch.Tensor,
    masked: torch.Tensor | None,
    temperature: float,
    gen: torch.Generator,
    ops: Ops,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's logits [B, V] (and `mask_logits`' version of them, when there is a mask) ->
    (next tokens [B] int64, their log-probs [B] fp32, the log-probs [B, V] they were drawn from)
    under log_softmax(masked or logits / T): one multinomial draw from `gen` per row, argmax for
    T == 0."""
    logp = log_probs(logits if masked is None else masked, temperature, ops)  # [B, V]
    check_sampling_distribution(logits, logp, temperature, masked)  # before NaN can be sampled
    if temperature > 0:
        nxt = torch.multinomial(torch.exp(logp), 1, generator=gen)[:, 0]
    else:
        nxt = logp.argmax(dim=-1)
    return nxt, logp.gather(1, nxt[:, None])[:, 0], logp


def most_likely(pairs: Iterable[tuple[int, float]], k: int) -> list[tuple[int, float]]:
    """The k most likely of (token id, log-prob) pairs, most likely first, ties broken by the
    lower id: the order `Sample.top_logprobs` has on every engine."""
    return sorted(((int(i), float(v)) for i, v in pairs), key=lambda p: (-p[1], p[0]))[:k]


def _top(logp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Per row of log-probs [B, V], its `most_likely` k (torch.topk leaves ties in no set order:
    a margin of candidates past k lets the tie-break see them)."""
    vals, ids = torch.topk(logp, min(k + 8, logp.shape[-1]), dim=-1)
    return [most_likely(zip(i, v), k) for i, v in zip(ids.tolist(), vals.tolist())]


def _sample(
    model: SamplingModel,
    tokens: list[int],
    lps: list[float],
    routes: list[np.ndarray],
    temperature: float,
    stopped: bool,
    max_tokens: int,
) -> Sample:
    """One row's Sample: routes stacked to int32 [T, n_layers, top_k] (None without MoE layers);
    finish_reason eos (ended with eos), stopped (`on_step` ended it short), else length."""
    shape = model.route_shape
    rt = None
    if shape is not None:
        rt = np.stack(routes).astype(np.int32) if routes else np.zeros((0, *shape), np.int32)
    if tokens and tokens[-1] == model.tokenizer.eos_id:
        reason = "eos"
    elif stopped and len(tokens) < max_tokens:
        reason = "stopped"
    else:
        reason = "length"
    return Sample(
        tokens=tokens,
        logprobs=lps,
        routes=rt,
        text=model.tokenizer.decode(tokens),
        meta={"temperature": temperature, "kernels": model.ops.name, "finish_reason": reason},
    )
