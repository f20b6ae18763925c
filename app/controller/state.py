"""The controller's side of the deployment log: the fold over event dicts.

The topic is the source of truth (docs/DESIGN.md §Deployment events). The state and its rules live in one place,
app/contracts/deployment_state.py (`DeploymentState`, `fold`), shared with the replicas, the
admin API and the SQL projector. The controller's state machine (app/controller/canary.py)
handles events as dicts with the docs/DESIGN.md §Deployment events fields (`event_id, type, model, version,
from_version, traffic_pct, source, actor, reason, details, ts`); `apply_event` and `fold` here
validate them as `DeploymentEvent`s and apply that one fold.

The controller's decisions are `Decision`s (app/contracts/deployments.py); `Decision.to_event`
makes them such dicts.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from app.contracts import deployment_state
from app.contracts.deployment_state import DeploymentState, Phase
from app.contracts.deployments import DeploymentEvent
from app.contracts.events import parse_ts as parse_event_ts

__all__ = ["DeploymentState", "Phase", "apply_event", "fold", "parse_ts", "vkey"]


def vkey(version: str | None) -> int:
    """MLflow versions are decimal strings; order them numerically (None sorts first)."""
    return -1 if version is None else int(version)


def parse_ts(value: Any) -> datetime:
    """An event's ts as aware UTC: the event schema's one parser (app/contracts/events.py); a naive datetime
    (SQLite projection rows hand back naive UTC) is taken as UTC."""
    if isinstance(value, datetime) and value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return parse_event_ts(value)


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
