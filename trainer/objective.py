"""The RL objective of docs/DESIGN.md §Training, as pure functions on tensors.

Every term works on right-padded [B, T] float32 tensors of per-token log-probs of the
*sampled* completion tokens plus a {0,1} float32 mask of real tokens, so each term can be
checked against a hand-computed example (tests/unit/trainer/test_objective.py) and the
loop (trainer/loop.py) only has to gather the log-probs.

Terms (all choices stated here are also in docs/TRAINER.md):

- Decoupled importance sampling against the behaviour log-probs logged at inference.
  Token ratio rho_t = exp(logp_t - logp_behav_t). The policy-gradient loss of a token is
  -sg(min(rho_t, C)) * A * logp_t (truncated IS, C = 2 by default; sg = stop-gradient), so
  its gradient is min(rho_t, C) * A * grad logp_t. Because we never take more than one
  optimizer step on a rollout, the proximal policy of decoupled PPO is the current policy
  itself and this is exactly its gradient.
- Trust clip (`trust_keep`, off by default): PPO's clip against the behaviour policy. A token
  with A > 0 whose ratio is above 1 + clip_high, or with A < 0 below 1 - clip_low, leaves the
  policy gradient (it stays in the denominator): where min(rho A, clip(rho) A) has no gradient.
- Sequence mask: the sequence ratio is the GEOMETRIC MEAN of the token ratios,
  exp(mean_t(logp_t - logp_behav_t)). A sequence whose ratio falls outside
  [mask_low, mask_high] = [0.5, 2] is masked: its tokens contribute nothing. The policy
  gradient (as the trainer calls it, with the batch mask) divides by all completion tokens of
  the batch, so masked sequences shrink the step; the KL and distillation terms divide by the
  kept tokens (token-level means, DAPO style). When nothing is kept the loss is 0 (still
  connected to the graph).
- Advantages: rollouts sharing a `group_id` with >= 2 sessions get (r - mean_g) / (std_g + eps)
  over their group; the others get (r - mean) / (std + eps) over those other rollouts of the
  batch (when there is only one such rollout, mean and std are taken over the whole batch).
  std is the population std (unbiased=False), eps = 1e-6. A group's mean and std are over its
  sessions, each counted once by the mean of its rollouts' rewards: a session the ledger split
  into several segments (a rewritten history, a bound) sends each with the session's outcome,
  and counting each would weigh that session several times in its group's baseline.
- KL to the serving champion with the k3 estimator on the sampled tokens:
  k3_t = exp(q_t) - q_t - 1 with q_t = logp_ref_t - logp_t, which is >= 0, unbiased for
  KL(pi || pi_ref) under samples of pi and differentiable through logp_t. The tokens were
  sampled by the behaviour policy, so each token's k3 is weighted by the same truncated
  ratio sg(min(rho_t, C)). (The policy interface returns the sampled token's log-prob only,
  so the exact per-token KL over the vocabulary is not available.)
- Partial batches: a step on fewer than `batch_size` rollouts runs at the learning rate times
  their share of `batch_size` (`partial_batch_lr_scale`, the linear scaling rule).
- Self-distillation on tool_error feedback: for the tokens at and after the error position,
  within the call that made it (mask `distill_mask`, trainer/batch.py `distill_spans`), the teacher is the same weights without grad, with the error
  message and hint in its context. The per-token reverse KL KL(pi_student || pi_teacher) is
  estimated on the student's own tokens; its score-function gradient is
  E[(logp_s - logp_t) * grad logp_s], so the loss is
  sg(min(rho_t, C)) * sg(logp_s_t - logp_teacher_t) * logp_s_t, averaged over the distilled
  tokens (on-policy distillation: the per-token reverse KL acts as a negative advantage).
  The logged value is the k1 estimate mean(logp_s - logp_teacher).
- Error turns (`token_advantages`, off by default): the tokens of a call that came back as a tool
  error, from where it broke (trainer/batch.py `error_spans`), get a fixed advantage in place of their
  session's, so a broken call is pushed down even in a session that succeeded, and even when
  negative advantages are scaled by 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS = 1e-6


@dataclass(frozen=True)
class ISWeights:
    """Importance weights of one batch (all tensors detached)."""

    weights: torch.Tensor  # float32 [B, T]: min(rho, C) on kept tokens, 0 elsewhere
    keep: torch.Tensor  # float32 [B, T]: 1 for real tokens of unmasked sequences
    seq_ratio: torch.Tensor  # float32 [B]: geometric mean of token ratios
    seq_kept: torch.Tensor  # bool [B]
    clip_fraction: float  # fraction of real tokens with rho > C
    masked_fraction: float  # fraction of sequences (with >= 1 token) masked by the sequence ratio
    ess: float  # normalised effective sample size of the untruncated token ratios, in (0, 1]
    ratio: torch.Tensor  # float32 [B, T]: untruncated token ratios, 0 off the mask


def importance_weights(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    *,
    trunc_c: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
) -> ISWeights:
    """Truncated token ratios and the sequence-level mask. Shapes [B, T]; mask is {0,1} float32."""
    assert logp.shape == logp_behav.shape == mask.shape, (
        f"shapes {logp.shape} {logp_behav.shape} {mask.shape}"
    )
    with torch.no_grad():
        mask = mask.to(torch.float32)
        log_ratio = (logp.detach().to(torch.float32) - logp_behav.to(torch.float32)) * mask
        ratio = torch.exp(log_ratio) * mask
        n_tok = mask.sum(dim=1)
        has_tokens = n_tok > 0
        seq_log_ratio = log_ratio.sum(dim=1) / n_tok.clamp(min=1.0)
        seq_ratio = torch.exp(seq_log_ratio)
        seq_kept = has_tokens & (seq_ratio >= mask_low) & (seq_ratio <= mask_high)
        keep = mask * seq_kept.to(torch.float32).unsqueeze(1)
        weights = torch.clamp(ratio, max=trunc_c) * keep
        n_real = float(mask.sum())
        clipped = float(((ratio > trunc_c).to(torch.float32) * mask).sum())
        n_seq = int(has_tokens.sum())
        masked = int((has_tokens & ~seq_kept).sum())
        sum_r, sum_r2 = float(ratio.sum()), float((ratio * ratio).sum())
        ess = (sum_r * sum_r) / (n_real * sum_r2) if n_real > 0 and sum_r2 > 0 else 0.0
    return ISWeights(
        weights=weights,
        keep=keep,
        seq_ratio=seq_ratio,
        seq_kept=seq_kept,
        clip_fraction=clipped / n_real if n_real else 0.0,
        masked_fraction=masked / n_seq if n_seq else 0.0,
        ess=ess,
        ratio=ratio,
    )


ADV_SCALES = ("group", "none")


def advantages(
    rewards: torch.Tensor,
    group_ids: list[str | None],
    scale: str = "group",
    negative_scale: float = 1.0,
    baseline_keys: list[str] | None = None,
    unsuccessful: list[bool] | None = None,
) -> torch.Tensor:
    """Advantages: each reward minus its group's mean for groups of >= 2 sessions, minus the mean
    of the other rollouts of the batch for the rest. [B] -> [B].

    `baseline_keys` (one per rollout, trainer/batch.py `baseline_key`: a ledger segment's session,
    any other record's request; None: each rollout its own): a group's mean and std
    are over its sessions, each one value (the mean of its rollouts' rewards), so a session split
    into several segments counts once in its group, and a group of one session's segments has no
    baseline of its own (the batch's is used).

    `scale="group"` (GRPO) divides each group by its own std; `"none"` (Dr. GRPO, Liu et al. 2025)
    keeps the centred rewards in reward units. With groups of two, the group std turns any
    difference into +-1: once most groups are two accepted completions that differ only by
    persistence noise, that noise gets the full weight of a real preference (docs/TRAINER.md
    "Where the drift came from").

    `negative_scale` multiplies the advantages below 0 (1: the policy gradient; 0: learn only from
    the rollouts that beat their baseline, pushing up what worked and nothing down). On agent
    sessions, where one advantage is spread over every sampled token of a session, a negative one
    pushes down the format and the moves of a session that failed on one byte; at a rate where the
    skill moves, that collapsed the sessions into giving up (docs/TRAINER.md "Why it falls
    short").

    `unsuccessful` (one per rollout; None: off): True for a rollout of an agent session whose
    outcome is known and is not `success`; its advantage is at most 0. In a group where every
    session failed, the one that failed with fewer tool errors, or without giving up, is above
    the group's mean, and its wrong moves were pushed up like a success's (docs/TRAINER.md "Why it
    falls short": `*` after `add`). The baselines are unchanged: only what is pushed up is."""
    assert 0.0 <= negative_scale <= 1.0, f"negative_scale {negative_scale} not in [0, 1]"
    assert rewards.dim() == 1 and rewards.shape[0] == len(group_ids), (
        f"{rewards.shape} vs {len(group_ids)} group ids"
    )
    assert baseline_keys is None or len(baseline_keys) == len(group_ids), (
        f"{len(baseline_keys)} baseline keys for {len(group_ids)} rollouts"
    )
    assert unsuccessful is None or len(unsuccessful) == len(group_ids), (
        f"{len(unsuccessful)} outcomes for {len(group_ids)} rollouts"
    )
    assert scale in ADV_SCALES, f"advantage scale {scale!r} not in {ADV_SCALES}"
    rewards = rewards.to(torch.float32)
    out = torch.zeros_like(rewards)
    members = _members(group_ids, baseline_keys)

    def centred(r: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        d = r - ref.mean()
        return d / (ref.std(unbiased=False) + EPS) if scale == "group" else d

    for sess in members.values():
        if len(sess) >= 2:
            idx = _flat(sess)
            per_session = torch.stack([rewards[s].mean() for s in sess.values()])
            out[idx] = centred(rewards[idx], per_session)
    single = [i for i, judged in enumerate(_in_group(members, group_ids)) if not judged]
    if single:
        ref = rewards[single] if len(single) >= 2 else rewards
        out[single] = centred(rewards[single], ref)
    if unsuccessful is not None and any(unsuccessful):
        out = torch.where(torch.tensor(unsuccessful) & (out > 0), torch.zeros_like(out), out)
    return out if negative_scale == 1.0 else torch.where(out < 0, out * negative_scale, out)


def unsuccessful(outcomes: list[str | None]) -> list[bool]:
    """`advantages`' `unsuccessful` from the rollouts' session outcomes (None: not an agent
    session's, or its outcome has not reached it: not held back)."""
    return [o is not None and o != "success" for o in outcomes]


def _members(
    group_ids: list[str | None], baseline_keys: list[str] | None = None
) -> dict[str, dict[str, list[int]]]:
    """group -> baseline key (a session) -> the batch positions of its rollouts (in batch order)."""
    members: dict[str, dict[str, list[int]]] = {}
    for i, g in enumerate(group_ids):
        if g is not None:
            s = str(i) if baseline_keys is None else baseline_keys[i]
            members.setdefault(g, {}).setdefault(s, []).append(i)
    return members


def _in_group(members: dict[str, dict[str, list[int]]], group_ids: list[str | None]) -> list[bool]:
    return [g is not None and len(members[g]) >= 2 for g in group_ids]


def _flat(sessions: dict[str, list[int]]) -> list[int]:
    return sorted(i for idx in sessions.values() for i in idx)


def grouped(group_ids: list[str | None], baseline_keys: list[str] | None = None) -> list[bool]:
    """Which rollouts `advantages` judges against their group (a group with >= 2 sessions in the
    batch); the others get the batch's baseline. A group whose members arrived in different
    batches is judged in each by the members there."""
    return _in_group(_members(group_ids, baseline_keys), group_ids)


PARTIAL_BATCH_LR = ("scale", "full")


def partial_batch_lr_scale(n_rollouts: int, batch_size: int, rule: str = "scale") -> float:
    """The learning-rate factor of a step on `n_rollouts` when a full batch is `batch_size`:
    min(1, n / batch_size) under `rule="scale"`, the linear scaling rule (Goyal et al. 2017,
    "Accurate, Large Minibatch SGD"); 1 under `"full"`.

    Adam's update has about the same size whatever the gradient's scale, and the gradient of a
    mean over few rollouts is mostly noise, so without it a step on 2 rollouts moves the weights
    as far as a step on 16, in a random direction. A trainer that steps on what arrived within
    `max_wait_s` takes many such steps on a loaded machine (measured in the demo: batches of 2-16
    rollouts, docs/TRAINER.md)."""
    assert batch_size >= 1 and n_rollouts >= 0, f"{n_rollouts} rollouts, batch size {batch_size}"
    assert rule in PARTIAL_BATCH_LR, f"partial-batch rule {rule!r} not in {PARTIAL_BATCH_LR}"
    return min(1.0, n_rollouts / batch_size) if rule == "scale" else 1.0


def _token_mean(x: torch.Tensor, keep: torch.Tensor, total: float | None = None) -> torch.Tensor:
    """Sum over kept tokens / number of kept tokens; 0 (connected to the graph) if none.

    `total`: the denominator to use instead of `keep.sum()`: the count over the GLOBAL batch of a
    distributed trainer (trainer/distributed.py), whose ranks each hold part of it, so that the
    per-rank losses add up to the loss of the whole batch."""
    if total is not None:
        return (x * keep).sum() / total if total > 0 else (x * keep).sum() * 0.0
    n = keep.sum()
    return (x * keep).sum() / n if float(n) > 0 else (x * keep).sum() * 0.0


def _per_token(adv: torch.Tensor) -> torch.Tensor:
    """Advantages [B] (one a rollout, broadcast over its tokens) or [B, T] (per token) as float32
    broadcastable against [B, T]."""
    adv = adv.to(torch.float32)
    return adv.unsqueeze(1) if adv.dim() == 1 else adv


def token_advantages(adv: torch.Tensor, error_mask: torch.Tensor, value: float) -> torch.Tensor:
    """Per-token advantages [B, T]: each rollout's `adv` [B] on its tokens, and `value` instead on
    the tokens of `error_mask` [B, T] (1 on a call that came back as a tool error, from where it
    broke to the end of that call: trainer/batch.py `error_spans`).

    A session's one advantage is copied to every token it sampled, so a session that succeeded
    after a call the tools could not run pushes that call up with the rest, and with negative
    advantages scaled by 0 (the agent demo) a call that failed is never pushed down: the built-in
    policy's `//` edits dropped their last brace in one call of eight at every version of a run
    (docs/TRAINER.md "Why it falls short"). Here the broken call alone gets `value` (< 0), and the
    session's other turns keep the session's advantage. The gradient of -A log p on a token is
    A (1 - p) on its logit, so the push lands on the tokens the policy was unsure of (the byte it
    got wrong), hardly on the call's format it samples at p ~ 1."""
    assert adv.dim() == 1 and error_mask.shape[0] == adv.shape[0], (
        f"advantages {tuple(adv.shape)} vs error mask {tuple(error_mask.shape)}"
    )
    tok = adv.to(torch.float32).unsqueeze(1).expand(error_mask.shape)
    return torch.where(error_mask > 0, torch.full_like(tok, float(value)), tok)


def trust_keep(
    w: ISWeights, adv: torch.Tensor, clip_low: float = 0.0, clip_high: float = 0.0
) -> torch.Tensor:
    """The kept tokens left after PPO's clip against the behaviour policy (float32 [B, T]).

    PPO's clipped surrogate min(rho A, clip(rho, 1 - lo, 1 + hi) A) has no gradient where the
    clip binds: a token with A > 0 whose ratio is already above 1 + hi, or with A < 0 below
    1 - lo. On stale rollouts that is what stops the trainer pushing, again and again, what the
    serving champion did well and the trainer has already learned (docs/TRAINER.md "Stale
    rollouts and the trust clip"). 0 turns a side off (DAPO's clip-higher sets them apart)."""
    keep = w.keep
    if not (clip_low or clip_high):
        return keep
    a = _per_token(adv)
    bound = torch.zeros_like(keep, dtype=torch.bool)
    if clip_high:
        bound |= (a > 0) & (w.ratio > 1.0 + clip_high)
    if clip_low:
        bound |= (a < 0) & (w.ratio < 1.0 - clip_low)
    return keep * (~bound).to(torch.float32)


def policy_gradient_loss(
    logp: torch.Tensor,
    adv: torch.Tensor,
    w: ISWeights,
    mask: torch.Tensor | None = None,
    total: float | None = None,
    pg_keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Truncated-IS policy gradient: -sg(min(rho, C)) * A * logp summed over kept tokens, divided by
    the completion tokens of the whole batch (`mask`; kept tokens when None). `adv`: [B], one a
    rollout, or [B, T] per token (`token_advantages`).

    With `mask`, a masked sequence still counts in the denominator: when the policy has drifted
    from the one that generated the batch and most sequences are masked, the step shrinks in
    proportion instead of letting the few kept sequences move the weights as much as a full
    on-policy batch would (measured in the demo: with 81% masked and the kept-token mean, held-out
    acceptance collapsed from 0.36 to 0.08 within one version)."""
    keep = w.keep if pg_keep is None else pg_keep  # `trust_keep`: PPO's clip
    x = -w.weights * _per_token(adv) * logp * keep  # kept tokens only (keep is within mask)
    return _token_mean(x, w.keep if mask is None else mask.to(torch.float32), total)


def kl_k3(
    logp: torch.Tensor, logp_ref: torch.Tensor, w: ISWeights, total: float | None = None
) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) on sampled tokens, IS-weighted, mean over kept tokens
    (`total`: the kept tokens of the global batch, see `_token_mean`)."""
    q = logp_ref.detach() - logp
    k3 = torch.exp(q) - q - 1.0
    return _token_mean(w.weights * k3, w.keep, total)


class AdaptiveKL:
    """The KL weight as a proportional controller (Ziegler et al. 2019, "Fine-Tuning Language Models
    from Human Preferences"; TRL's AdaptiveKLController), so the policy stays within a trust region
    of the serving champion instead of drifting until the gate's KL bound refuses every version.

    After each step with measured per-token KL `kl`: e = clip(kl / target - 1, -0.2, 0.2) and
    coef <- coef * (1 + rate * e), bounded to [coef_min, coef_max]. `target=None` keeps the
    weight fixed (the update is a no-op). Pure: the trainer persists `coef` with its state.
    """

    def __init__(
        self,
        coef: float,
        target: float | None,
        rate: float = 0.1,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
    ):
        assert coef >= 0 and rate >= 0, f"coef and rate must be >= 0, got {coef}, {rate}"
        assert target is None or target > 0, f"KL target must be > 0, got {target}"
        self.coef, self.target, self.rate = float(coef), target, rate
        self.coef_min, self.coef_max = coef_min, coef_max

    def update(self, kl: float) -> float:
        """Fold one step's measured KL in; returns the weight for the next step."""
        if self.target is None or not math.isfinite(kl) or self.coef == 0:
            return self.coef
        err = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef = min(max(self.coef * (1.0 + self.rate * err), self.coef_min), self.coef_max)
        return self.coef


def distill_loss(
    logp: torch.Tensor,
    logp_teacher: torch.Tensor,
    distill_mask: torch.Tensor,
    w: ISWeights,
    mask: torch.Tensor | None = None,
    total: float | None = None,
) -> tuple[torch.Tensor, float]:
    """Self-distillation surrogate and the k1 reverse-KL estimate on the distilled tokens.

    distill_mask: {0,1} float32 [B, T], 1 on the distilled tokens: from a tool error to the end of
    its call's sampled tokens (trainer/batch.py `distill_spans`).
    mask: the batch's completion-token mask [B, T]: the surrogate is summed over the distilled
    kept tokens and divided by ALL completion tokens of the batch, the policy-gradient term's
    denominator, so a distilled token weighs what a policy-gradient token weighs. (Divided by
    the distilled tokens alone, one tool error in a batch of 16 moved the weights like a whole
    batch: measured in the demo, steps with distillation had gradient norms 5-48x the others,
    the global clip then shrank the policy gradient by as much, and held-out acceptance fell
    from 0.52 to 0.32 in three versions; docs/TRAINER.md "Where the drift came from".)
    With `mask` None the denominator is the distilled kept tokens. `total`: the completion tokens
    of the global batch (see `_token_mean`).
    Returns (loss whose gradient is the IS-weighted reverse-KL score-function gradient,
             mean(logp - logp_teacher) over the distilled kept tokens as a float).
    """
    keep = w.keep * distill_mask.to(torch.float32)
    gap = (logp.detach() - logp_teacher.detach()) * keep
    loss = _token_mean(
        w.weights * gap * logp, keep if mask is None else mask.to(torch.float32), total
    )
    n = float(keep.sum())
    return loss, (float(gap.sum()) / n if n else 0.0)
