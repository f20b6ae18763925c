"""What a report is made of, and the pure folds that turn it into the page's rows and series.

`ReportData` is everything read from the sources (app/report/sources.py): the registry's
versions and their tags, the trainer's per-step metrics, the held-out metrics per version
(acceptance, and the held-out agent figures of app/simulate/agent_eval.py),
the deployment events (docs/DESIGN.md §Deployment events, oldest first, `ts` an aware datetime)
and the sessions the versions served (the sessions projection of `<ns>.rollouts`). The functions
below read nothing else, so the page is a function of the data (tests/unit/report).

Conventions of the log that the folds rely on (app/controller/canary.py):
- a canary judgement travels in `details.analysis` (verdict, delta = candidate - champion mean
  reward, lower/upper = confidence-sequence bounds, margin) of `traffic_shifted`, `promoted`,
  `rolled_back` and `canary_paused`; it judges the step that was running *before* the event,
  at that step's traffic share;
- `rolled_back` names the restored version in `version` and the rolled-back one in
  `from_version` (default: the candidate, else the champion).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from app.contracts.deployment_state import STEP_RESTART

HELDOUT = "heldout_acceptance"
HELDOUT_CI = ("heldout_acceptance_ci_low", "heldout_acceptance_ci_high")
TRAINER_METRICS = ("reward_mean", "kl", "loss")
ANALYSIS_TYPES = frozenset(
    {"traffic_shifted", "promoted", "rolled_back", "canary_paused", "canary_resumed"}
)


@dataclass(frozen=True)
class VersionInfo:
    """One registered model version as the registry has it."""

    version: str
    tags: dict[str, str] = field(default_factory=dict)
    created: datetime | None = None


@dataclass(frozen=True)
class SessionInfo:
    """One session as the sessions projection has it (its live segments; relabelled copies aside)."""

    session_id: str
    turns: int  # model calls
    outcome: str | None  # success | failure | abandoned; None without an outcome yet
    versions: frozenset[str]  # the versions that served its turns


@dataclass
class ReportData:
    model: str  # registered model name
    generated_at: datetime
    versions: list[VersionInfo] = field(default_factory=list)  # registry, oldest first
    trainer: dict[str, list[tuple[int, float]]] = field(
        default_factory=dict
    )  # metric -> [(optimizer step, value)]
    heldout: dict[str, list[tuple[int, float]]] = field(
        default_factory=dict
    )  # metric -> [(version, value)]
    events: list[dict[str, Any]] = field(
        default_factory=list
    )  # deployment events of `model`, oldest first
    sources: dict[str, str] = field(
        default_factory=dict
    )  # what was read ("MLflow" -> uri, ...), shown in the footer
    sessions: list[SessionInfo] | None = None  # None: the sessions projection was not read


def vkey(version: str | None) -> int:
    return int(version) if version is not None and str(version).isdigit() else -1


# --- held-out acceptance and agent task success ---------------------------------------------------
@dataclass(frozen=True)
class HeldOut:
    acceptance: float
    ci_low: float | None = None
    ci_high: float | None = None


# app/simulate/agent_eval.py METRICS (run `heldout-task-success` of `flywheel-heldout`, step =
# version, and the version tags of the same names); named here: app.report does not import
# app.simulate. `heldout_agent_satisfaction` is not shown.
AGENT_FIELDS = {  # AgentHeldOut field -> metric / version tag
    "task_success": "heldout_task_success",
    "ci_low": "heldout_task_success_ci_low",
    "ci_high": "heldout_task_success_ci_high",
    "turns": "heldout_turns",
    "tokens": "heldout_tokens",
    "tool_error_rate": "heldout_tool_error_rate",
    "invalid_call_rate": "heldout_invalid_call_rate",
    "give_up_rate": "heldout_give_up_rate",
    "tests_edited_rate": "heldout_tests_edited_rate",
}
AGENT_METRICS = tuple(AGENT_FIELDS.values())


@dataclass(frozen=True)
class AgentHeldOut:
    """Held-out agent sessions of one version (app/simulate/agent_eval.py): task success with its
    95% interval, turns and completion tokens per session, tool errors and invalid calls per turn,
    shares of sessions that gave up and that edited the tests."""

    task_success: float
    ci_low: float | None = None
    ci_high: float | None = None
    turns: float | None = None
    tokens: float | None = None
    tool_error_rate: float | None = None
    invalid_call_rate: float | None = None
    give_up_rate: float | None = None
    tests_edited_rate: float | None = None


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def figures_by_version(data: ReportData, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per version, each of `names` it has: the `flywheel-heldout` metric at step = version (later
    points win), else the version's tag of the same name. Versions with none of them are absent."""
    series = {
        name: {str(step): value for step, value in data.heldout.get(name, [])} for name in names
    }
    tags = {vi.version: vi.tags for vi in data.versions}
    out: dict[str, dict[str, float]] = {}
    for v in sorted({*tags, *(v for s in series.values() for v in s)}, key=vkey):
        found = {}
        for name in names:
            value = series[name].get(v, _float(tags.get(v, {}).get(name)))
            if value is not None:
                found[name] = value
        if found:
            out[v] = found
    return out


def _interval(figures: dict[str, float], low: str, high: str) -> dict[str, float]:
    """Both bounds, or neither."""
    return {low: figures[low], high: figures[high]} if low in figures and high in figures else {}


def heldout_by_version(data: ReportData) -> dict[str, HeldOut]:
    """Held-out acceptance per version: the `flywheel-heldout` metric at step = version, else the
    version's tag; the confidence interval from the `_ci_low`/`_ci_high` metrics or tags when present."""
    out: dict[str, HeldOut] = {}
    for v, f in figures_by_version(data, (HELDOUT, *HELDOUT_CI)).items():
        if HELDOUT in f:
            ci = _interval(f, *HELDOUT_CI)
            out[v] = HeldOut(f[HELDOUT], ci.get(HELDOUT_CI[0]), ci.get(HELDOUT_CI[1]))
    return out


def agent_by_version(data: ReportData) -> dict[str, AgentHeldOut]:
    """Held-out agent figures per version, read as `heldout_by_version` reads acceptance: a version
    without `heldout_task_success` has none; the interval only when both bounds are there."""
    out: dict[str, AgentHeldOut] = {}
    for v, f in figures_by_version(data, AGENT_METRICS).items():
        if AGENT_FIELDS["task_success"] not in f:
            continue
        ci = _interval(f, AGENT_FIELDS["ci_low"], AGENT_FIELDS["ci_high"])
        out[v] = AgentHeldOut(
            **{
                attr: (ci if attr.startswith("ci_") else f).get(name)
                for attr, name in AGENT_FIELDS.items()
            }
        )
    return out


# --- gate -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateVerdict:
    passed: bool
    checks: list[
        dict[str, Any]
    ]  # [{"name", "status" pass|fail|skipped, "value", "threshold", "detail"}]
    reason: str = ""
    source: str = "event"  # event (gate_passed/gate_failed details) | tags (MLflow flywheel.gate.*)

    @property
    def failing(self) -> list[dict[str, Any]]:
        return [c for c in self.checks if c.get("status") == "fail"]


def _checks_from_tags(tags: dict[str, str]) -> list[dict[str, Any]]:
    """`flywheel.gate.<check>` = "pass 0.12" | "fail 0.73" | "skipped" -> check dicts (ope.* are
    estimates, agents.<candidate|champion|base>.<figure> the agent checks' figures: not checks)."""
    out = []
    for key, raw in sorted(tags.items()):
        name = key.removeprefix("flywheel.gate.")
        if (
            not key.startswith("flywheel.gate.")
            or name == "status"
            or name.startswith(("ope.", "agents."))
        ):
            continue
        status, _, value = raw.partition(" ")
        out.append(
            {
                "name": name,
                "status": status,
                "value": _float(value),
                "threshold": None,
                "detail": "",
            }
        )
    return out


def gate_by_version(data: ReportData) -> dict[str, GateVerdict]:
    """The last gate verdict per version from the log; the registry tags for versions the log lacks."""
    out: dict[str, GateVerdict] = {}
    for ev in data.events:
        if ev["type"] in ("gate_passed", "gate_failed") and ev.get("version"):
            checks = [c for c in (ev.get("details") or {}).get("checks", []) if isinstance(c, dict)]
            out[ev["version"]] = GateVerdict(
                ev["type"] == "gate_passed", checks, ev.get("reason") or ""
            )
    for vi in data.versions:
        status = vi.tags.get("flywheel.gate.status")
        if vi.version not in out and status in ("passed", "failed"):
            out[vi.version] = GateVerdict(
                status == "passed", _checks_from_tags(vi.tags), source="tags"
            )
    return out


def check_names(gates: dict[str, GateVerdict]) -> list[str]:
    """Every check name seen, in the order the gate runs them (first appearance)."""
    names: list[str] = []
    for v in sorted(gates, key=vkey):
        for c in gates[v].checks:
            if c.get("name") and c["name"] not in names:
                names.append(c["name"])
    return names


# --- canary steps ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CanaryStep:
    """One judged canary step: the analysis an event carried, placed at the step it judged."""

    version: str  # the candidate
    step: int  # index of the judged step (0 = first)
    traffic_pct: float | None  # the judged step's share of sessions
    outcome: str  # the event that carried it: traffic_shifted | promoted | rolled_back | canary_paused | ...
    verdict: str
    delta: float | None
    lower: float | None
    upper: float | None
    margin: float | None
    n_candidate: int
    n_champion: int
    ts: datetime


def canary_steps(events: list[dict[str, Any]]) -> list[CanaryStep]:
    steps: list[CanaryStep] = []
    current: dict[str, tuple[int, float | None]] = {}  # candidate -> (running step, its traffic)
    for ev in events:
        t, d = ev["type"], ev.get("details") or {}
        cand = ev.get("from_version") if t == "rolled_back" else ev.get("version")
        analysis = d.get("analysis")
        if t in ANALYSIS_TYPES and cand is not None and isinstance(analysis, dict):
            step, pct = current.get(cand, (int(d.get("step") or 0), ev.get("traffic_pct")))
            steps.append(
                CanaryStep(
                    version=cand,
                    step=step,
                    traffic_pct=pct,
                    outcome=t,
                    verdict=str(analysis.get("verdict", "")),
                    delta=_float(analysis.get("delta")),
                    lower=_float(analysis.get("lower")),
                    upper=_float(analysis.get("upper")),
                    margin=_float(analysis.get("margin")),
                    n_candidate=int((analysis.get("candidate") or {}).get("n") or 0),
                    n_champion=int((analysis.get("champion") or {}).get("n") or 0),
                    ts=ev["ts"],
                )
            )
        if t in ("canary_started", "traffic_shifted") and ev.get("version"):
            current[ev["version"]] = (int(d.get("step") or 0), ev.get("traffic_pct"))
    return steps


# --- the rollout as it happened -----------------------------------------------------------------
@dataclass(frozen=True)
class Mark:
    """One point on the timeline."""

    ts: datetime
    version: str
    kind: str  # registered | gate_passed | gate_failed | canary_started | traffic_shifted | canary_paused | promoted | rolled_back | aborted
    label: str


@dataclass
class Rollout:
    marks: list[Mark] = field(default_factory=list)
    champion_spans: list[tuple[datetime, datetime | None, str]] = field(
        default_factory=list
    )  # (from, to, version)
    canary: dict[str, str] = field(default_factory=dict)  # version -> outcome of its last canary
    served: list[str] = field(
        default_factory=list
    )  # versions that served as champion, in the order they started
    promoted: dict[str, datetime] = field(default_factory=dict)
    rolled_back: dict[str, datetime] = field(default_factory=dict)
    registered: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # version -> its version_registered event


def rollout(events: list[dict[str, Any]]) -> Rollout:
    """Fold the log into timeline marks, champion spans and per-version outcomes."""
    r = Rollout()
    champion: str | None = None
    candidate: str | None = None

    def crown(ts: datetime, version: str | None) -> None:
        nonlocal champion
        if version is None or version == champion:
            return
        if r.champion_spans:
            start, _, v = r.champion_spans[-1]
            r.champion_spans[-1] = (start, ts, v)
        r.champion_spans.append((ts, None, version))
        champion = version
        if version not in r.served:
            r.served.append(version)

    for ev in events:
        t, v, ts = ev["type"], ev.get("version"), ev["ts"]
        if t == "version_registered" and v:
            r.registered[v] = ev
            r.marks.append(Mark(ts, v, "registered", f"v{v} registered"))
        elif t in ("gate_passed", "gate_failed") and v:
            failing = [
                c.get("name")
                for c in (ev.get("details") or {}).get("checks", [])
                if isinstance(c, dict) and c.get("status") == "fail"
            ]
            r.marks.append(
                Mark(
                    ts,
                    v,
                    t,
                    f"v{v} gate {'passed' if t == 'gate_passed' else 'failed: ' + ', '.join(failing)}",
                )
            )
        elif t == "canary_started" and v:
            candidate = v
            r.canary[v] = "in canary"
            r.marks.append(Mark(ts, v, t, f"v{v} canary at {ev.get('traffic_pct') or 0:g}%"))
        elif t == "traffic_shifted" and v:
            r.marks.append(Mark(ts, v, t, f"v{v} to {ev.get('traffic_pct') or 0:g}%"))
        elif t in ("canary_paused", "canary_resumed") and v:
            r.canary[v] = "paused" if t == "canary_paused" else "in canary"
            details = ev.get("details") or {}
            what = (
                f"step {details.get('step', 0)} restarted with the controller"
                if details.get(STEP_RESTART)
                else t.removeprefix("canary_")
            )
            r.marks.append(Mark(ts, v, t, f"v{v} canary {what}"))
        elif t == "promoted" and v:
            if v in r.canary or candidate == v:
                r.canary[v] = "promoted"
            r.promoted[v] = ts
            r.marks.append(
                Mark(
                    ts,
                    v,
                    t,
                    f"v{v} promoted" + (f" over v{champion}" if champion and champion != v else ""),
                )
            )
            crown(ts, v)
            candidate = None if candidate == v else candidate
        elif t == "rolled_back":
            bad = ev.get("from_version") or candidate or champion
            if bad is not None and bad != v:
                r.rolled_back[bad] = ts
                if bad in r.canary:
                    r.canary[bad] = "rolled back"
                r.marks.append(Mark(ts, bad, t, f"v{bad} rolled back to v{v}"))
            crown(ts, v)
            candidate = None
        elif t == "aborted" and v:
            if v in r.canary:
                r.canary[v] = "aborted"
            r.marks.append(Mark(ts, v, t, f"v{v} canary aborted"))
            candidate = None if candidate == v else candidate
        elif t == "alias_changed" and v and (ev.get("details") or {}).get("alias") == "champion":
            crown(ts, v)
    return r


# --- sessions per version -------------------------------------------------------------------------
OUTCOMES = ("success", "failure", "abandoned")


@dataclass(frozen=True)
class SessionStats:
    """The sessions one version served (any of their turns): how long they ran and how they ended.
    A session two versions served counts for both."""

    sessions: int
    turns_mean: float  # turns per session, the session's every turn counted
    with_outcome: int  # sessions that reached an outcome
    shares: dict[str, float] | None  # outcome -> share of `with_outcome`; None when it is 0


def session_stats(sessions: list[SessionInfo]) -> dict[str, SessionStats]:
    """Per version, the stats of the sessions it served; a version that served none is absent."""
    served: dict[str, list[SessionInfo]] = {}
    for s in sessions:
        for v in s.versions:
            served.setdefault(v, []).append(s)
    out = {}
    for v, group in served.items():
        ended = [s.outcome for s in group if s.outcome is not None]
        out[v] = SessionStats(
            sessions=len(group),
            turns_mean=sum(s.turns for s in group) / len(group),
            with_outcome=len(ended),
            shares={o: ended.count(o) / len(ended) for o in OUTCOMES} if ended else None,
        )
    return out


# --- the per-version table ------------------------------------------------------------------------
@dataclass(frozen=True)
class VersionRow:
    version: str
    kind: str
    parent: str | None
    heldout: HeldOut | None
    gate: GateVerdict | None
    canary: str  # promoted | rolled back | aborted | paused | in canary | "" (none)
    promoted: bool
    rolled_back: bool
    served: bool  # served as champion at some point (promoted, or the champion alias recorded / moved to it)
    champion_now: bool
    reward_spec: str | None
    sessions: SessionStats | None = None  # None: it served no session (or sessions were not read)
    agent: AgentHeldOut | None = None  # None: no held-out agent figures (heldout_task_success)


def version_rows(data: ReportData) -> list[VersionRow]:
    """One row per version known to the registry or the log, oldest first."""
    held, gates, r = heldout_by_version(data), gate_by_version(data), rollout(data.events)
    agents = agent_by_version(data)
    served = session_stats(data.sessions or [])
    tags = {vi.version: vi.tags for vi in data.versions}
    champion_now = r.champion_spans[-1][2] if r.champion_spans else None
    rows = []
    for v in sorted({*tags, *r.registered, *gates, *held, *agents}, key=vkey):
        t, reg = tags.get(v, {}), r.registered.get(v, {})
        kind = (
            t.get("kind") or (reg.get("reason", "").split(" version", 1)[0] if reg else "") or "?"
        )
        if t.get("planted_bad") == "true":
            kind += " (planted bad)"
        parent = t.get("parent_version") or reg.get("from_version")
        spec = t.get("reward_spec") or (reg.get("details") or {}).get("reward_spec")
        rows.append(
            VersionRow(
                v,
                kind,
                None if parent in (None, "", "none") else str(parent),
                held.get(v),
                gates.get(v),
                r.canary.get(v, ""),
                v in r.promoted,
                v in r.rolled_back,
                v in r.served,
                v == champion_now,
                None if spec in (None, "", "none") else spec,
                served.get(v),
                agents.get(v),
            )
        )
    return rows


def ship_steps(data: ReportData) -> dict[str, int]:
    """Optimizer step at which each version shipped (version tag `trainer_step`), for the training plot."""
    out = {}
    for vi in data.versions:
        step = _float(vi.tags.get("trainer_step"))
        if step is not None:
            out[vi.version] = int(step)
    return out


def session_cells(stats: SessionStats | None) -> list[str]:
    """sessions, turns/session, outcomes, then each outcome's share: blanks (not zeros) for a
    version without sessions, and blank shares for sessions without an outcome yet."""
    if stats is None:
        return [""] * (3 + len(OUTCOMES))
    shares = ["" if stats.shares is None else f"{stats.shares[o]:.0%}" for o in OUTCOMES]
    return [str(stats.sessions), f"{stats.turns_mean:.1f}", str(stats.with_outcome), *shares]


SESSION_HEADS = ("sessions", "turns/session", "outcomes", *OUTCOMES)


AGENT_HEADS = (
    "task success",
    "95% CI",
    "turns",
    "tokens",
    "tool errors/turn",
    "give-ups",
    "tests edited",
)


def _fmt(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _ci(low: float | None, high: float | None) -> str:
    return f"[{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""


def agent_cells(a: AgentHeldOut | None) -> list[str]:
    """task success, its 95% interval, turns and tokens per session, tool errors per turn, shares
    of sessions that gave up and that edited the tests: blanks for what a version lacks."""
    if a is None:
        return [""] * len(AGENT_HEADS)
    return [
        f"{a.task_success:.3f}",
        _ci(a.ci_low, a.ci_high),
        _fmt(a.turns, ".1f"),
        _fmt(a.tokens, ".0f"),
        _fmt(a.tool_error_rate, ".3f"),
        _fmt(a.give_up_rate, ".1%"),
        _fmt(a.tests_edited_rate, ".1%"),
    ]


def shows_acceptance(rows: list[VersionRow]) -> bool:
    """Whether the report shows held-out acceptance: some version has it, or no version has agent
    figures either (a completion loop not yet evaluated). An agent loop's report (`flywheel run
    --agents`: task success, no acceptance) leaves it out."""
    return any(r.heldout is not None for r in rows) or not any(r.agent is not None for r in rows)


def markdown_table(rows: list[VersionRow]) -> str:
    """The per-version table as Markdown (`flywheel report --markdown`): what a note or README quotes.
    The held-out agent columns (after acceptance's) only when some version has agent figures; the
    acceptance columns unless only agent figures are there (`shows_acceptance`)."""
    agents = any(r.agent is not None for r in rows)
    acceptance = shows_acceptance(rows)
    heads = (
        "version",
        "kind",
        *(("held-out acceptance", "95% CI") if acceptance else ()),
        *(AGENT_HEADS if agents else ()),
        "gate",
        "failing checks",
        "canary",
        *SESSION_HEADS,
    )
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        h = r.heldout
        acc = f"{h.acceptance:.3f}" if h else ""
        ci = _ci(h.ci_low, h.ci_high) if h else ""
        gate = "" if r.gate is None else ("passed" if r.gate.passed else "failed")
        failing = ", ".join(
            f"{c['name']} {c['value']:.3g}"
            if isinstance(c.get("value"), (int, float))
            else c["name"]
            for c in (r.gate.failing if r.gate else [])
        )
        canary = r.canary or ("champion" if r.served else "")
        cells = [
            r.version,
            r.kind,
            *((acc, ci) if acceptance else ()),
            *(agent_cells(r.agent) if agents else []),
            gate,
            failing,
            canary,
            *session_cells(r.sessions),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
