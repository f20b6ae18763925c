"""Projection logic on a real (SQLite) database, without a broker: state transitions,
idempotence, and the rebuild reset that works around the append-only guard."""

from __future__ import annotations

from datetime import UTC

import pytest
import sqlalchemy as sa
from kafka.errors import (
    CommitFailedError,
    GroupAuthorizationFailedError,
    KafkaTimeoutError,
    RebalanceInProgressError,
)
from prometheus_client import REGISTRY
from sqlalchemy.orm import Session

from app.contracts.deployments import DeploymentEvent, LoggedEvent
from app.db.models import DeploymentEvent as EventRow
from app.db.models import DeploymentState, ModelVersion, Replica
from app.projector.projector import (
    _commit,
    apply_event,
    apply_events,
    projection_rows,
    reset_projections,
)
from tests.unit.deployments.scenario import EXPECTED_STATUS, MODEL, OTHER, scenario_events


def _logged(events: list[DeploymentEvent]) -> list[LoggedEvent]:
    return [LoggedEvent(0, i, e) for i, e in enumerate(events)]


def _utc(dt):
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt


def test_scenario_projects_to_the_expected_state(session: Session) -> None:
    events = scenario_events()
    applied = apply_events(session, _logged(events))
    session.commit()
    assert applied == len(events) - 1, "the re-published event must be applied once"

    state = session.get(DeploymentState, MODEL)
    assert (state.champion, state.candidate, state.traffic_pct, state.phase, state.step_index) == (
        "1",
        None,
        0.0,
        "idle",
        None,
    )
    assert state.last_registered_version == "5"
    assert _utc(state.last_registered_at) == events[23].ts
    assert state.last_analysis == {}, "v5's canary started afresh (no analysis yet) and was aborted"
    assert state.last_event_id == events[-3].event_id and _utc(state.updated_at) == events[-3].ts

    statuses = dict(
        session.execute(
            sa.select(ModelVersion.version, ModelVersion.status).where(ModelVersion.model == MODEL)
        ).all()
    )
    assert statuses == EXPECTED_STATUS
    v2 = session.get(ModelVersion, (MODEL, "2"))
    assert (v2.parent_version, v2.run_id, v2.rollouts_consumed, v2.reward_spec) == (
        "1",
        "run-2",
        5000,
        "v1",
    )
    assert v2.lineage == {"offsets": {"0": [4900, 5000]}, "delta_bytes": 1234}
    assert v2.gate["snips"] == 0.31
    assert v2.online == {"reward_mean": 0.40, "n": 6000}, (
        "latest online metrics: as champion in v4's canary"
    )
    assert session.get(ModelVersion, (MODEL, "4")).online == {"reward_mean": 0.11, "n": 700}
    assert session.get(ModelVersion, (MODEL, "3")).gate == {
        "checks": {"nan": True},
        "reason": "NaN in weights",
    }

    ra, rb = session.get(Replica, "r-a"), session.get(Replica, "r-b")
    assert (ra.model, ra.champion_version, ra.candidate_version, ra.status, ra.url) == (
        MODEL,
        "2",
        None,
        "serving",
        "http://r-a:8001",
    )
    assert (rb.champion_version, rb.status) == ("2", "serving")
    assert (
        rb.details["error"] == "sha256 mismatch on layers.0.w"
        and rb.details["failed_version"] == "5"
    )

    other = session.get(DeploymentState, OTHER)
    assert (other.champion, other.last_registered_version) == (None, "2")
    assert session.scalar(sa.select(sa.func.count()).select_from(EventRow)) == len(events) - 1


def test_canary_steps_move_traffic_phase_and_step(session: Session) -> None:
    events = scenario_events()
    seen = []
    for logged in _logged(events[:12]):
        apply_event(session, logged)
        s = session.get(DeploymentState, MODEL)
        seen.append(
            (logged.event.type, s.champion, s.candidate, s.traffic_pct, s.phase, s.step_index)
        )
    assert seen[6:] == [
        ("canary_started", "1", "2", 5.0, "canary", 0),
        ("replica_synced", "1", "2", 5.0, "canary", 0),
        ("traffic_shifted", "1", "2", 25.0, "canary", 1),
        ("traffic_shifted", "1", "2", 50.0, "canary", 2),
        ("traffic_shifted", "1", "2", 100.0, "promoting", 3),
        ("promoted", "2", None, 0.0, "idle", None),
    ]
    assert session.get(ModelVersion, (MODEL, "1")).status == "retired"


def test_pause_and_resume_change_only_the_phase(session: Session) -> None:
    events = scenario_events()
    apply_events(session, _logged(events[:19]))
    assert session.get(DeploymentState, MODEL).phase == "canary"
    apply_event(session, LoggedEvent(0, 19, events[19]))
    s = session.get(DeploymentState, MODEL)
    assert (s.phase, s.candidate, s.traffic_pct, s.last_analysis) == (
        "paused",
        "4",
        5.0,
        {"verdict": "inconclusive"},
    )
    apply_event(session, LoggedEvent(0, 20, events[20]))
    assert session.get(DeploymentState, MODEL).phase == "canary"


def test_applying_an_event_twice_is_a_no_op(session: Session) -> None:
    e = scenario_events()[0]
    assert apply_event(session, LoggedEvent(0, 0, e)) is True
    before = projection_rows(session)
    assert apply_event(session, LoggedEvent(0, 0, e)) is False, "same event, same offset"
    assert apply_event(session, LoggedEvent(0, 7, e)) is False, (
        "same event_id re-published at a new offset"
    )
    other = DeploymentEvent(type="gate_passed", model=MODEL, version="1", source="controller")
    assert apply_event(session, LoggedEvent(0, 0, other)) is False, "an offset already applied"
    session.commit()
    assert projection_rows(session) == before


def test_events_for_unknown_versions_create_them(session: Session) -> None:
    apply_event(
        session,
        LoggedEvent(
            0,
            0,
            DeploymentEvent(
                type="alias_changed",
                model=MODEL,
                version="42",
                source="mlflow-ui",
                details={"alias": "champion"},
            ),
        ),
    )
    mv = session.get(ModelVersion, (MODEL, "42"))
    assert (
        mv is not None
        and mv.status == "champion"
        and session.get(DeploymentState, MODEL).champion == "42"
    )


def test_a_candidate_alias_move_waits_for_the_controllers_answer(session: Session) -> None:
    events = scenario_events()
    apply_events(session, _logged(events[:7]))  # v2 in canary at 5%
    apply_event(
        session,
        LoggedEvent(
            0,
            99,
            DeploymentEvent(
                type="alias_changed",
                model=MODEL,
                version=None,
                from_version="2",
                source="mlflow-ui",
                details={"alias": "candidate"},
            ),
        ),
    )
    s = session.get(DeploymentState, MODEL)
    assert (s.candidate, s.traffic_pct, s.phase) == ("2", 5.0, "canary"), (
        "an instruction, not yet carried out"
    )
    apply_event(
        session,
        LoggedEvent(
            0,
            100,
            DeploymentEvent(
                type="aborted",
                model=MODEL,
                version="2",
                from_version="2",
                source="mlflow-ui",
                reason="candidate alias removed",
            ),
        ),
    )
    s = session.get(DeploymentState, MODEL)
    assert (s.candidate, s.traffic_pct, s.phase) == (None, 0.0, "idle")


def test_champion_moved_to_the_candidate_in_the_ui_then_promoted(session: Session) -> None:
    events = scenario_events()
    apply_events(session, _logged(events[:9]))  # v2 in canary at 25%, v1 champion
    for i, ev in enumerate(
        [
            DeploymentEvent(
                type="alias_changed",
                model=MODEL,
                version="2",
                from_version="1",
                source="mlflow-ui",
                details={"alias": "champion"},
            ),
            DeploymentEvent(
                type="promoted", model=MODEL, version="2", traffic_pct=100.0, source="mlflow-ui"
            ),
        ]
    ):
        apply_event(session, LoggedEvent(0, 100 + i, ev))
    s = session.get(DeploymentState, MODEL)
    assert (s.champion, s.candidate, s.phase, s.traffic_pct) == ("2", None, "idle", 0.0)
    assert session.get(ModelVersion, (MODEL, "1")).status == "retired"
    assert session.get(ModelVersion, (MODEL, "2")).status == "champion"


def test_removing_the_champion_alias_keeps_the_serving_champion(session: Session) -> None:
    apply_events(session, _logged(scenario_events()[:2]))
    apply_event(
        session,
        LoggedEvent(
            0,
            50,
            DeploymentEvent(
                type="alias_changed",
                model=MODEL,
                version=None,
                from_version="1",
                source="mlflow-ui",
                details={"alias": "champion"},
            ),
        ),
    )
    assert session.get(DeploymentState, MODEL).champion == "1"


def test_stale_canary_events_after_the_canary_ended_are_ignored(session: Session) -> None:
    events = scenario_events()
    apply_events(session, _logged(events[:12]))  # v2 promoted: idle
    for i, ev in enumerate(
        [
            DeploymentEvent(
                type="traffic_shifted",
                model=MODEL,
                version="2",
                traffic_pct=50.0,
                source="controller",
            ),
            DeploymentEvent(type="canary_paused", model=MODEL, version="2", source="controller"),
        ]
    ):
        apply_event(session, LoggedEvent(0, 100 + i, ev))
    s = session.get(DeploymentState, MODEL)
    assert (s.champion, s.candidate, s.phase, s.traffic_pct) == ("2", None, "idle", 0.0)


def test_reset_projections_empties_tables_and_keeps_the_append_only_guard(sqlite_url: str) -> None:
    engine = sa.create_engine(sqlite_url)
    with Session(engine) as s:
        apply_events(s, _logged(scenario_events()))
        s.commit()
    with Session(engine) as s, s.begin():
        reset_projections(s)
    with engine.connect() as conn:
        for table in ("deployment_events", "model_versions", "deployment_state", "replicas"):
            assert conn.execute(sa.text(f"select count(*) from {table}")).scalar() == 0, table
        triggers = (
            conn.execute(sa.text("select name from sqlite_master where type='trigger'"))
            .scalars()
            .all()
        )
    assert sorted(triggers) == ["deployment_events_no_delete", "deployment_events_no_update"]
    with Session(engine) as s:
        apply_events(s, _logged(scenario_events()[:2]))
        s.commit()
        assert s.scalar(sa.select(EventRow.seq).order_by(EventRow.seq).limit(1)) == 1, (
            "seq restarts after a reset"
        )
    with engine.connect() as conn, pytest.raises(sa.exc.IntegrityError, match="append-only"):
        conn.execute(sa.text("delete from deployment_events"))
    engine.dispose()


def test_a_failed_reset_rolls_back_and_the_guard_stays(sqlite_url: str) -> None:
    engine = sa.create_engine(sqlite_url)
    with Session(engine) as s:
        apply_events(s, _logged(scenario_events()))
        s.commit()
    with pytest.raises(RuntimeError, match="boom"):
        with Session(engine) as s, s.begin():
            reset_projections(s)
            raise RuntimeError("boom")
    with engine.connect() as conn:
        assert (
            conn.execute(sa.text("select count(*) from deployment_events")).scalar()
            == len(scenario_events()) - 1
        )
        assert (
            conn.execute(
                sa.text("select count(*) from sqlite_master where type='trigger'")
            ).scalar()
            == 2
        )
    engine.dispose()


class _Refusing:
    """A consumer whose commit raises `exc`. Stands in for a group that rebalanced between the
    follower's poll and its commit, which the real broker does only on timing we cannot pin."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def commit(self) -> None:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (CommitFailedError(RebalanceInProgressError()), "rebalanced"),
        # as kafka-python 3 raises it, unwrapped, when the member knows the group is rebalancing
        # (seen on the real broker: tests/integration/deployments/test_sessions.py)
        (
            RebalanceInProgressError(
                "Offset commit cannot be completed since the consumer is undergoing a rebalance"
            ),
            "rebalanced",
        ),
        (KafkaTimeoutError("commit timed out"), "timeout"),
    ],
)
def test_a_commit_the_group_refuses_does_not_end_the_follower(exc, reason, caplog) -> None:
    before = REGISTRY.get_sample_value(
        "flywheel_projector_commits_failed_total", {"reason": reason}
    )
    _commit(_Refusing(exc))
    after = REGISTRY.get_sample_value("flywheel_projector_commits_failed_total", {"reason": reason})
    assert after == (before or 0) + 1
    assert "offset commit failed" in caplog.text and "re-read" in caplog.text


def test_a_commit_error_that_is_not_the_groups_moving_on_is_raised() -> None:
    with pytest.raises(GroupAuthorizationFailedError):
        _commit(_Refusing(GroupAuthorizationFailedError("flywheel-projector")))
