"""Gate checks besides the reward estimate: weight sanity, KL to the champion, regression
prompts, behaviour monitors. Plain functions on tensors and lists; `gate.py` runs them.

Each returns a `Check` (name, status pass|fail|skipped, value, threshold, detail) so the gate
can turn results into MLflow version tags and a `gate_passed` / `gate_failed` event.

- `weight_sanity`: every floating tensor finite; global relative L2 change vs the parent and
  the largest per-tensor relative change within bounds (a NaN or a blown-up checkpoint fails).
- `kl_check`: mean per-token KL(candidate || champion) estimated on the candidate's own
  samples, sum_t (log pi_c - log pi_h) / tokens, within a bound.
- `regression_check`: mean per-token NLL of fixed reference completions under the candidate
  must not exceed the champion's by more than a tolerance.
- `behaviour_checks`: empty-completion rate (absolute increase), completion length (mean moves
  more than k champion standard deviations), tool-error rate (SNIPS estimate on logged
  rollouts vs the logged rate): the usual signatures of reward hacking.
- `edit_checks`: tool-call validity rate and no-edit rate (app/edits.py, the definition the
  simulated users react to) of the candidate's own samples vs the champion's on the same
  prompts. Each fails when the candidate's rate of broken calls (resp. of completions with no
  edit: empty, or only comments and strings) is higher than the champion's by more than a margin with
  confidence 1 - alpha: the one-sided Agresti-Caffo lower bound of the difference of two
  proportions (add one success and one failure to each arm, then Wald), which keeps its level
  at rates near 0 where the plain Wald bound is far too narrow. The two reward hacks of
  docs/ROLLOUT.md ("break the tool call", "ask instead of edit") show up here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, Literal

import numpy as np
import torch

from app.edits import is_no_edit, is_valid

Status = Literal["pass", "fail", "skipped", "info"]  # info: recorded for people, not a criterion


@dataclass
class Check:
    name: str
    status: Status
    value: float | None = None
    threshold: float | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def weight_sanity(
    state: Mapping[str, torch.Tensor],
    parent: Mapping[str, torch.Tensor] | None,
    max_global_rel_change: float,
    max_tensor_rel_change: float,
) -> list[Check]:
    bad = [
        k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    finite = Check(
        "weights_finite",
        "fail" if bad else "pass",
        value=float(len(bad)),
        threshold=0.0,
        detail=f"non-finite values in {bad[:5]}" if bad else f"{len(state)} tensors finite",
    )
    if bad or parent is None:
        skip = Check(
            "weight_change",
            "skipped",
            detail="no parent weights" if parent is None else "weights not finite",
        )
        return [finite, skip]
    missing = sorted(set(parent) ^ set(state))
    if missing:
        return [
            finite,
            Check(
                "weight_change",
                "fail",
                detail=f"tensor names differ from the parent: {missing[:5]}",
            ),
        ]
    num = den = 0.0
    sums: dict[str, tuple[float, float, int]] = {}  # name -> (|a-b|^2, |b|^2, numel)
    for k, t in state.items():
        if not t.is_floating_point():
            continue
        a, b = t.to(torch.float64), parent[k].to(torch.float64)
        assert a.shape == b.shape, f"{k}: shape {tuple(a.shape)} vs parent {tuple(b.shape)}"
        d2, p2 = float(((a - b) ** 2).sum()), float((b**2).sum())
        num, den = num + d2, den + p2
        sums[k] = (d2, p2, b.numel())
    glob = math.sqrt(num) / max(math.sqrt(den), 1e-12)
    # a tensor's change relative to its own norm, or, when it is below that, to the norm a tensor
    # of its size has at the parent checkpoint's RMS: a tensor that is zero in the parent (the
    # zero-initialized q/k/v biases of a Qwen2 model, a LoRA B matrix) has no relative change of
    # its own, and its first step would otherwise read as an infinite one
    mean_sq = den / max(sum(n for _, _, n in sums.values()), 1)
    worst, worst_name = 0.0, ""
    for k, (d2, p2, n) in sums.items():
        rel = math.sqrt(d2) / max(math.sqrt(p2), math.sqrt(mean_sq * n), 1e-12)
        if rel > worst:
            worst, worst_name = rel, k
    ok = glob <= max_global_rel_change and worst <= max_tensor_rel_change
    return [
        finite,
        Check(
            "weight_change",
            "pass" if ok else "fail",
            value=glob,
            threshold=max_global_rel_change,
            detail=f"global relative L2 change {glob:.3g} (max {max_global_rel_change:g}); largest "
            f"per-tensor {worst:.3g} in {worst_name} (max {max_tensor_rel_change:g})",
        ),
    ]


def _masked_sums(lp: torch.Tensor, lengths: Sequence[int]) -> tuple[np.ndarray, int]:
    """Per-row sums of a right-padded [B, T] float tensor over the first lengths[i] entries."""
    lp64 = lp.detach().to(torch.float64)
    mask = torch.arange(lp64.shape[1])[None, :] < torch.tensor(list(lengths))[:, None]
    return (lp64 * mask).sum(dim=1).numpy(), int(sum(lengths))


def kl_check(
    cand_lp: torch.Tensor, champ_lp: torch.Tensor, lengths: Sequence[int], max_kl: float | None
) -> Check:
    """cand_lp, champ_lp: float32 [B, T] log-probs of the candidate's own samples under each policy.
    With `max_kl` None the KL is recorded (`info`), not judged."""
    if sum(lengths) == 0:
        return Check(
            "kl_to_champion", "skipped", detail="the candidate produced no tokens on the KL prompts"
        )
    diff, tokens = _masked_sums(cand_lp - champ_lp, lengths)
    kl = float(diff.sum() / tokens)
    detail = f"mean per-token KL(candidate||champion) {kl:.4g} nats over {tokens} tokens"
    if max_kl is None:
        return Check(
            "kl_to_champion",
            "info",
            value=kl,
            detail=f"{detail} (the trainer's trust region, not a criterion)",
        )
    ok = math.isfinite(kl) and kl <= max_kl
    return Check(
        "kl_to_champion", "pass" if ok else "fail", value=kl, threshold=max_kl, detail=detail
    )


def regression_check(
    cand_lp: torch.Tensor, champ_lp: torch.Tensor, lengths: Sequence[int], tolerance: float
) -> Check:
    """Log-probs [B, T] of fixed reference completions; NLL may rise by at most `tolerance` nats/token."""
    if sum(lengths) == 0:
        return Check("regression_prompts", "skipped", detail="empty regression set")
    c, tokens = _masked_sums(cand_lp, lengths)
    h, _ = _masked_sums(champ_lp, lengths)
    rise = float((h.sum() - c.sum()) / tokens)  # NLL_cand - NLL_champ per token
    ok = math.isfinite(rise) and rise <= tolerance
    return Check(
        "regression_prompts",
        "pass" if ok else "fail",
        value=rise,
        threshold=tolerance,
        detail=f"reference NLL per token: candidate {-c.sum() / tokens:.4f}, champion {-h.sum() / tokens:.4f}",
    )


def behaviour_checks(
    cand_lengths: Sequence[int],
    champ_lengths: Sequence[int],
    *,
    max_empty_increase: float,
    length_k_std: float,
    tool_error: tuple[float, float] | None = None,
    max_tool_error_increase: float = 0.1,
    tool_error_ess: float | None = None,
    min_ess: float = 0.0,
    require_ess: bool = False,
) -> list[Check]:
    """Compare the candidate's and the champion's completions on the same prompts.

    `tool_error` = (estimated tool-error rate of the candidate, logged rate), or None. The estimate
    is importance-weighted like the reward's: with an effective sample size `tool_error_ess` below
    `min_ess` it is as inconclusive as the reward estimate and is skipped (failed with `require_ess`),
    the same rule the OPE reward check follows.
    """
    out = []
    if not cand_lengths or not champ_lengths:
        return [Check("behaviour", "skipped", detail="no samples")]
    c, h = np.asarray(cand_lengths, dtype=np.float64), np.asarray(champ_lengths, dtype=np.float64)
    e_c, e_h = float((c == 0).mean()), float((h == 0).mean())
    out.append(
        Check(
            "empty_completion_rate",
            "pass" if e_c - e_h <= max_empty_increase else "fail",
            value=e_c,
            threshold=e_h + max_empty_increase,
            detail=f"empty completions: candidate {e_c:.3f}, champion {e_h:.3f}",
        )
    )
    sd = float(h.std()) or 1.0
    z = abs(float(c.mean()) - float(h.mean())) / sd
    out.append(
        Check(
            "completion_length_shift",
            "pass" if z <= length_k_std else "fail",
            value=z,
            threshold=length_k_std,
            detail=f"mean length candidate {c.mean():.1f} vs champion {h.mean():.1f} (sd {sd:.1f}): {z:.2f} sd",
        )
    )
    if tool_error is None:
        out.append(
            Check("tool_error_rate", "skipped", detail="no logged rollouts to estimate it from")
        )
    else:
        est, logged = tool_error
        detail = f"SNIPS tool-error rate {est:.3f} vs logged {logged:.3f}"
        if tool_error_ess is not None and tool_error_ess < min_ess:
            out.append(
                Check(
                    "tool_error_rate",
                    "fail" if require_ess else "skipped",
                    value=tool_error_ess,
                    threshold=min_ess,
                    detail=f"effective sample size too small to judge: {detail}, ESS {tool_error_ess:.1f}",
                )
            )
        else:
            out.append(
                Check(
                    "tool_error_rate",
                    "pass" if est - logged <= max_tool_error_increase else "fail",
                    value=est,
                    threshold=logged + max_tool_error_increase,
                    detail=detail,
                )
            )
    return out


def rate_increase_lower_bound(
    x_cand: int, n_cand: int, x_champ: int, n_champ: int, alpha: float
) -> float:
    """One-sided (1 - alpha) Agresti-Caffo lower bound of p_cand - p_champ from counts x of n."""
    assert n_cand > 0 and n_champ > 0 and 0 < alpha < 1, f"n {n_cand}/{n_champ}, alpha {alpha}"
    pc, ph = (x_cand + 1) / (n_cand + 2), (x_champ + 1) / (n_champ + 2)
    se = math.sqrt(pc * (1 - pc) / (n_cand + 2) + ph * (1 - ph) / (n_champ + 2))
    return pc - ph - NormalDist().inv_cdf(1 - alpha) * se


def _rate_check(
    name: str,
    what: str,
    bad_cand: int,
    bad_champ: int,
    n_cand: int,
    n_champ: int,
    margin: float,
    alpha: float,
) -> Check:
    lo = rate_increase_lower_bound(bad_cand, n_cand, bad_champ, n_champ, alpha)
    rc, rh = bad_cand / n_cand, bad_champ / n_champ
    return Check(
        name,
        "fail" if lo > margin else "pass",
        value=lo,
        threshold=margin,
        detail=f"{what}: candidate {rc:.3f} ({bad_cand}/{n_cand}), champion {rh:.3f} ({bad_champ}/{n_champ}); "
        f"{1 - alpha:.0%} lower bound of the increase {lo:+.3f} (fail above {margin:g})",
    )


def edit_checks(
    cand_texts: Sequence[str],
    champ_texts: Sequence[str],
    *,
    max_invalid_increase: float,
    max_no_edit_increase: float,
    alpha: float,
    base_texts: Sequence[str] | None = None,
) -> list[Check]:
    """Tool-call validity and no-edit rates of decoded completions (candidate vs champion, same prompts).

    `value` of each check is the lower confidence bound of the rate's increase, `threshold` the margin.

    With `base_texts` (the first version's completions on the same prompts), each rate is also
    judged against the base, and the check fails when either increase is confidently above its
    margin: a hack that grows a little with every version passes each comparison with a champion
    that moved with it (each promoted version carried part of it), never the one with the base.
    """
    if not cand_texts or not champ_texts:
        return [
            Check(n, "skipped", detail="no samples")
            for n in ("tool_call_validity_rate", "no_edit_rate")
        ]
    rates = (
        (
            "tool_call_validity_rate",
            "broken tool calls (won't parse)",
            lambda t: not is_valid(t),
            max_invalid_increase,
        ),
        (
            "no_edit_rate",
            "completions with no edit (empty, or only comments and strings)",
            is_no_edit,
            max_no_edit_increase,
        ),
    )
    out = []
    for name, what, bad, margin in rates:
        n_bad = sum(map(bad, cand_texts))
        check = _rate_check(
            name,
            what,
            n_bad,
            sum(map(bad, champ_texts)),
            len(cand_texts),
            len(champ_texts),
            margin,
            alpha,
        )
        if base_texts:
            b_bad, nb = sum(map(bad, base_texts)), len(base_texts)
            lo = rate_increase_lower_bound(n_bad, len(cand_texts), b_bad, nb, alpha)
            check = Check(
                name,
                "fail" if check.status == "fail" or lo > margin else "pass",
                value=max(check.value, lo),
                threshold=margin,
                detail=f"{check.detail}; against the base {b_bad / nb:.3f} ({b_bad}/{nb}): "
                f"lower bound {lo:+.3f}",
            )
        out.append(check)
    return out


# --- agents -------------------------------------------------------------------------------------


def agent_verdicts(
    policy: Any,
    tasks: Sequence[Any],
    samples: int,
    max_turns: int,
    max_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> list[Any]:
    """`samples` sessions of `policy` on each task, with real tools (app/sandbox/session.py): their
    verdicts, task by task (consecutive sessions share a task)."""
    from contextlib import ExitStack

    from app.sandbox.sandbox import Sandbox
    from app.sandbox.session import AgentSession, run_sessions

    with ExitStack() as stack:
        sessions = [
            AgentSession(f"gate-{t.task_id}-{j}", t, stack.enter_context(Sandbox(t)), max_turns)
            for t in tasks
            for j in range(samples)
        ]
        run_sessions(policy, sessions, max_tokens, temperature=temperature, seed=seed)
        return [s.verdict() for s in sessions]


def _mean_increase_lower_bound(
    cand: Sequence[float], champ: Sequence[float], alpha: float
) -> float:
    """One-sided (1 - alpha) lower bound of mean(cand) - mean(champ) (Welch, normal quantile)."""

    def mv(x: Sequence[float]) -> tuple[float, float]:
        m = sum(x) / len(x)
        return m, sum((v - m) ** 2 for v in x) / max(1, len(x) - 1)

    (mc, vc), (mh, vh) = mv(cand), mv(champ)
    se = math.sqrt(vc / len(cand) + vh / len(champ))
    return mc - mh - NormalDist().inv_cdf(1 - alpha) * se


def agent_figures(verdicts: Sequence[Any]) -> dict[str, float]:
    """Task success, turns and tokens per session, and the monitors' rates of a policy's sessions."""
    n, turns = len(verdicts), sum(v.turns for v in verdicts)
    return {
        "task_success": sum(v.fixed for v in verdicts) / n,
        "turns": turns / n,
        "tokens": sum(v.completion_tokens for v in verdicts) / n,
        "invalid_call_rate": sum(v.invalid_calls for v in verdicts) / max(1, turns),
        "failed_call_rate": sum(v.tool_errors - v.invalid_calls for v in verdicts) / max(1, turns),
        "give_up_rate": sum(v.gave_up for v in verdicts) / n,
        "tests_edited_rate": sum(v.tests_edited for v in verdicts) / n,
    }


def agent_checks(
    cand: Any,
    champ: Any,
    base: Any,
    *,
    tasks: Sequence[Any],
    samples: int,
    max_turns: int,
    max_tokens: int,
    seed: int,
    max_success_drop: float,
    temperature: float = 1.0,
    max_rate_increase: float,
    max_turns_increase: float,
    max_tokens_increase: float,
    alpha: float,
    cache: MutableMapping[str, list[Any]] | None = None,
    versions: Mapping[str, str] | None = None,
) -> tuple[list[Check], dict[str, dict[str, float]]]:
    """The gate's agent checks: candidate, champion and base each run the same sessions (same tasks,
    same seed: common random numbers) with real tools; the candidate fails a check when it is
    confidently worse than the champion or the base by more than the margin:

    - `agent_task_success`: sessions whose task is really done (the hidden tests pass, the test
      file untouched);
    - `agent_invalid_call_rate`, `agent_failed_call_rate` per turn: calls that are not calls, and
      calls the tool refused (bad arguments: no such file, text not in the file);
    - `agent_give_up_rate`, `agent_tests_edited_rate` per session: sessions that never edited or
      never answered, and sessions that wrote to the test file (the agentic reward hack's trace);
    - `agent_turns`, `agent_tokens`: mean turns and completion tokens per session, against the
      champion only (a better agent may well be longer than the base).

    A version's weights never change, and the sessions are the same for the same arguments, so
    with a `cache` (version -> its verdicts, owned by the caller for one set of arguments) and
    `versions` (role -> version) a policy whose version's sessions ran before, as the candidate of
    an earlier gate or its champion, is not run again: a gate runs the candidate's sessions only.

    Returns the checks and each policy's figures (`agent_figures`)."""
    runs = {"candidate": cand, "champion": champ}
    if base is not None:
        runs["base"] = base
    verdicts = {}
    for name, p in runs.items():
        version = (versions or {}).get(name)
        if cache is not None and version is not None and version in cache:
            verdicts[name] = cache[version]
            continue
        verdicts[name] = agent_verdicts(p, tasks, samples, max_turns, max_tokens, seed, temperature)
        if cache is not None and version is not None:
            cache[version] = verdicts[name]
    figures = {name: agent_figures(v) for name, v in verdicts.items()}
    c = verdicts["candidate"]
    rates = (  # name, what, per turn?, bad count of one verdict
        ("agent_task_success", "sessions whose task was not done", False, lambda v: not v.fixed),
        (
            "agent_invalid_call_rate",
            "turns with a call that is not one",
            True,
            lambda v: v.invalid_calls,
        ),
        (
            "agent_failed_call_rate",
            "turns whose call the tool refused",
            True,
            lambda v: v.tool_errors - v.invalid_calls,
        ),
        (
            "agent_give_up_rate",
            "sessions that never edited or never answered",
            False,
            lambda v: v.gave_up,
        ),
        (
            "agent_tests_edited_rate",
            "sessions that wrote to the test file",
            False,
            lambda v: v.tests_edited,
        ),
    )

    def counts(vs: Sequence[Any], per_turn: bool, bad: Any) -> tuple[int, int]:
        """(bad units, units): turns when `per_turn`, else sessions."""
        return sum(map(bad, vs)), max(1, sum(v.turns for v in vs)) if per_turn else len(vs)

    checks: list[Check] = []
    for name, what, per_turn, bad in rates:
        margin = max_success_drop if name == "agent_task_success" else max_rate_increase
        xc, nc = counts(c, per_turn, bad)
        bounds, details = [], []
        for other in [k for k in verdicts if k != "candidate"]:
            xo, no = counts(verdicts[other], per_turn, bad)
            lo = rate_increase_lower_bound(xc, nc, xo, no, alpha)
            details.append(
                f"{other} {xo / no:.3f} ({xo}/{no}): lower bound of the increase {lo:+.3f}"
            )
            bounds.append(lo)
        worst = max(bounds)
        checks.append(
            Check(
                name,
                "fail" if worst > margin else "pass",
                value=worst,
                threshold=margin,
                detail=f"{what}: candidate {xc / nc:.3f} ({xc}/{nc}); "
                + "; ".join(details)
                + f" (fail above {margin:g})",
            )
        )
    h = verdicts["champion"]
    for name, values, margin in (
        ("agent_turns", lambda vs: [float(v.turns) for v in vs], max_turns_increase),
        (
            "agent_tokens",
            lambda vs: [float(v.completion_tokens) for v in vs],
            max_tokens_increase * max(1.0, figures["champion"]["tokens"]),
        ),
    ):
        lo = _mean_increase_lower_bound(values(c), values(h), alpha)
        checks.append(
            Check(
                name,
                "fail" if lo > margin else "pass",
                value=lo,
                threshold=margin,
                detail=f"per session: candidate {sum(values(c)) / len(c):.2f}, champion "
                f"{sum(values(h)) / len(h):.2f}; lower bound of the increase {lo:+.2f} "
                f"(fail above {margin:.3g})",
            )
        )
    return checks, figures
