"""The controller's side of the deployment log: decisions and the fold over event dicts.

The topic is the source of truth (docs/DESIGN.md §Deployment events). The state and its rules live in one place,
app/contracts/deployment_state.py (`DeploymentState`, `fold`), shared with the replicas, the
admin API and the SQL projector. The controller's state machine (app/controller/canary.py)
handles events as dicts with the docs/DESIGN.md §Deployment events fields (`event_id, type, model, version,
from_version, traffic_pct, source, actor, reason, details, ts`); `apply_event` and `fold` here
validate them as `DeploymentEvent`s and apply that one fold.

A `Decision` is what the controller (or an operator verb) wants to become an event; the
caller adds `event_id`, `model`, `ts` and publishes it (`Decision.to_event`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field

from app.contracts import deployment_state
from app.contracts.deployment_state import DeploymentState, Phase
from app.contracts.deployments import EVENT_TYPES, DeploymentEvent
from app.contracts.events import parse_ts as parse_event_ts

__all__ = ["Decision", "DeploymentState", "Phase", "apply_event", "fold", "parse_ts", "vkey"]


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

    type: str = Field(description="A deployment event type (docs/DESIGN.md §Deployment events).")
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


def apply_event(state: DeploymentState, ev: dict[str, Any]) -> DeploymentState:
    """The state after `ev`, an event as a dict (a `Decision.to_event` or a decoded record):
    validated as a `DeploymentEvent` and folded by the one fold (app/contracts/deployment_state.py).
    Pure; events about other models are ignored; an invalid event raises ValidationError."""
    return deployment_state.fold(state, DeploymentEvent.model_validate(ev))


def fold(
    model: str, events: Iterable[dict[str, Any]], state: DeploymentState | None = None
) -> DeploymentState:
    """Replay `events` (dicts, oldest first) onto `state` (default: the empty state of `model`);
    an event id counts once (at-least-once delivery)."""
    return deployment_state.replay(
        model, (DeploymentEvent.model_validate(ev) for ev in events), state
    )
