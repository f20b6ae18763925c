"""Log-probabilities of chosen tokens under softmax(logits / T), invariant or reference.

`token_logprobs(logits [..., V], targets [...], temperature, ops)` -> [...] fp32. `temperature`
is one float, or one per row of the batch (a tensor [B] for logits [B, ..., V]: a batch of
rollouts sampled at different temperatures). Temperature 0 (greedy) is scored at T = 1
(the convention of docs/NUMERICS.md). With the invariant kernel set the value of
each position depends only on its own logits row: the division by T is one correctly-rounded op,
and the log-softmax reduces the vocabulary with the fixed halving tree (kernels/invariant.py).
`reference_token_logprobs` is the plain torch version for parity tests.
"""

from __future__ import annotations

import torch

from kernels.invariant import Ops

Temperature = float | torch.Tensor  # one value, or one per batch row ([B])


def _scale(logits: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(logits.dtype)
        assert t.ndim == 1 and t.shape[0] == logits.shape[0], (
            f"per-row temperatures {tuple(t.shape)} vs logits {tuple(logits.shape)}"
        )
        assert bool((t >= 0).all()), f"temperatures must be >= 0, got {t.tolist()}"
        t = torch.where(t > 0, t, torch.ones_like(t))
        return logits / t.reshape(-1, *([1] * (logits.ndim - 1)))
    assert temperature >= 0, f"temperature must be >= 0, got {temperature}"
    return logits / (temperature if temperature > 0 else 1.0)


def log_probs(logits: torch.Tensor, temperature: Temperature, ops: Ops) -> torch.Tensor:
    """Full log-distribution log_softmax(logits / T) [..., V] (for KL and distillation terms)."""
    return ops.log_softmax(_scale(logits, temperature))


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: Temperature, ops: Ops
) -> torch.Tensor:
    """logits [..., V] fp32, targets [...] int64 -> log-prob of each target [...] fp32."""
    assert logits.shape[:-1] == targets.shape, (
        f"logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}"
    )
    return log_probs(logits, temperature, ops).gather(-1, targets[..., None])[..., 0]


def reference_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: Temperature
) -> torch.Tensor:
    """Plain torch: log_softmax(logits / T) gathered at targets."""
    return torch.log_softmax(_scale(logits, temperature), dim=-1).gather(-1, targets[..., None])[
        ..., 0
    ]
