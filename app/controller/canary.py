"""Canary analysis and the rollout state machine, as plain functions.

    state', events = transition(state, input, config)

`input` is an `Observe` (candidate and champion online metrics of the current step's
window, at time `now`), an `Event` (a deployment event seen on `flywheel.deployments`,
e.g. a gate result, an operator verb, an MLflow-UI alias move) or a `Tick` (time passed).
`events` are new deployment events (dicts, docs/DESIGN.md §Deployment events) already folded into `state'`;
the controller publishes them. Nothing here touches Kafka, MLflow or a clock. The canary's
plan and thresholds (`CanaryConfig`) and the operator verbs, which the API serves, live in
app/registry/operator.py.

The comparison (why a confidence *sequence*): the controller looks at the data every time a
metrics bucket arrives, for as long as a step lasts. A fixed-horizon test (e.g. Welch's
one-sided bound) checked on every look has a false-decision rate far above its nominal
alpha. We use the asymptotic confidence sequence of Waudby-Smith et al. (2021, "Time-uniform
central limit theory and asymptotic confidence sequences", normal-mixture boundary), which
is valid under continuous monitoring, on the augmented inverse-propensity (AIPW) difference
psi_i = (R_i - m_c) A_i / p - (R_i - m_h) (1 - A_i) / (1 - p) + m_c - m_h, with each arm's mean
m as its regression (the paper's randomized-experiment case). Its mean is
mu_candidate - mu_champion, and its variance var_c / p + var_h / (1 - p) has each arm's reward
*centered*: the plain inverse-propensity difference R A / p - R (1 - A) / (1 - p) carries each
arm's squared mean as well (E[R^2] / p), which for rewards in [0, 1] around 0.5 doubles the
variance or more and so the samples a step needs. Both follow exactly from per-arm sums
(n, sum, sum of squares), which is what `flywheel.version-metrics` carries per bucket. With a non-inferiority margin delta:
upper bound < -delta -> candidate worse -> automatic rollback; lower bound > -delta ->
better or equal -> next step (promotion after the last step below 100%); otherwise
inconclusive, and inconclusive past the step deadline -> pause for an operator.

Guardrails on what users do, not on the reward. A reward spec can be gamed (docs/ROLLOUT.md
"Reward hacks"): a version can raise the labelled reward while users are served worse. So
the same confidence sequence also compares, per shown completion, the acceptance rate
(accepts / n), the kept-edit rate (accepted x persistence: persistence_sum / n) and the
follow-up sentiment (followup_sum / n, 0 without a follow-up) and the tool-call success rate
(completions without a tool error: 1 - tool_error_rollouts / n), from the same version-metrics
sums. Their second moments are bounded, not summed (the records carry no sum of squares):
x^2 <= x for values in [0, 1] and x^2 <= 1 for a sentiment in [-1, 1], which only widens the
sequence, so its coverage holds. A candidate whose upper bound on a guardrail lies below
-guardrail_margin is rolled back, whatever its reward; the reason and the event details name
the guardrail.

Guardrails on agent sessions. The session stage counts each agent session that ended with an
outcome once, in the version that served its last turn (`sessions_n`, `session_success`,
`session_give_up`, ... in the version-metrics sums; docs/STREAMS.md "Version metrics"). Two
guardrails judge them, per **session**, not per completion: `task_success_rate` (the value is 1
for a session that ended in success, else 0) and `give_up_rate` (lower is better, so the judged
value is 1 - gave up: 1 unless the session was abandoned, and "worse" means more give-ups, as for
every guardrail; delta and bounds are on that value, while the analysis reports each arm's
give-up rate itself, `lower_is_better`). Each has its own sample count, sessions_n, and the
confidence sequence runs on it: t = the sessions of both arms, p = the candidate's share of the
sessions, each arm's mean over its sessions. That is the statistically right count, unlike
`followup_sentiment`, which keeps n: its value is defined for every shown completion (0 without a
follow-up), and `followup_n` only bounds its second moment. Using n for a per-session value would
pretend to one sample per turn while only sessions are independent draws (a session's turns
share its outcome), and so narrow the sequence far below its level. The values are 0/1, so x^2 = x
is the sum of squares (exact). A session guardrail is judged only when each arm has at least
`min_sessions` sessions in the window: with fewer (none at all, as for versions that serve no
agents) it is skipped, recorded in `Analysis.guardrails_skipped` with the reason, and is neither a
pass nor a fail (the reward and the other guardrails decide). Turns per session is not a
guardrail: it is no [0, 1] quantity, the records carry no sum of squares of it to bound its
variance with, and more turns is not worse in itself; its sums (`session_turns_sum`,
`session_tokens_sum`, `session_tool_error_turns`) are carried in `ArmStats` and the
version-metrics records for dashboards and the projections only.

The rating guardrail. Users rate now and then (-1 or +1; an agent user rates the session, on its
last turn, from their own check of the work, whatever outcome a harness reported: docs/AGENTS.md
"Agent users"), so `rating` judges the mean rating per *rated* completion, on its own count
(`rating_n`, x^2 = 1 exactly: rating_n is the sum of squares). Which completions get rated depends
on the version (a failing one draws more -1s), and the comparison is of that mean, between arms
that serve the same users at random. It is the canary's one signal of what a user thinks of an
agent session besides the reported outcome: a version that passes a harness's tests by weakening
them is reported `success` and rated -1. Like the session guardrails it is judged only when each
arm has at least `min_ratings` ratings in the window, and is skipped otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from app.contracts.deployment_state import STEP_RESTART
from app.contracts.deployments import Decision
from app.controller.state import DeploymentState, apply_event, vkey
from app.registry.operator import CanaryConfig, advance

Verdict = Literal["worse", "better_or_equal", "inconclusive", "insufficient"]


# --- analysis ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArmStats:
    """Sufficient statistics of one version over a window: labelled reward and user outcomes
    (app/contracts/rollouts.py SUM_FIELDS of the same names)."""

    n: int = 0
    reward_sum: float = 0.0
    reward_sumsq: float = 0.0
    accepts: float = 0.0
    persistence_sum: float = 0.0  # persistence of accepted completions (0 for the others)
    followup_n: float = 0.0
    followup_sum: float = 0.0
    tool_error_rollouts: float = 0.0  # completions with at least one tool error
    # agent sessions that ended with an outcome, counted in the version that served their last turn
    sessions_n: int = 0
    session_success: float = 0.0  # ... that ended in success
    session_give_up: float = 0.0  # ... that were abandoned
    session_turns_sum: float = 0.0  # their turns
    session_tokens_sum: float = 0.0  # the completion tokens their turns sampled
    session_tool_error_turns: float = 0.0  # their turns with a tool error
    # completions a user rated (-1 or +1: an agent session's rating lands on its last turn)
    rating_n: float = 0.0
    rating_sum: float = 0.0

    @classmethod
    def from_sums(cls, sums: Mapping[str, Any]) -> ArmStats:
        """A version-metrics record's sums (its fields share their names; a sum it lacks is 0)."""
        return cls(*(type(f.default)(sums.get(f.name, 0)) for f in fields(cls)))

    def __add__(self, other: ArmStats) -> ArmStats:
        return ArmStats(*(getattr(self, k) + getattr(other, k) for k in _ARM_FIELDS))

    @property
    def mean(self) -> float:
        return self.reward_sum / self.n if self.n else float("nan")

    def guardrail_sums(self) -> dict[str, tuple[int, float, float]]:
        """guardrail -> (samples, sum, upper bound of the sum of squares) of its per-sample value:
        per shown completion (n samples) or per ended session (sessions_n samples)."""
        n, sessions = self.n, self.sessions_n
        kept = sessions - self.session_give_up
        return {
            "acceptance_rate": (n, self.accepts, self.accepts),  # 0/1: x^2 = x
            "kept_edit_rate": (n, self.persistence_sum, self.persistence_sum),  # [0, 1]: x^2 <= x
            "followup_sentiment": (
                n,
                self.followup_sum,
                self.followup_n,
            ),  # [-1, 1], 0 without one: x^2 <= 1
            "tool_call_success_rate": (n, *(n - self.tool_error_rollouts,) * 2),  # 0/1
            "task_success_rate": (sessions, self.session_success, self.session_success),  # 0/1
            "give_up_rate": (sessions, kept, kept),  # judged on 1 - gave up (0/1)
            "rating": (int(self.rating_n), self.rating_sum, self.rating_n),  # -1/+1: x^2 = 1
        }


_ARM_FIELDS = tuple(f.name for f in fields(ArmStats))

GUARDRAILS = (
    "acceptance_rate",
    "kept_edit_rate",
    "followup_sentiment",
    "tool_call_success_rate",
    "task_success_rate",
    "give_up_rate",
    "rating",
)
SESSION_GUARDRAILS = frozenset(("task_success_rate", "give_up_rate"))  # per session: sessions_n
SPARSE_GUARDRAILS = frozenset(("rating",))  # per rated completion: rating_n, from min_ratings
LOWER_IS_BETTER = frozenset(("give_up_rate",))  # judged on 1 - the rate


def cs_radius(sigma: float, t: int, alpha: float, target_n: int) -> float:
    """Half-width of the asymptotic (normal-mixture) confidence sequence for a mean after t samples.

    sigma * sqrt(2 (t rho^2 + 1) / (t^2 rho^2) * log(sqrt(t rho^2 + 1) / alpha)), with rho^2
    chosen to minimise the width at t = target_n (Waudby-Smith et al. 2021, eq. for the
    Robbins normal mixture). Valid uniformly over t with probability >= 1 - alpha.
    """
    assert t > 0 and sigma >= 0 and 0 < alpha < 1, f"t={t} sigma={sigma} alpha={alpha}"
    la = -2.0 * math.log(alpha)
    rho2 = (la + math.log(la + 1.0)) / target_n
    return sigma * math.sqrt(
        2.0 * (t * rho2 + 1.0) / (t * t * rho2) * math.log(math.sqrt(t * rho2 + 1.0) / alpha)
    )


class Analysis(BaseModel):
    """One comparison; `candidate`/`champion` become the versions' online metrics in the projections."""

    verdict: Verdict
    delta: float | None = None  # mean reward candidate - champion
    lower: float | None = None  # confidence-sequence bounds on delta
    upper: float | None = None
    candidate: dict[str, Any] = Field(default_factory=dict)  # {"n", "reward_mean"}
    champion: dict[str, Any] = Field(default_factory=dict)
    method: str = "asymptotic-cs-aipw"
    alpha: float | None = None
    margin: float | None = None
    # guardrail -> {"verdict", "delta", "lower", "upper", "candidate", "champion", "margin"}
    # (a session guardrail also "samples" {"candidate", "champion"} and "lower_is_better")
    guardrails: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # session guardrail -> why it was not judged (too few sessions in an arm): no verdict
    guardrails_skipped: dict[str, str] = Field(default_factory=dict)

    def worst_guardrail(self) -> str | None:
        """The first guardrail on which the candidate is confidently worse, or None."""
        return next(
            (g for g in GUARDRAILS if self.guardrails.get(g, {}).get("verdict") == "worse"), None
        )

    @property
    def n_candidate(self) -> int:
        return int(self.candidate.get("n", 0))

    @property
    def n_champion(self) -> int:
        return int(self.champion.get("n", 0))


def analyze(cand: ArmStats, champ: ArmStats, cfg: CanaryConfig) -> Analysis:
    """Compare candidate and champion rewards with the time-uniform confidence sequence."""
    base = {
        "candidate": {"n": cand.n, "reward_mean": cand.mean if cand.n else None},
        "champion": {"n": champ.n, "reward_mean": champ.mean if champ.n else None},
        "alpha": cfg.alpha,
        "margin": cfg.margin,
    }
    if cand.n < cfg.min_samples or champ.n < cfg.min_samples:
        return Analysis(verdict="insufficient", **base)
    delta, lo, hi = _aipw_bounds(
        cand.n,
        cand.reward_sum,
        cand.reward_sumsq,
        champ.n,
        champ.reward_sum,
        champ.reward_sumsq,
        cfg,
    )
    guardrails, skipped = _guardrails(cand, champ, cfg) if cfg.guardrails else ({}, {})
    return Analysis(
        verdict=_verdict(lo, hi, cfg.margin),
        delta=delta,
        lower=lo,
        upper=hi,
        guardrails=guardrails,
        guardrails_skipped=skipped,
        **base,
    )


def _guardrails(
    cand: ArmStats, champ: ArmStats, cfg: CanaryConfig
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every guardrail's comparison, each on its own samples (module docstring), and the session
    guardrails skipped for want of sessions."""
    judged: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    c_sums, h_sums = cand.guardrail_sums(), champ.guardrail_sums()
    for g in GUARDRAILS:
        (cn, cs, cq), (hn, hs, hq) = c_sums[g], h_sums[g]
        floor = _own_count(g, cfg)
        if floor is not None and min(cn, hn) < floor[0]:
            skipped[g] = (
                f"{cn} candidate and {hn} champion {floor[1]} in the window; judged from "
                f"{floor[0]} per arm"
            )
            continue
        d, gl, gh = _aipw_bounds(cn, cs, cq, hn, hs, hq, cfg)
        entry = {
            "verdict": _verdict(gl, gh, cfg.guardrail_margin),
            "delta": d,
            "lower": gl,
            "upper": gh,
            "candidate": cs / cn,
            "champion": hs / hn,
            "margin": cfg.guardrail_margin,
        }
        if floor is not None:
            entry["samples"] = {"candidate": cn, "champion": hn}
        if g in LOWER_IS_BETTER:  # the arms' own rates; delta and bounds stay on 1 - rate
            entry.update(candidate=1.0 - cs / cn, champion=1.0 - hs / hn, lower_is_better=True)
        judged[g] = entry
    return judged, skipped


def _own_count(g: str, cfg: CanaryConfig) -> tuple[int, str] | None:
    """A guardrail judged on its own count, not on the completions: the fewest per arm it is
    judged from, and what it counts; None for the per-completion ones."""
    if g in SESSION_GUARDRAILS:
        return cfg.min_sessions, "sessions"
    if g in SPARSE_GUARDRAILS:
        return cfg.min_ratings, "ratings"
    return None


def _verdict(lo: float, hi: float, margin: float) -> Verdict:
    return "worse" if hi < -margin else "better_or_equal" if lo > -margin else "inconclusive"


def _aipw_bounds(
    n_c: int, sum_c: float, sq_c: float, n_h: int, sum_h: float, sq_h: float, cfg: CanaryConfig
) -> tuple[float, float, float]:
    """(delta, lower, upper): mean_c - mean_h and its confidence-sequence bounds from per-arm sums
    (`sq_*` the sum of squares, or an upper bound of it: the sequence only widens).

    sigma^2 = var_c / p + var_h / (1 - p), the variance of the AIPW score per sample (p the
    candidate's share of the window's samples)."""
    n = n_c + n_h
    p = n_c / n
    mean_c, mean_h = sum_c / n_c, sum_h / n_h
    var_c = max(sq_c / n_c - mean_c**2, 0.0)
    var_h = max(sq_h / n_h - mean_h**2, 0.0)
    sigma = math.sqrt(var_c / p + var_h / (1 - p))
    r = cs_radius(sigma, n, cfg.alpha, cfg.cs_target_n)
    return mean_c - mean_h, mean_c - mean_h - r, mean_c - mean_h + r


# --- inputs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observe:
    now: datetime
    candidate: ArmStats  # candidate's labelled rewards since the step started
    champion: ArmStats  # champion's labelled rewards over the same window


@dataclass(frozen=True)
class Event:
    event: dict[str, Any]  # a deployment event from the log (any source)


@dataclass(frozen=True)
class Tick:
    now: datetime


@dataclass(frozen=True)
class Restart:
    """The controller has replayed the log after a start, at `now` (before its first tick)."""

    now: datetime


Input = Observe | Event | Tick | Restart


def _emit(
    state: DeploymentState, decisions: list[Decision], now: datetime
) -> tuple[DeploymentState, list[dict]]:
    events = []
    for d in decisions:
        ev = d.to_event(state.model, now)
        state = apply_event(state, ev)
        events.append(ev)
    return state, events


def transition(
    state: DeploymentState, inp: Input, cfg: CanaryConfig
) -> tuple[DeploymentState, list[dict[str, Any]]]:
    """One step of the rollout state machine. Pure: same inputs, same outputs (up to event ids)."""
    if isinstance(inp, Event):
        state = apply_event(state, inp.event)
        now = _now_of(inp.event)
        return _emit(state, reconcile(state, cfg), now)
    if isinstance(inp, Tick):
        decisions = reconcile(state, cfg) + _deadline(state, None, inp.now, cfg)
        return _emit(state, decisions, inp.now)
    if isinstance(inp, Restart):
        return _emit(state, restart_step(state, inp.now), inp.now)
    assert isinstance(inp, Observe), f"unknown input {inp!r}"
    decisions = reconcile(state, cfg)
    if decisions:
        return _emit(state, decisions, inp.now)
    return _emit(state, judge(state, inp, cfg), inp.now)


def _now_of(ev: dict[str, Any]) -> datetime:
    from app.controller.state import parse_ts

    return parse_ts(ev["ts"])


def _step_age(state: DeploymentState, now: datetime) -> float:
    assert state.step_started_at is not None, f"canary of {state.candidate} has no step start"
    return (now - state.step_started_at).total_seconds()


def restart_step(state: DeploymentState, now: datetime) -> list[Decision]:
    """A canary step found running when the controller starts starts again, window and deadline.

    Between the last controller's stop and this start nobody judged the step, and when the whole
    loop was stopped (`flywheel run` ended by `--duration`, a host restart) no replica served
    it either: counted from its old start, the step would be paused as inconclusive at the first
    tick for the minutes nobody ran it. Its window restarts with it, so the evidence it is judged
    on is evidence this controller watched arrive (the confidence sequence is valid from any
    start). A paused canary stays paused (an operator's to resume)."""
    if state.phase != "canary" or state.candidate is None or state.step_started_at is None:
        return []
    age = _step_age(state, now)
    return [
        Decision(
            type="canary_resumed",
            version=state.candidate,
            traffic_pct=state.traffic_pct,
            reason=f"the controller started with step {state.step} ({state.traffic_pct:g}%) "
            f"begun {age:.0f}s ago and unjudged since its last stop: the step starts again "
            "(its window and deadline)",
            details={
                "step": state.step,
                STEP_RESTART: True,
                "step_started_at": state.step_started_at.isoformat(),
            },
        )
    ]


def judge(state: DeploymentState, obs: Observe, cfg: CanaryConfig) -> list[Decision]:
    """Decide on the current canary step from the window's metrics."""
    if state.phase != "canary" or state.candidate is None:
        return []
    a = analyze(obs.candidate, obs.champion, cfg)
    details = {"analysis": a.model_dump(), "step": state.step}
    if _step_age(state, obs.now) < cfg.min_step or a.verdict == "insufficient":
        return _deadline(state, a, obs.now, cfg)
    stats = f"delta {a.delta:+.4f}, CS [{a.lower:+.4f}, {a.upper:+.4f}], n {a.n_candidate}/{a.n_champion}"
    guard = a.worst_guardrail()
    if guard is not None:
        g = a.guardrails[guard]
        return [
            Decision(
                type="rolled_back",
                version=state.champion,
                from_version=state.candidate,
                traffic_pct=0.0,
                reason=f"canary step {state.step} ({state.traffic_pct:g}%): guardrail {guard}: candidate "
                f"{g['candidate']:.4f} vs champion {g['champion']:.4f}"
                f"{' (lower is better)' if g.get('lower_is_better') else ''}, worse by more than "
                f"{cfg.guardrail_margin:g} (delta {g['delta']:+.4f}, CS [{g['lower']:+.4f}, "
                f"{g['upper']:+.4f}]) whatever its reward ({stats})",
                details={**details, "guardrail": guard},
            )
        ]
    if a.verdict == "worse":
        return [
            Decision(
                type="rolled_back",
                version=state.champion,
                from_version=state.candidate,
                traffic_pct=0.0,
                reason=f"canary step {state.step} ({state.traffic_pct:g}%): candidate worse than champion by "
                f"more than {cfg.margin:g} ({stats})",
                details=details,
            )
        ]
    if a.verdict == "better_or_equal":
        return [
            advance(
                state,
                cfg,
                f"canary step {state.step} ({state.traffic_pct:g}%) passed ({stats})",
                details,
            )
        ]
    return _deadline(state, a, obs.now, cfg)


def _deadline(
    state: DeploymentState, a: Analysis | None, now: datetime, cfg: CanaryConfig
) -> list[Decision]:
    if (
        state.phase != "canary"
        or state.candidate is None
        or _step_age(state, now) < cfg.step_deadline
    ):
        return []
    details: dict[str, Any] = {"step": state.step}
    if a is not None:
        details["analysis"] = a.model_dump()
    return [
        Decision(
            type="canary_paused",
            version=state.candidate,
            traffic_pct=state.traffic_pct,
            details=details,
            reason=f"step {state.step} ({state.traffic_pct:g}%) still inconclusive after "
            f"{cfg.step_deadline:g}s; waiting for an operator (promote, abort, resume)",
        )
    ]


def reconcile(state: DeploymentState, cfg: CanaryConfig) -> list[Decision]:
    """Level-triggered reactions: answer MLflow-UI alias moves, start canaries for gated versions."""
    if state.ui_champion is not None:
        return [_answer_champion_move(state)]
    if state.ui_candidate is not None:
        return _answer_candidate_move(state, cfg)
    passed = [
        v
        for v, ok in state.gate.items()
        if ok
        and v not in state.canaried
        and v not in state.failed
        and vkey(v) > vkey(state.champion)
    ]
    if not passed:
        return []
    newest = max(passed, key=vkey)
    if state.champion is None:
        return [
            Decision(
                type="promoted",
                version=newest,
                traffic_pct=100.0,
                reason=f"version {newest} passed the gate and there is no champion yet",
            )
        ]
    out = []
    if state.candidate is not None:
        if vkey(state.candidate) >= vkey(newest):
            return []
        if state.phase != "paused":
            # a running canary finishes first (promoted or rolled back); the newest passed version
            # starts after it. Superseding running canaries livelocks when versions ship faster than
            # a canary takes: every canary is aborted, nothing is ever promoted (seen in the demo)
            return []
        out.append(
            Decision(
                type="aborted",
                version=state.candidate,
                from_version=state.candidate,
                traffic_pct=0.0,
                reason=f"superseded by version {newest}, which passed the gate while this canary "
                f"was paused",
            )
        )
    out.append(
        Decision(
            type="canary_started",
            version=newest,
            from_version=state.champion,
            traffic_pct=cfg.steps[0],
            reason=f"version {newest} passed the gate",
            details={"step": 0},
        )
    )
    return out


def _answer_champion_move(state: DeploymentState) -> Decision:
    slot = state.ui_champion
    assert slot is not None
    answer = {"in_response_to": slot["event_id"]}
    if slot["to"] is None:  # the champion alias was removed: sessions must keep a model to serve
        return Decision(
            type="alias_changed",
            version=state.champion,
            from_version=None,
            details={**answer, "alias": "champion"},
            reason="the champion alias cannot be removed; restored to the serving champion",
        )
    if slot["to"] == state.candidate:
        return Decision(
            type="promoted",
            version=state.candidate,
            traffic_pct=100.0,
            source="mlflow-ui",
            actor="mlflow-ui",
            details=answer,
            reason="champion moved to the candidate in MLflow: canary ends, candidate promoted",
        )
    return Decision(
        type="aborted",
        version=state.candidate,
        from_version=state.candidate,
        traffic_pct=0.0,
        source="mlflow-ui",
        actor="mlflow-ui",
        details=answer,
        reason=f"champion moved to version {slot['to']} in MLflow during the canary of {state.candidate}",
    )


def _answer_candidate_move(state: DeploymentState, cfg: CanaryConfig) -> list[Decision]:
    slot = state.ui_candidate
    assert slot is not None
    answer = {"in_response_to": slot["event_id"]}
    to = slot["to"]
    who = {"source": "mlflow-ui", "actor": "mlflow-ui"}
    if to is None:
        return [
            Decision(
                type="aborted",
                version=state.candidate,
                from_version=state.candidate,
                traffic_pct=0.0,
                details=answer,
                reason="candidate alias removed in MLflow",
                **who,
            )
        ]
    if to == state.champion:
        return [
            Decision(
                type="alias_changed",
                version=state.candidate,
                from_version=to,
                details={**answer, "alias": "candidate"},
                reason=f"version {to} is the champion and cannot also be the candidate; alias restored",
            )
        ]
    out = []
    if state.candidate is not None:
        out.append(
            Decision(
                type="aborted",
                version=state.candidate,
                from_version=state.candidate,
                traffic_pct=0.0,
                reason=f"candidate alias moved to version {to} in MLflow",
                **who,
            )
        )
    gate = state.gate.get(to)
    note = (
        "" if gate else (" (gate failed; operator override)" if gate is False else " (not gated)")
    )
    out.append(
        Decision(
            type="canary_started",
            version=to,
            from_version=state.champion,
            traffic_pct=cfg.steps[0],
            details={**answer, "step": 0},
            reason=f"candidate alias moved to version {to} in MLflow{note}",
            **who,
        )
    )
    return out
