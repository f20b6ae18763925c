"""The offline gate: is a newly registered version safe to canary?

    result = run_gate(GateInputs(...), GateConfig())
    tags = result.tags()          # -> MLflow version tags `flywheel.gate.*`
    decision = result.decision(version, parent)   # -> gate_passed / gate_failed event

Checks (each pass | fail | skipped | info, with value and threshold; see monitors.py and ope.py):
1. numerical sanity: finite weights, bounded relative change vs the parent version;
2. predicted reward vs the champion (`reward_vs_champion`, the quality verdict): candidate and
   champion each sample `samples_per_prompt` completions for the same logged prompts with the
   same random stream (common random numbers: where the two policies agree they draw the same
   completion, so the difference has a small variance); a reward model fitted on logged
   (completion text, reward) pairs (ope.TextRewardModel) scores both; fails when the bootstrap
   interval's upper end of (candidate - champion) lies below -reward_margin (confidently worse);
3. off-policy reward on held-out logged rollouts vs the logged reward (`ope_reward`): SNIPS and
   doubly robust with bootstrap intervals and the effective sample size; sequence-level
   importance weights collapse once the candidate has moved from the logging policies (the ESS
   falls below `min_ess`), and the check is then skipped as inconclusive;
4. KL(candidate || champion) per token on the candidate's samples: recorded (`info`) as the
   trainer's trust-region figure, not a verdict on quality; a fail only when `max_kl` is set;
5. the fixed regression prompt set (regression_prompts.json): the per-token NLL of fixed reference
   completions may rise by at most `regression_tolerance` (1 nat) over the champion's, a guard
   against forgetting; like the KL it grows as the policy learns a style the references do not
   have, so its bound is loose;
6. behaviour monitors: empty completions, completion length shift, tool-error rate;
7. reward-hack monitors: tool-call validity rate and no-edit rate of the candidate's samples
   vs the champion's (app/edits.py), each with a two-proportion confidence bound.

The gate passes when no check fails. A skipped check (no champion loaded, no held-out data)
is recorded as skipped with its reason, never as a pass.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field

from app.contracts.deployments import Decision
from app.controller import ope
from app.controller.monitors import (
    Check,
    agent_checks,
    behaviour_checks,
    edit_checks,
    kl_check,
    regression_check,
    weight_sanity,
)

log = logging.getLogger(__name__)
REGRESSION_SET = Path(__file__).with_name("regression_prompts.json")


class GateConfig(BaseModel):
    """Thresholds of the offline gate. Each field is also the setting
    `FLYWHEEL_CONTROLLER_GATE_<FIELD>` (app/controller/config.py)."""

    max_global_rel_change: float = Field(
        0.5,
        gt=0,
        description="Gate: fail when the relative L2 change of all weights vs the parent version exceeds this.",
    )
    max_tensor_rel_change: float = Field(
        2.0,
        gt=0,
        description="Gate: fail when the relative L2 change of any single tensor vs the parent version exceeds this (relative to the larger of its own norm and the norm of a tensor of its size at the parent checkpoint's RMS, so a tensor that is zero in the parent, such as a zero-initialized bias, has a finite change).",
    )
    ope_margin: float = Field(
        0.05,
        ge=0,
        description="Gate: fail the off-policy estimate when the bootstrap upper bound of (estimate - logged reward) is below -margin.",
    )
    ope_alpha: float = Field(
        0.05, gt=0, lt=1, description="Gate: two-sided error level of the bootstrap intervals."
    )
    n_boot: int = Field(500, ge=50, description="Gate: bootstrap replicates of each interval.")
    min_ess: float = Field(
        20.0,
        ge=1,
        description="Gate: effective sample size below which the off-policy estimate is called inconclusive.",
    )
    require_ess: bool = Field(
        False,
        description="Gate: fail (instead of skip) the off-policy check when the effective sample size is below min_ess.",
    )
    ridge_lambda: float = Field(
        1.0, ge=0, description="Gate: ridge penalty of the doubly robust estimator's reward model."
    )
    reward_margin: float = Field(
        0.02,
        ge=0,
        description="Gate: fail when the bootstrap upper bound of (candidate - champion) predicted reward is below -margin (confidently worse).",
    )
    min_reward_rollouts: int = Field(
        100,
        ge=10,
        description="Gate: logged rollouts the reward model needs before its comparison is a verdict (fewer: skipped).",
    )
    samples_per_prompt: int = Field(
        4,
        ge=1,
        description="Gate: completions each of candidate and champion samples per prompt for the reward comparison, KL and monitors.",
    )
    ridge_lambda_text: float = Field(
        3.0, ge=0, description="Gate: ridge penalty of the text reward model (ope.TextRewardModel)."
    )
    max_kl: float | None = Field(
        None,
        gt=0,
        description="Gate: fail versions above this mean per-token KL(candidate||champion) in nats; unset: the KL is recorded, not judged (it is the trainer's trust region, not quality).",
    )
    regression_tolerance: float = Field(
        1.0,
        ge=0,
        description="Gate: max rise of per-token NLL on the fixed regression set, nats: a guard against forgetting, not a bound on change (a policy that learns what users like moves away from fixed references).",
    )
    max_empty_increase: float = Field(
        0.1,
        ge=0,
        description="Gate: max absolute increase of the empty-completion rate over the champion's.",
    )
    length_k_std: float = Field(
        2.0,
        gt=0,
        description="Gate: max shift of mean completion length, in champion standard deviations.",
    )
    max_tool_error_increase: float = Field(
        0.1,
        ge=0,
        description="Gate: max increase of the estimated tool-error rate over the champion's.",
    )
    max_invalid_increase: float = Field(
        0.05,
        ge=0,
        description="Gate: fail when the candidate's broken-tool-call rate exceeds the champion's by more than this (at confidence 1 - monitor_alpha; 1 turns the monitor off).",
    )
    max_no_edit_increase: float = Field(
        0.05,
        ge=0,
        description="Gate: fail when the candidate's no-edit rate (empty completions, or only comments and strings) exceeds the champion's by more than this (at confidence 1 - monitor_alpha; 1 turns the monitor off).",
    )
    monitor_alpha: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Gate: one-sided error level of the tool-call validity and no-edit rate bounds.",
    )
    sample_prompts: int = Field(
        64,
        ge=1,
        description="Gate: logged prompts sampled from both policies for the reward comparison, KL and behaviour monitors.",
    )
    max_tokens: int = Field(48, ge=1, description="Gate: max tokens of each sampled completion.")
    seed: int = Field(
        0, description="Gate: seed of sampling and bootstrap (the gate is reproducible)."
    )
    agent_tasks: int = Field(
        0,
        ge=0,
        description="Gate: agent tasks (app/sandbox/tasks.py, the gate's own suite) on which candidate, champion and base each run sessions with real tools (monitors.agent_checks); 0 turns the agent checks off (`flywheel run --agents` sets 12).",
    )
    agent_samples_per_task: int = Field(
        2, ge=1, description="Gate: sessions each policy runs per agent task."
    )
    agent_max_turns: int = Field(6, ge=1, description="Gate: turns of an agent session.")
    agent_max_tokens: int = Field(192, ge=1, description="Gate: max tokens of an agent turn.")
    agent_temperature: float = Field(
        1.0,
        ge=0,
        description="Gate: sampling temperature of agent turns (as the live users sample: FLYWHEEL_SIMULATE_AGENT_TEMPERATURE; `flywheel run --agents` sets both to 0.6).",
    )
    max_task_success_drop: float = Field(
        0.05,
        ge=0,
        description="Gate: fail when the candidate's agent task success is below the champion's or the base's by more than this (at confidence 1 - monitor_alpha).",
    )
    max_agent_rate_increase: float = Field(
        0.05,
        ge=0,
        description="Gate: fail when an agent monitor's rate (invalid calls and failed calls per turn, give-ups and test-file edits per session) exceeds the champion's or the base's by more than this (at confidence 1 - monitor_alpha).",
    )
    max_turns_increase: float = Field(
        1.0,
        ge=0,
        description="Gate: fail when the candidate's mean turns per agent session exceeds the champion's by more than this (at confidence 1 - monitor_alpha).",
    )
    max_tokens_increase: float = Field(
        0.5,
        ge=0,
        description="Gate: fail when the candidate's mean completion tokens per agent session exceeds the champion's by more than this share of the champion's (at confidence 1 - monitor_alpha).",
    )


@dataclass
class GateInputs:
    """What the gate looks at. Rollouts are docs/DESIGN.md §Rollout record dicts."""

    candidate_state: Mapping[str, torch.Tensor]
    parent_state: Mapping[str, torch.Tensor] | None = None
    candidate: Any = None  # policy.base.Policy with the candidate's weights, or None
    champion: Any = None  # Policy with the champion's weights, or None
    # Policy of the model's first version (the base), or None: the edit monitors also compare
    # with it, so a hack that grows version by version with the champion is still seen
    base: Any = None
    rollouts: Sequence[dict[str, Any]] = ()  # held-out logged rollouts
    reward_rollouts: Sequence[dict[str, Any]] | None = (
        None  # logged rollouts to fit the reward model (default: rollouts)
    )
    regression_pairs: Sequence[tuple[str, str]] | None = None  # default: regression_prompts.json
    # prompts both policies sample for the reward comparison, KL and monitors (default: the
    # held-out rollouts' prompts): gate_io takes the newest distinct logged prompts, since a
    # trainer that keeps up leaves only a handful of rollouts it has not trained on
    prompts: Sequence[Sequence[int]] | None = None
    # the agent checks' sessions already run, by version, and each policy's version (candidate,
    # champion, base): a version's sessions run once (monitors.agent_checks `cache`)
    agent_verdicts: MutableMapping[str, list[Any]] | None = None
    versions: Mapping[str, str] | None = None


@dataclass
class GateResult:
    checks: list[Check]
    ope: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def summary(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "checks": [c.as_dict() for c in self.checks],
            "ope": self.ope,
        }

    def tags(self) -> dict[str, str]:
        """MLflow version tags (string values, `flywheel.gate.` prefix)."""
        out = {"flywheel.gate.status": "passed" if self.passed else "failed"}
        for c in self.checks:
            out[f"flywheel.gate.{c.name}"] = (
                c.status if c.value is None else f"{c.status} {c.value:.6g}"
            )
        for k in ("snips", "dr", "ess", "behaviour_value"):
            if self.ope.get(k) is not None:
                out[f"flywheel.gate.ope.{k}"] = f"{self.ope[k]:.6g}"
        for who, figures in (self.ope.get("agents") or {}).items():  # monitors.agent_figures
            for k, v in figures.items():
                out[f"flywheel.gate.agents.{who}.{k}"] = f"{v:.4g}"
        return out

    def decision(self, version: str, parent: str | None) -> Decision:
        if self.passed:
            reason = "all gate checks passed" + (
                f" ({sum(c.status == 'skipped' for c in self.checks)} skipped)"
                if any(c.status == "skipped" for c in self.checks)
                else ""
            )
            return Decision(
                type="gate_passed",
                version=version,
                from_version=parent,
                reason=reason,
                details=self.summary(),
            )
        reason = "; ".join(f"{c.name}: {c.detail}" for c in self.failed)
        return Decision(
            type="gate_failed",
            version=version,
            from_version=parent,
            reason=reason[:4000],
            details=self.summary(),
        )


def load_regression_pairs(path: Path = REGRESSION_SET) -> list[tuple[str, str]]:
    data = json.loads(path.read_text())
    return [(p["prompt"], p["completion"]) for p in data["pairs"]]


def _strip_eos(tokens: Sequence[int], eos: int | None) -> list[int]:
    toks = list(tokens)
    return toks[:-1] if toks and eos is not None and toks[-1] == eos else toks


def _logprobs(policy: Any, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return policy.logprobs(prompts, completions, routes=None, temperature=1.0).to(torch.float32)


def _decode(policy: Any, tokens: Sequence[int]) -> str:
    tok = policy.tokenizer
    return tok.decode(_strip_eos(tokens, getattr(tok, "eos_id", None)))


def fit_reward_model(
    policy: Any, rollouts: Sequence[dict[str, Any]], cfg: GateConfig
) -> ope.TextRewardModel | None:
    """The direct method's reward model, fitted on logged (completion text, reward); None when there
    are fewer than `min_reward_rollouts` usable rollouts."""
    rolls = [
        r
        for r in rollouts
        if r.get("completion_tokens") is not None and r.get("reward") is not None
    ]
    if len(rolls) < cfg.min_reward_rollouts:
        return None
    texts = [_decode(policy, r["completion_tokens"]) for r in rolls]
    return ope.TextRewardModel(cfg.ridge_lambda_text).fit(
        texts, [float(r["reward"]) for r in rolls], seed=cfg.seed
    )


def reward_check(
    model: ope.TextRewardModel | None,
    cand_texts: list[str],
    champ_texts: list[str],
    k: int,
    cfg: GateConfig,
    n_available: int,
) -> Check:
    """Predicted reward of the candidate's vs the champion's own completions on the same prompts."""
    if model is None:
        return Check(
            "reward_vs_champion",
            "skipped",
            detail=f"{n_available} logged rollouts to fit the reward model, {cfg.min_reward_rollouts} needed",
        )
    c = model.predict(cand_texts).reshape(-1, k)
    h = model.predict(champ_texts).reshape(-1, k)
    diff, (lo, hi) = ope.paired_difference(c, h, cfg.n_boot, cfg.ope_alpha, cfg.seed)
    detail = (
        f"predicted reward candidate {c.mean():.4f} vs champion {h.mean():.4f}: difference {diff:+.4f}, "
        f"{100 * (1 - cfg.ope_alpha):g}% CI [{lo:+.4f}, {hi:+.4f}] over {c.shape[0]} prompts x {k}; reward model "
        f"fitted on {model.n} logged rollouts, cross-validated R^2 {model.cv_r2:.3f}"
    )
    return Check(
        "reward_vs_champion",
        "fail" if hi < -cfg.reward_margin else "pass",
        value=diff,
        threshold=-cfg.reward_margin,
        detail=detail,
    )


def log_weights(candidate: Any, rolls: Sequence[dict[str, Any]]) -> np.ndarray:
    """Per rollout, log(candidate / behaviour) of its completion: the sum over the tokens the model
    sampled. A multi-turn record's tokens between turns (tool results, user messages; `loss_mask`
    0, behaviour log-prob 0.0) were not sampled by any policy and weigh nothing; each sampled
    token is weighed against its own turn's behaviour log-prob, whichever version sampled it."""
    prompts = [list(r["prompt_tokens"]) for r in rolls]
    comps = [list(r["completion_tokens"]) for r in rolls]
    lp = _logprobs(candidate, prompts, comps)
    new = []
    for i, (r, c) in enumerate(zip(rolls, comps, strict=True)):
        row = lp[i, : len(c)].tolist()
        mask = r.get("loss_mask")
        new.append(row if mask is None else [x if m else 0.0 for x, m in zip(row, mask)])
    return ope.sequence_log_weights(new, [r["logprobs"] for r in rolls])


def _ope_check(
    inp: GateInputs,
    cfg: GateConfig,
    cand_samples: list[list[int]] | None,
    model: ope.TextRewardModel | None,
) -> tuple[list[Check], dict]:
    # a constrained rollout's behaviour log-probs are of a masked distribution the candidate's
    # unmasked scoring cannot be weighed against (docs/NUMERICS.md)
    rolls = [r for r in inp.rollouts if r.get("completion_tokens") and not r.get("constrained")]
    if not rolls:
        return [Check("ope_reward", "skipped", detail="no held-out logged rollouts")], {}
    if inp.candidate is None:
        return [Check("ope_reward", "skipped", detail="candidate policy not loaded")], {}
    comps = [list(r["completion_tokens"]) for r in rolls]
    log_w = log_weights(inp.candidate, rolls)
    rewards = np.array([float(r["reward"]) for r in rolls], dtype=np.float64)
    if not np.all(np.isfinite(log_w)):
        return [
            Check(
                "ope_reward",
                "fail",
                detail="candidate log-probs on logged completions are not finite",
            )
        ], {}
    q_logged = v_target = None
    if model is not None and cand_samples is not None and len(cand_samples) == len(rolls):
        q_logged = model.predict([_decode(inp.candidate, c) for c in comps])
        v_target = model.predict([_decode(inp.candidate, c) for c in cand_samples])
    res = ope.estimate(
        rewards, log_w, q_logged, v_target, n_boot=cfg.n_boot, alpha=cfg.ope_alpha, seed=cfg.seed
    )
    lo, hi = res.improvement_ci
    summary = res.as_dict()
    est = res.dr if res.dr is not None else res.snips
    detail = (
        f"{'DR' if res.dr is not None else 'SNIPS'} {est:.4f} vs logged {res.behaviour_value:.4f}, improvement "
        f"CI [{lo:+.4f}, {hi:+.4f}], ESS {res.ess:.1f} of {res.n}"
    )
    checks = []
    if res.ess < cfg.min_ess:
        checks.append(
            Check(
                "ope_reward",
                "fail" if cfg.require_ess else "skipped",
                value=res.ess,
                threshold=cfg.min_ess,
                detail=f"effective sample size too small to judge: {detail}",
            )
        )
    else:
        checks.append(
            Check(
                "ope_reward",
                "fail" if hi < -cfg.ope_margin else "pass",
                value=est,
                threshold=res.behaviour_value - cfg.ope_margin,
                detail=detail,
            )
        )
    tool = np.array([float(bool(r.get("tool_errors"))) for r in rolls], dtype=np.float64)
    summary["tool_error"] = (ope.snips(tool, log_w), float(tool.mean()))
    return checks, summary


def distinct_prompts(rollouts: Sequence[dict[str, Any]]) -> list[list[int]]:
    """The distinct prompts of `rollouts`, newest (last) first: a group's completions share one."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in reversed(rollouts):
        p = tuple(r.get("prompt_tokens") or ())
        if p and p not in seen:
            seen.add(p)
            out.append(list(p))
    return out


def run_gate(inp: GateInputs, cfg: GateConfig) -> GateResult:
    checks = weight_sanity(
        inp.candidate_state, inp.parent_state, cfg.max_global_rel_change, cfg.max_tensor_rel_change
    )
    if checks[0].status == "fail":  # a NaN checkpoint: nothing else is meaningful (or safe to run)
        return GateResult(checks)
    cand, champ = inp.candidate, inp.champion
    eos = getattr(getattr(cand, "tokenizer", None), "eos_id", None)
    rolls = [r for r in inp.rollouts if r.get("completion_tokens")]
    fit_on = list(inp.reward_rollouts) if inp.reward_rollouts is not None else rolls
    model = fit_reward_model(cand, fit_on, cfg) if cand is not None else None
    cand_samples = None
    if cand is not None and rolls:
        with torch.no_grad():
            smp = cand.generate(
                [list(r["prompt_tokens"]) for r in rolls],
                max_tokens=cfg.max_tokens,
                temperature=1.0,
                seed=cfg.seed,
            )
        cand_samples = [_strip_eos(s.tokens, eos) for s in smp]
    ope_checks, ope_summary = _ope_check(inp, cfg, cand_samples, model)
    checks += ope_checks
    tool = ope_summary.pop("tool_error", None)
    if model is not None:
        ope_summary["reward_model"] = {"n": model.n, "cv_r2": model.cv_r2}
    if cand is None or champ is None:
        why = "candidate policy not loaded" if cand is None else "no champion to compare with"
        checks += [
            Check(n, "skipped", detail=why)
            for n in (
                "reward_vs_champion",
                "kl_to_champion",
                "regression_prompts",
                "behaviour",
                "tool_call_validity_rate",
                "no_edit_rate",
            )
        ]
        return GateResult(checks, ope_summary)
    tok = cand.tokenizer
    prompts = [
        list(p)
        for p in (inp.prompts if inp.prompts is not None else [r["prompt_tokens"] for r in rolls])
    ][: cfg.sample_prompts]
    pairs = inp.regression_pairs if inp.regression_pairs is not None else load_regression_pairs()
    if not prompts:
        prompts = [tok.encode(p) for p, _ in pairs][: cfg.sample_prompts]
    k = cfg.samples_per_prompt
    batch = [p for p in prompts for _ in range(k)]
    with torch.no_grad():  # one seed for both: common random numbers (module docstring)
        c_smp = cand.generate(batch, max_tokens=cfg.max_tokens, temperature=1.0, seed=cfg.seed)
        h_smp = champ.generate(batch, max_tokens=cfg.max_tokens, temperature=1.0, seed=cfg.seed)
    checks.append(
        reward_check(
            model,
            [_decode(cand, s.tokens) for s in c_smp],
            [_decode(champ, s.tokens) for s in h_smp],
            k,
            cfg,
            len(fit_on),
        )
    )
    c_toks = [list(s.tokens) for s in c_smp]
    lengths = [len(t) for t in c_toks]
    if sum(lengths):
        checks.append(
            kl_check(
                _logprobs(cand, batch, c_toks), _logprobs(champ, batch, c_toks), lengths, cfg.max_kl
            )
        )
    else:
        checks.append(Check("kl_to_champion", "skipped", detail="the candidate produced no tokens"))
    r_prompts = [tok.encode(p) for p, _ in pairs]
    r_comps = [tok.encode(c) for _, c in pairs]
    checks.append(
        regression_check(
            _logprobs(cand, r_prompts, r_comps),
            _logprobs(champ, r_prompts, r_comps),
            [len(c) for c in r_comps],
            cfg.regression_tolerance,
        )
    )
    checks += behaviour_checks(
        [len(_strip_eos(s.tokens, eos)) for s in c_smp],
        [len(_strip_eos(s.tokens, eos)) for s in h_smp],
        max_empty_increase=cfg.max_empty_increase,
        length_k_std=cfg.length_k_std,
        tool_error=tuple(tool) if tool else None,
        max_tool_error_increase=cfg.max_tool_error_increase,
        tool_error_ess=ope_summary.get("ess"),
        min_ess=cfg.min_ess,
        require_ess=cfg.require_ess,
    )
    c_texts, h_texts = (
        [tok.decode(_strip_eos(s.tokens, eos)) for s in smp] for smp in (c_smp, h_smp)
    )
    b_texts = None
    if inp.base is not None:
        with torch.no_grad():
            b_smp = inp.base.generate(
                batch, max_tokens=cfg.max_tokens, temperature=1.0, seed=cfg.seed
            )
        b_texts = [tok.decode(_strip_eos(s.tokens, eos)) for s in b_smp]
    checks += edit_checks(
        c_texts,
        h_texts,
        max_invalid_increase=cfg.max_invalid_increase,
        max_no_edit_increase=cfg.max_no_edit_increase,
        alpha=cfg.monitor_alpha,
        base_texts=b_texts,
    )
    if cfg.agent_tasks:
        from app.sandbox.tasks import tasks

        # the gate's own suite: held-out repositories, drawn apart from the simulator's evaluation
        agent, figures = agent_checks(
            cand,
            champ,
            inp.base,
            tasks=tasks(cfg.agent_tasks, seed=cfg.seed + 20_011, held_out=True),
            samples=cfg.agent_samples_per_task,
            max_turns=cfg.agent_max_turns,
            max_tokens=cfg.agent_max_tokens,
            temperature=cfg.agent_temperature,
            seed=cfg.seed,
            max_success_drop=cfg.max_task_success_drop,
            max_rate_increase=cfg.max_agent_rate_increase,
            max_turns_increase=cfg.max_turns_increase,
            max_tokens_increase=cfg.max_tokens_increase,
            alpha=cfg.monitor_alpha,
            cache=inp.agent_verdicts,
            versions=inp.versions,
        )
        checks += agent
        ope_summary["agents"] = figures
    return GateResult(checks, ope_summary)
