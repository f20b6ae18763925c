"""The champion the controller records while the log names none (alias_changed from `controller`)
is the projections' champion, and a gate verdict that arrives after it does not demote it."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.contracts.deployments import DeploymentEvent, LoggedEvent
from app.db.models import DeploymentState, ModelVersion
from app.projector.projector import apply_event

MODEL = "policy"


def test_a_recorded_champion_stays_champion_after_its_gate_verdict(session: Session) -> None:
    events = [
        DeploymentEvent(type="version_registered", model=MODEL, version="1", source="trainer"),
        DeploymentEvent(
            type="alias_changed",
            model=MODEL,
            version="1",
            source="controller",
            details={"alias": "champion", "recorded": True},
        ),
        DeploymentEvent(
            type="gate_passed",
            model=MODEL,
            version="1",
            source="controller",
            details={"passed": True},
        ),
    ]
    for offset, ev in enumerate(events):
        apply_event(session, LoggedEvent(0, offset, ev))
    assert session.get(DeploymentState, MODEL).champion == "1"
    mv = session.get(ModelVersion, (MODEL, "1"))
    assert (mv.status, mv.gate) == ("champion", {"passed": True})
