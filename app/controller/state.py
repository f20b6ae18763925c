"""Deployment state as a pure fold over the events of `flywheel.deployments`.

The topic is the source of truth (DESIGN.md): `fold(events)` rebuilds the controller's view
(champion, candidate, canary phase and step, known-good history, failed versions) from any
prefix of the log, so a restarted controller, the admin API and the tests all see the same
state. `apply_event` never has side effects and ignores events that do not apply.

Events are handled as plain dicts with the DESIGN.md fields (`event_id, type, model,
version, from_version, traffic_pct, source, actor, reason, details, ts`), so this module
works on Kafka records and on SQL projection rows alike.

A `Decision` is what the controller (or an operator verb) wants to become an event; the
caller adds `event_id`, `model`, `ts` and publishes it (`Decision.to_event`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from app.contracts.deployments import EVENT_TYPES
from app.contracts.events import parse_ts as parse_event_ts

Phase = Literal["idle", "canary", "paused"]


def vkey(version: str | None) -> int:
    """MLflow versions are decimal strings; order them numerically (None sorts first)."""
    return -1 if version is None else int(version)


def parse_ts(value: Any) -> datetime:
    """An event's ts as aware UTC: the event schema's one parser (app/contracts/events.py); a naive datetime
    (SQLite projection rows hand back naive UTC) is taken as UTC."""
    if isinstance(value, datetime) and value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return parse_event_ts(value)


class Decision(BaseModel):
    """A deployment event before it has an id and a timestamp."""

    type: str = Field(description="One of the DESIGN.md deployment event types.")
    version: str | None = Field(None, description="The version the event is about (the new state).")
    from_version: str | None = Field(None, description="The version it moves away from, if any.")
    traffic_pct: float | None = Field(
        None, description="Candidate's share of sessions after the event, in %."
    )
    source: str = Field("controller", description="trainer | controller | api | mlflow-ui.")
    actor: str = Field(
        "controller", description="Who decided: 'controller', an API key name, 'mlflow-ui'."
    )
    reason: str = Field("", description="Human-readable why.")
    details: dict[str, Any] = Field(
        default_factory=dict, description="Structured extra data (analysis, step...)."
    )

    def to_event(
        self, model: str, ts: datetime | None = None, event_id: str | None = None
    ) -> dict[str, Any]:
        assert self.type in EVENT_TYPES, f"unknown deployment event type {self.type!r}"
        ts = ts or datetime.now(UTC)
        return {
            "event_id": event_id or uuid.uuid4().hex,
            "type": self.type,
            "model": model,
            "version": self.version,
            "from_version": self.from_version,
            "traffic_pct": self.traffic_pct,
            "source": self.source,
            "actor": self.actor,
            "reason": self.reason,
            "details": self.details,
            "ts": ts.isoformat().replace("+00:00", "Z"),
        }


class DeploymentState(BaseModel):
    """The controller's view of one registered model's rollout."""

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

    def rollback_targets(self, n: int) -> list[str]:
        """The last `n` known-good versions other than the current champion, newest first."""
        out = [v for v in reversed(self.known_good) if v != self.champion and v not in self.failed]
        return out[:n]


def _add(lst: list[str], v: str | None) -> list[str]:
    return lst if v is None or v in lst else [*lst, v]


def _to_end(lst: list[str], v: str | None) -> list[str]:
    return lst if v is None else [*(x for x in lst if x != v), v]


def _end_canary(s: DeploymentState) -> dict[str, Any]:
    return {
        "candidate": None,
        "phase": "idle",
        "step": -1,
        "traffic_pct": 0.0,
        "step_started_at": None,
    }


def apply_event(state: DeploymentState, ev: dict[str, Any]) -> DeploymentState:
    """The state after `ev`. Pure; events about other models or of unknown type are ignored."""
    if ev.get("model") not in (None, state.model):
        return state
    t, v, frm = ev.get("type"), ev.get("version"), ev.get("from_version")
    details = ev.get("details") or {}
    ts = parse_ts(ev["ts"]) if ev.get("ts") is not None else None
    u: dict[str, Any] = {"last_event_id": ev.get("event_id")}
    answered = details.get("in_response_to")
    for slot in ("ui_champion", "ui_candidate"):
        if answered and (getattr(state, slot) or {}).get("event_id") == answered:
            u[slot] = None

    if t == "version_registered":
        u["registered"] = _add(state.registered, v)
    elif t == "gate_passed":
        u["gate"] = {**state.gate, v: True}
    elif t == "gate_failed":
        u["gate"] = {**state.gate, v: False}
        u["failed"] = _add(state.failed, v)
    elif t == "canary_started":
        u.update(
            candidate=v,
            phase="canary",
            step=int(details.get("step", 0)),
            traffic_pct=float(ev.get("traffic_pct") or 0.0),
            step_started_at=ts,
            canaried=_add(state.canaried, v),
            last_analysis={},
        )
    elif t == "traffic_shifted":
        if state.candidate is not None and v in (None, state.candidate):
            u.update(
                phase="canary",
                step=int(details.get("step", state.step + 1)),
                traffic_pct=float(ev.get("traffic_pct") or 0.0),
                step_started_at=ts,
            )
    elif t == "canary_paused":
        if state.phase == "canary":
            u["phase"] = "paused"
    elif t == "canary_resumed":
        if state.phase == "paused":
            u.update(phase="canary", step_started_at=ts)
    elif t == "promoted":
        u.update(
            _end_canary(state),
            champion=v,
            known_good=_to_end(state.known_good, v),
            canaried=_add(state.canaried, v),
        )
    elif t == "rolled_back":
        bad = frm
        u.update(
            _end_canary(state),
            champion=v or state.champion,
            failed=_add(state.failed, bad),
            known_good=[x for x in _to_end(state.known_good, v) if x != bad],
        )
    elif t == "aborted":
        u.update(_end_canary(state))
    elif t == "alias_changed":
        alias, ui = details.get("alias"), ev.get("source") == "mlflow-ui"
        slot = {"event_id": ev.get("event_id"), "to": v}
        if alias == "champion":
            if v is not None:
                u.update(champion=v, known_good=_to_end(state.known_good, v))
            # the move itself is carried out by the fold; a running canary or a removed champion
            # still needs an answer (promoted / aborted / restored)
            if ui and (v is None or state.candidate is not None):
                u["ui_champion"] = slot
        elif alias == "candidate" and ui and v != state.candidate:
            u["ui_candidate"] = slot
    if "analysis" in details and t in (
        "traffic_shifted",
        "promoted",
        "rolled_back",
        "canary_paused",
    ):
        u["last_analysis"] = details["analysis"]
    return state.model_copy(update=u)


def fold(
    model: str, events: Iterable[dict[str, Any]], state: DeploymentState | None = None
) -> DeploymentState:
    """Replay `events` (oldest first) onto `state` (default: the empty state of `model`)."""
    state = state or DeploymentState(model=model)
    seen: set[str] = set()
    for ev in events:
        eid = ev.get("event_id")
        if eid in seen:  # at-least-once delivery: an event id counts once
            continue
        if eid:
            seen.add(eid)
        state = apply_event(state, ev)
    return state
