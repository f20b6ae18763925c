"""Heartbeats of `<ns>.replica-status` into the `replicas` table (SQLite, no broker): the newest
report per replica wins, whatever order the two topics are read in."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from app.contracts.deployments import DeploymentEvent, LoggedEvent
from app.db.models import Replica
from app.projector.projector import apply_event, apply_replica_status

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def beat(i: int, champion: str, **details) -> DeploymentEvent:
    return DeploymentEvent(
        type="replica_heartbeat",
        model="m",
        source="replica",
        ts=T0 + timedelta(seconds=i),
        details={"replica_id": "r-1", "champion_version": champion, **details},
    )


def test_the_newest_heartbeat_wins_and_an_older_one_changes_nothing(session: Session) -> None:
    assert apply_replica_status(session, beat(10, "2", url="http://r-1:8001")) is True
    assert apply_replica_status(session, beat(5, "1")) is False, "older than the last report"
    rep = session.get(Replica, "r-1")
    assert (rep.model, rep.champion_version, rep.status, rep.url) == (
        "m",
        "2",
        "serving",
        "http://r-1:8001",
    )
    assert rep.last_heartbeat.replace(tzinfo=UTC) == T0 + timedelta(seconds=10)


def test_a_sync_on_the_log_and_a_heartbeat_on_the_status_topic_share_the_row(
    session: Session,
) -> None:
    synced = DeploymentEvent(
        type="replica_synced",
        model="m",
        version="3",
        source="replica",
        ts=T0,
        details={"replica_id": "r-1", "slot": "candidate"},
    )
    apply_event(session, LoggedEvent(0, 0, synced))
    apply_replica_status(session, beat(1, "2", candidate_version="3"))
    rep = session.get(Replica, "r-1")
    assert (rep.champion_version, rep.candidate_version, rep.details["last_synced_version"]) == (
        "2",
        "3",
        "3",
    )


def test_only_heartbeats_belong_on_the_status_topic(session: Session) -> None:
    decision = DeploymentEvent(type="promoted", model="m", version="1", source="controller")
    with pytest.raises(ValueError, match="only replica_heartbeat"):
        apply_replica_status(session, decision)
