"""deployment_events is append-only, in the ORM and in the database itself (triggers of
migration 0002), on SQLite and on PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from app.db.migrate import upgrade
from app.db.models import DeploymentEvent

pytestmark = pytest.mark.integration


def _event(event_id: str, **kw) -> DeploymentEvent:
    return DeploymentEvent(
        event_id=event_id,
        type=kw.pop("type", "promoted"),
        model="flywheel-policy",
        version="3",
        from_version="2",
        source="controller",
        actor="controller",
        reason="canary passed",
        details={"step": 3},
        ts=datetime(2026, 1, 1, tzinfo=UTC),
        **kw,
    )


@pytest.fixture()
def engine(db_url: str):
    upgrade(db_url)
    eng = sa.create_engine(db_url)
    with Session(eng) as s:
        s.add(_event("e-1", kafka_partition=0, kafka_offset=0))
        s.commit()
    yield eng
    eng.dispose()


def test_orm_update_of_a_deployment_event_raises(engine: sa.Engine) -> None:
    with Session(engine) as s:
        row = s.scalar(sa.select(DeploymentEvent).where(DeploymentEvent.event_id == "e-1"))
        row.reason = "rewritten history"
        with pytest.raises(ValueError, match="append-only"):
            s.commit()
    with Session(engine) as s:
        assert s.scalar(sa.select(DeploymentEvent.reason)) == "canary passed"


def test_orm_delete_of_a_deployment_event_raises(engine: sa.Engine) -> None:
    with Session(engine) as s:
        s.delete(s.scalar(sa.select(DeploymentEvent)))
        with pytest.raises(ValueError, match="append-only"):
            s.commit()
    with Session(engine) as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(DeploymentEvent)) == 1


@pytest.mark.parametrize(
    "sql, op",
    [
        ("update deployment_events set reason = 'rewritten' where event_id = 'e-1'", "UPDATE"),
        ("update deployment_events set version = '99'", "UPDATE"),
        ("delete from deployment_events where event_id = 'e-1'", "DELETE"),
        ("delete from deployment_events", "DELETE"),
    ],
)
def test_raw_sql_update_and_delete_are_rejected_by_the_database(
    engine: sa.Engine, sql: str, op: str
) -> None:
    with engine.connect() as conn:
        with pytest.raises(sa.exc.DBAPIError) as info:
            conn.execute(sa.text(sql))
        conn.rollback()
    message = str(info.value.orig)
    assert "deployment_events is append-only" in message and f"{op} refused" in message, message
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("select event_id, reason, version from deployment_events")
        ).all()
    assert [tuple(r) for r in rows] == [("e-1", "canary passed", "3")], rows


def test_inserts_are_still_allowed_and_duplicates_rejected(engine: sa.Engine) -> None:
    with Session(engine) as s:
        s.add(_event("e-2", type="rolled_back", kafka_partition=0, kafka_offset=1))
        s.commit()
    with Session(engine) as s:
        s.add(_event("e-2", kafka_partition=0, kafka_offset=2))
        with pytest.raises(sa.exc.IntegrityError):
            s.commit()
    with Session(engine) as s:
        s.add(_event("e-3", kafka_partition=0, kafka_offset=1))  # same Kafka offset as e-2
        with pytest.raises(sa.exc.IntegrityError):
            s.commit()
    with engine.connect() as conn:
        ids = (
            conn.execute(sa.text("select event_id from deployment_events order by seq"))
            .scalars()
            .all()
        )
    assert ids == ["e-1", "e-2"]
