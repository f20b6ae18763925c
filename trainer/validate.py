"""Rollouts checked against the model being trained, before they can reach a step.

The rollout schema (trainer/rollout_record.py `Rollout`, after app/contracts/rollouts.py's contract) says
what a record looks like; this module says whether *this* model can train on it. A record
that fails gets a `Refusal`: a reason from `REFUSAL_REASONS` (the label of
`flywheel_trainer_rollouts_refused_total` and the `reason` of its dead-letter record) and a
message that names the field and the model's limit.

| reason | refused when |
|---|---|
| `invalid_json` | the value is not JSON (bytes, a tombstone, deep nesting the parser refuses) |
| `invalid_rollout` | the JSON is not a rollout record (schema, lengths, routes bytes vs route_shape; a multi-turn record's `turns` and `loss_mask`: trainer/rollout_record.py) |
| `tokenizer_mismatch` | the record names a tokenizer other than the model's (`Tokenizer.name`: `byte-v1`, or an HF tokenizer's `<name>@<hash of its files>`, so the same name with other files is refused) |
| `token_out_of_vocab` | a prompt or completion token id >= the model's vocabulary size |
| `sequence_too_long` | bos + prompt + completion tokens > the model's context (a multi-turn record too: refused whole, not split, `_length`) |
| `invalid_logprobs` | a behaviour log-prob of a trained token (`loss_mask` 1) is NaN, infinite or > 0 (the placeholders at mask-0 positions are ignored) |
| `invalid_reward` | the reward is NaN, infinite or larger in magnitude than `max_abs_reward` |
| `invalid_temperature` | the sampling temperature is NaN, infinite or negative |
| `mixed_temperature` | a multi-turn record whose turns were sampled at different temperatures (a turn without one counts as the record's): the policy scores a record at one temperature, so the other turns' ratios would be off (docs/TRAINER.md "Multi-turn records") |
| `route_mismatch` | (route replay on) routes for a model without MoE layers, a route_shape whose layers/top_k differ from the model's, or an expert id outside [0, n_experts) |
| `constrained` | the completion (or a turn of a multi-turn record) was sampled under a grammar constraint (a required or named `tool_choice`): its behaviour log-probs are of the masked distribution, which the trainer's unmasked scoring does not reproduce, so its importance ratios would be off by the mask's log-mass (docs/NUMERICS.md) |
| `step_failed` | the optimizer step raised on this rollout (trainer/loop.py isolates it) |

Routes absent while replay is on are accepted: the rollout trains with the current router's
choices (not bit-exact, but trainable). A record with `turns` has its routes checked as a
one-call record's (they cover its whole completion, zeros between the turns) and replayed on its
trained tokens only (trainer/batch.py `replay_routes`; docs/TRAINER.md "The objective on
trajectories").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policy import Policy
    from trainer.rollout_record import Rollout

REFUSAL_REASONS = (
    "invalid_json",
    "invalid_rollout",
    "tokenizer_mismatch",
    "token_out_of_vocab",
    "sequence_too_long",
    "invalid_logprobs",
    "invalid_reward",
    "invalid_temperature",
    "mixed_temperature",
    "route_mismatch",
    "constrained",
    "step_failed",
)


@dataclass(frozen=True)
class Refusal:
    reason: str  # one of REFUSAL_REASONS
    message: str  # names the field and the limit
    field: str = "(record)"

    def __post_init__(self) -> None:
        assert self.reason in REFUSAL_REASONS, f"unknown refusal reason {self.reason!r}"

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


@dataclass(frozen=True)
class ModelSpec:
    """What a rollout must fit: the trained model's tokenizer, vocabulary, context and MoE routing."""

    tokenizer: str
    vocab_size: int
    max_context: int | None  # tokens incl. the bos the policy prepends; None = unbounded
    moe: tuple[int, int, int] | None  # (n_layers, top_k, n_experts), None for a dense policy
    replay_routes: bool = True
    max_abs_reward: float = 1e6
    reserved_tokens: int = 1  # bos

    @classmethod
    def of(cls, policy: Policy, *, replay_routes: bool, max_abs_reward: float) -> ModelSpec:
        c: dict[str, Any] = policy.config_dict()
        moe = getattr(policy, "moe_spec", None)  # HF policies: (MoE layers, top_k, experts)
        if moe is None and {"n_layers", "top_k", "n_experts"} <= c.keys():
            moe = (int(c["n_layers"]), int(c["top_k"]), int(c["n_experts"]))
        return cls(
            tokenizer=policy.tokenizer.name,
            vocab_size=int(policy.tokenizer.vocab_size),
            max_context=c.get("max_context"),
            moe=moe,
            replay_routes=replay_routes,
            max_abs_reward=max_abs_reward,
        )


def check_rollout(r: Rollout, spec: ModelSpec) -> Refusal | None:
    """The first reason `spec`'s model cannot train on `r`, or None."""
    for check in (
        _constrained,
        _tokenizer,
        _vocab,
        _length,
        _logprobs,
        _reward,
        _temperature,
        _routes,
    ):
        refusal = check(r, spec)
        if refusal is not None:
            return refusal
    return None


def _constrained(r: Rollout, spec: ModelSpec) -> Refusal | None:
    """A one-call record sampled under a grammar, or a multi-turn one whose every turn was; a
    multi-turn record with other turns trains on those (its constrained turns masked at intake,
    trainer/rollouts.py)."""
    every = r.constrained if r.turns is None else all(t.constrained for t in r.turns)
    if every:
        return Refusal(
            "constrained",
            "sampled under a grammar constraint: its behaviour log-probs are of the masked "
            "distribution, which the trainer does not score",
            "constrained",
        )
    return None


def _tokenizer(r: Rollout, spec: ModelSpec) -> Refusal | None:
    if r.tokenizer is not None and r.tokenizer != spec.tokenizer:
        return Refusal(
            "tokenizer_mismatch",
            f"tokenizer {r.tokenizer!r} is not the model's {spec.tokenizer!r}",
            "tokenizer",
        )
    return None


def _vocab(r: Rollout, spec: ModelSpec) -> Refusal | None:
    for name in ("prompt_tokens", "completion_tokens"):
        tokens = getattr(r, name)
        for i, t in enumerate(tokens):
            if t >= spec.vocab_size:
                return Refusal(
                    "token_out_of_vocab",
                    f"{name}[{i}] = {t} is outside the vocabulary [0, {spec.vocab_size})",
                    f"{name}.{i}",
                )
    return None


def _length(r: Rollout, spec: ModelSpec) -> Refusal | None:
    """bos + prompt + completion must fit the context. A multi-turn record that does not is
    refused whole, never split into rows that fit: every turn was sampled with all the tokens
    before it in context (the ledger joins turns only on an exact token prefix), so a row that
    drops its oldest tokens scores the turn given a context it was not sampled in, and its
    importance ratios would compare two different conditionals (docs/TRAINER.md "The objective on
    trajectories")."""
    if spec.max_context is None:
        return None
    reserved, n_prompt = spec.reserved_tokens, len(r.prompt_tokens)
    n = reserved + n_prompt + len(r.completion_tokens)
    if n <= spec.max_context:
        return None
    message = (
        f"{reserved} + {n_prompt} prompt + {len(r.completion_tokens)} completion tokens = {n} "
        f"exceed the model's context {spec.max_context}"
    )
    over = [
        k for k, t in enumerate(r.turns or []) if reserved + n_prompt + t.end > spec.max_context
    ]
    if over:
        end = reserved + n_prompt + r.turns[over[0]].end  # type: ignore[index]
        message += (
            f"; turns[{over[0]}] ends at token {end}: a multi-turn record is not split (a row "
            "that fits would drop context its turns were sampled with)"
        )
    return Refusal("sequence_too_long", message, "completion_tokens")


def _logprobs(r: Rollout, spec: ModelSpec) -> Refusal | None:
    trained = r.train_mask() or [1] * len(r.logprobs)
    for i, (x, m) in enumerate(zip(r.logprobs, trained, strict=True)):
        if m and (not math.isfinite(x) or x > 0):
            return Refusal(
                "invalid_logprobs",
                f"logprobs[{i}] = {x!r}: log-probs must be finite and <= 0",
                f"logprobs.{i}",
            )
    return None


def _reward(r: Rollout, spec: ModelSpec) -> Refusal | None:
    if not math.isfinite(r.reward) or abs(r.reward) > spec.max_abs_reward:
        return Refusal(
            "invalid_reward",
            f"reward {r.reward!r} must be finite with |reward| <= {spec.max_abs_reward:g}",
            "reward",
        )
    return None


def _temperature(r: Rollout, spec: ModelSpec) -> Refusal | None:
    for t in {r.temperature} | r.turn_temperatures():
        if t is not None and (not math.isfinite(t) or t < 0):
            return Refusal(
                "invalid_temperature", f"temperature {t!r} must be finite and >= 0", "temperature"
            )
    if len(r.turn_temperatures()) > 1:
        return Refusal(
            "mixed_temperature",
            f"turns sampled at temperatures {sorted(r.turn_temperatures(), key=str)}: the trainer "
            "scores a record at one temperature",
            "turns",
        )
    return None


def _routes(r: Rollout, spec: ModelSpec) -> Refusal | None:
    if not spec.replay_routes or r.route_shape is None:
        return None
    if spec.moe is None:
        return Refusal("route_mismatch", "routes given for a model without MoE layers", "routes")
    layers, top_k, n_experts = spec.moe
    if tuple(r.route_shape[1:]) != (layers, top_k):
        return Refusal(
            "route_mismatch",
            f"route_shape {list(r.route_shape)} needs [{len(r.completion_tokens)}, {layers}, "
            f"{top_k}] (the model's n_layers, top_k)",
            "route_shape",
        )
    ids = r.routes_array()
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        return Refusal(
            "route_mismatch",
            f"routes hold expert id {bad}, outside the model's [0, {n_experts})",
            "routes",
        )
    return None
