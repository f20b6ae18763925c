"""The one fold of the deployment log: `fold(state, event) -> state` over typed deployment events.

Every reader of `<ns>.deployments` derives its view of a model's rollout from this module: the
controller (its state machine decides on it), the replicas (they serve its champion and
candidate), the admin API (operator verbs act on it) and the SQL projector (it stores what the
fold returns; app/projector/projector.py maps the state to rows and back). So the status API
and the serving fleet cannot disagree about champion, candidate, phase or a version's status.

    from app.contracts.deployment_state import DeploymentState, fold, replay

    state = replay("flywheel-policy", (logged.event for logged in log.read()))
    state = fold(state, next_event)      # pure: `state` itself is never changed

`fold` ignores events about other models and never raises for a valid `DeploymentEvent`.
`replay` counts an `event_id` once (at-least-once delivery); `fold` does not (the projector
dedupes on the SQL copy of the log, the controller and replicas on the ids they saw).

The rules (docs/DEPLOYMENTS.md, "What each event does", has the table and why):

- The champion changes only with the events that move the champion alias: `promoted`,
  `rolled_back` and `alias_changed` (champion alias set). `canary_started` records its
  `from_version` on the event only.
- `rolled_back` marks `from_version` bad, else the running candidate, else the old champion
  (never the version rolled back to); `version` becomes champion and any canary ends.
- `promoted` and `aborted` end any running canary.
- `phase` is idle | canary | paused; `status_phase` adds `promoting` (a canary at 100 % of the
  traffic, waiting for its promotion), which is what the status API shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.contracts.deployments import DeploymentEvent

Phase = Literal["idle", "canary", "paused"]
StatusPhase = Literal["idle", "canary", "paused", "promoting"]
VersionStatus = Literal[
    "registered",
    "gate_passed",
    "gate_failed",
    "canary",
    "champion",
    "retired",
    "rolled_back",
    "aborted",
]
# `details` key of a canary_resumed the controller publishes when it starts with a step running
# (app/controller/canary.py restart_step): the step starts again, window and deadline
STEP_RESTART = "step_restart"
# `details` keys of version_registered that have their own field (the rest is lineage)
_REGISTRATION_FIELDS = ("run_id", "rollouts_consumed", "reward_spec")
# events whose `details.analysis` becomes the last analysis and the versions' online metrics
_ANALYSIS_TYPES = frozenset(
    {
        "canary_started",
        "traffic_shifted",
        "canary_paused",
        "canary_resumed",
        "promoted",
        "rolled_back",
    }
)


class VersionState(BaseModel):
    """What the log says about one model version (a `model_versions` row)."""

    model_config = ConfigDict(frozen=True)

    version: str
    status: VersionStatus = "registered"
    parent_version: str | None = None
    run_id: str | None = None
    rollouts_consumed: int | None = None
    reward_spec: str | None = None
    lineage: dict[str, Any] = Field(default_factory=dict)
    gate: dict[str, Any] = Field(default_factory=dict)  # the gate verdict's details
    online: dict[str, Any] = Field(default_factory=dict)  # latest canary analysis of this version
    created_at: datetime
    updated_at: datetime


class ReplicaState(BaseModel):
    """What one replica last reported (a `replicas` row)."""

    model_config = ConfigDict(frozen=True)

    replica_id: str
    model: str | None = None
    url: str | None = None
    champion_version: str | None = None
    candidate_version: str | None = None
    traffic_pct: float | None = None
    status: str = "starting"
    details: dict[str, Any] = Field(default_factory=dict)
    last_heartbeat: datetime | None = None


class DeploymentState(BaseModel):
    """One registered model's rollout as the log describes it."""

    model: str
    champion: str | None = None
    candidate: str | None = None
    phase: Phase = "idle"
    step: int = -1  # index into the canary steps; -1 when idle
    traffic_pct: float = 0.0  # candidate's share of sessions
    step_started_at: datetime | None = None
    known_good: list[str] = Field(
        default_factory=list
    )  # versions that served as champion, oldest first
    failed: list[str] = Field(default_factory=list)  # gate failures and rolled-back versions
    registered: list[str] = Field(default_factory=list)
    gate: dict[str, bool] = Field(default_factory=dict)  # version -> gate passed
    canaried: list[str] = Field(default_factory=list)  # versions that already had their canary
    # MLflow-UI alias moves that still need a controller answer: {"event_id", "to"} per alias
    ui_champion: dict[str, Any] | None = None
    ui_candidate: dict[str, Any] | None = None
    last_analysis: dict[str, Any] = Field(default_factory=dict)
    last_event_id: str | None = None
    updated_at: datetime | None = None  # ts of the last event applied
    last_registered_version: str | None = None
    last_registered_at: datetime | None = None
    versions: dict[str, VersionState] = Field(default_factory=dict)
    replicas: dict[str, ReplicaState] = Field(default_factory=dict)

    @property
    def status_phase(self) -> StatusPhase:
        """The phase the status API shows: a canary at 100 % of the traffic is `promoting`."""
        if self.phase == "canary" and self.traffic_pct >= 100.0:
            return "promoting"
        return self.phase

    @property
    def step_index(self) -> int | None:
        """The canary step, None when no canary runs."""
        return None if self.phase == "idle" else self.step

    def rollback_targets(self, n: int) -> list[str]:
        """The last `n` known-good versions other than the current champion, newest first."""
        out = [v for v in reversed(self.known_good) if v != self.champion and v not in self.failed]
        return out[:n]


# --- helpers (pure) -----------------------------------------------------------------------------
def _add(lst: list[str], v: str | None) -> list[str]:
    return lst if v is None or v in lst else [*lst, v]


def _to_end(lst: list[str], v: str | None) -> list[str]:
    return lst if v is None else [*(x for x in lst if x != v), v]


_END_CANARY: dict[str, Any] = {
    "candidate": None,
    "phase": "idle",
    "step": -1,
    "traffic_pct": 0.0,
    "step_started_at": None,
}


class _Versions:
    """The versions map being updated by one event (a copy; the state's own map is untouched)."""

    def __init__(self, state: DeploymentState, ev: DeploymentEvent):
        self.map, self.ev = dict(state.versions), ev

    def get(self, version: str) -> VersionState:
        """The version's entry, created as `registered` when first seen."""
        if version not in self.map:
            ts = self.ev.ts
            self.map[version] = VersionState(version=version, created_at=ts, updated_at=ts)
        return self.map[version]

    def update(self, version: str | None, **fields: Any) -> None:
        if version is not None:
            self.map[version] = self.get(version).model_copy(
                update={**fields, "updated_at": self.ev.ts}
            )


def _take_analysis(
    u: dict[str, Any],
    vs: _Versions,
    ev: DeploymentEvent,
    candidate: str | None,
    champion: str | None,
) -> None:
    """details.analysis -> last_analysis; its candidate/champion sub-dicts -> online metrics."""
    analysis = ev.details.get("analysis")
    if not isinstance(analysis, dict):
        return
    u["last_analysis"] = dict(analysis)
    for role, version in (("candidate", candidate), ("champion", champion)):
        if version is not None and isinstance(analysis.get(role), dict):
            vs.update(version, online=dict(analysis[role]))


def _new_champion(u: dict[str, Any], vs: _Versions, state: DeploymentState, v: str) -> None:
    """`v` serves as champion; the old champion (if another) is retired."""
    if state.champion is not None and state.champion != v:
        vs.update(state.champion, status="retired")
    vs.update(v, status="champion")
    u["champion"] = v


def _replica(
    replicas: dict[str, ReplicaState], ev: DeploymentEvent, **fields: Any
) -> dict[str, ReplicaState]:
    """The replicas map with the reporting replica updated by `fields` (details merged)."""
    d = ev.details
    rid = d["replica_id"]
    rep = replicas.get(rid) or ReplicaState(replica_id=rid)
    extra = {k: v for k, v in d.items() if k not in ("replica_id", "url", "slot")}
    details = {**rep.details, **extra, **fields.pop("details", {})}
    new = rep.model_copy(
        update={
            "model": ev.model,
            "url": d.get("url") or rep.url,
            "last_heartbeat": ev.ts,
            "details": details,
            **fields,
        }
    )
    return {**replicas, rid: new}


# --- the fold -----------------------------------------------------------------------------------
def fold(state: DeploymentState, ev: DeploymentEvent) -> DeploymentState:
    """The state after `ev` (pure). Events about another model leave the state as it is."""
    if ev.model != state.model:
        return state
    t, v, d = ev.type, ev.version, ev.details
    u: dict[str, Any] = {"last_event_id": ev.event_id, "updated_at": ev.ts}
    vs = _Versions(state, ev)
    answered = d.get("in_response_to")
    for slot in ("ui_champion", "ui_candidate"):
        if answered and (getattr(state, slot) or {}).get("event_id") == answered:
            u[slot] = None

    if t == "version_registered":
        vs.update(
            v,
            parent_version=ev.from_version,
            run_id=d.get("run_id"),
            rollouts_consumed=d.get("rollouts_consumed"),
            reward_spec=d.get("reward_spec"),
            lineage={k: x for k, x in d.items() if k not in _REGISTRATION_FIELDS},
            created_at=ev.ts,
        )
        u.update(
            registered=_add(state.registered, v),
            last_registered_version=v,
            last_registered_at=ev.ts,
        )
    elif t in ("gate_passed", "gate_failed"):
        passed = t == "gate_passed"
        # a version already serving as champion (recorded before its gate finished) stays champion
        status = {} if state.champion == v else {"status": t}
        vs.update(v, gate=dict(d), **status)
        u["gate"] = {**state.gate, v: passed}
        if not passed:
            u["failed"] = _add(state.failed, v)
    elif t == "canary_started":
        u.update(
            candidate=v,
            phase="canary",
            step=int(d.get("step", 0)),
            traffic_pct=float(ev.traffic_pct or 0.0),
            step_started_at=ev.ts,
            canaried=_add(state.canaried, v),
            last_analysis={},
        )
        vs.update(v, status="canary")
        _take_analysis(u, vs, ev, v, state.champion)
    elif t == "traffic_shifted":
        if state.candidate is not None and v == state.candidate:  # else: a stale shift, ignored
            u.update(
                phase="canary",
                step=int(d.get("step", state.step + 1)),
                traffic_pct=float(ev.traffic_pct or 0.0),
                step_started_at=ev.ts,
            )
            _take_analysis(u, vs, ev, state.candidate, state.champion)
    elif t == "canary_paused":
        if state.phase == "canary":
            u["phase"] = "paused"
        _take_analysis(u, vs, ev, state.candidate, state.champion)
    elif t == "canary_resumed":
        if state.phase == "paused" or (state.phase == "canary" and d.get(STEP_RESTART)):
            u.update(phase="canary", step_started_at=ev.ts)
        _take_analysis(u, vs, ev, state.candidate, state.champion)
    elif t == "promoted":
        _take_analysis(u, vs, ev, state.candidate, state.champion)
        _new_champion(u, vs, state, v)
        u.update(
            _END_CANARY,
            known_good=_to_end(state.known_good, v),
            canaried=_add(state.canaried, v),
        )
    elif t == "rolled_back":
        _take_analysis(u, vs, ev, state.candidate, state.champion)
        bad = ev.from_version or state.candidate or state.champion
        bad = None if bad == v else bad
        known_good = _to_end(state.known_good, v)
        if bad is not None:
            vs.update(bad, status="rolled_back")
            u["failed"] = _add(state.failed, bad)
            known_good = [x for x in known_good if x != bad]
        vs.update(v, status="champion")
        u.update(_END_CANARY, champion=v, known_good=known_good)
    elif t == "aborted":
        vs.update(v, status="aborted")
        u.update(_END_CANARY)
    elif t == "alias_changed":
        alias, ui = d.get("alias"), ev.source == "mlflow-ui"
        slot = {"event_id": ev.event_id, "to": v}
        if alias == "champion":
            if v is not None:
                _new_champion(u, vs, state, v)
                u["known_good"] = _to_end(state.known_good, v)
            # the move itself is carried out by the fold; a running canary or a removed champion
            # still needs the controller's answer (promoted / aborted / restored)
            if ui and (v is None or state.candidate is not None):
                u["ui_champion"] = slot
        elif alias == "candidate" and ui and v != state.candidate:
            u["ui_candidate"] = slot
    elif t == "replica_synced":
        slot_field = "candidate_version" if d.get("slot") == "candidate" else "champion_version"
        u["replicas"] = _replica(
            state.replicas,
            ev,
            status="serving",
            details={"last_synced_version": v},
            **{slot_field: v},
        )
    elif t == "replica_sync_failed":
        u["replicas"] = _replica(
            state.replicas, ev, status="sync_failed", details={"failed_version": v}
        )
    elif t == "replica_heartbeat":
        u["replicas"] = apply_heartbeat(state.replicas, ev)
    u["versions"] = vs.map
    return state.model_copy(update=u)


def apply_heartbeat(
    replicas: dict[str, ReplicaState], ev: DeploymentEvent
) -> dict[str, ReplicaState]:
    """The replicas map after one `replica_heartbeat` (from `<ns>.replica-status`, or a log that
    still carries heartbeats): what the replica serves now, its status and last heartbeat."""
    d = ev.details
    rep = replicas.get(d["replica_id"])
    champion = d.get(
        "champion_version", v if (v := ev.version) is not None else rep and rep.champion_version
    )
    fields: dict[str, Any] = {"champion_version": champion}
    if "candidate_version" in d:
        fields["candidate_version"] = d["candidate_version"]
    if ev.traffic_pct is not None:
        fields["traffic_pct"] = ev.traffic_pct
    fields["status"] = d.get("status") or ("serving" if champion else "starting")
    return _replica(replicas, ev, **fields)


def replay(
    model: str, events: Iterable[DeploymentEvent], state: DeploymentState | None = None
) -> DeploymentState:
    """Fold `events` (oldest first) onto `state` (default: the empty state of `model`); an
    event_id counts once."""
    state = state or DeploymentState(model=model)
    seen: set[str] = set()
    for ev in events:
        if ev.event_id in seen:
            continue
        seen.add(ev.event_id)
        state = fold(state, ev)
    return state
