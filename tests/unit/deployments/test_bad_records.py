"""Bad records of the deployment log, decoded and projected without a broker.

Every consumer decodes with `decode_event`, so a record is either an event every consumer can
fold and project, or an `InvalidRecord` with a reason every consumer dead-letters. An event
the projections still cannot take is rolled back alone (`apply_or_skip`) and the rest of the
batch applies: the projections equal those of the log without that event.
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from app.contracts.deployments import DeploymentEvent, InvalidRecord, LoggedEvent, decode_event
from app.controller.state import fold
from app.db.models import DeploymentState
from app.projector import projector

BASE = {"type": "promoted", "model": "m", "version": "2", "source": "controller"}


@pytest.mark.parametrize(
    "raw, reason, field",
    [
        (b"\xff\xfe", "invalid_json", "(event)"),
        (b"", "invalid_json", "(event)"),
        (b"[1, 2]", "invalid_event", "(event)"),
        (json.dumps({**BASE, "version": "latest"}).encode(), "invalid_event", "version"),
        (json.dumps({**BASE, "from_version": "v1"}).encode(), "invalid_event", "from_version"),
        (json.dumps({**BASE, "ts": "2026-11-21T10:00:00"}).encode(), "invalid_event", "ts"),
        (json.dumps({**BASE, "ts": 1.7e9}).encode(), "invalid_event", "ts"),
        (json.dumps({**BASE, "details": {"step": "3"}}).encode(), "invalid_event", "(event)"),
        (
            json.dumps(
                {**BASE, "type": "version_registered", "details": {"rollouts_consumed": -1}}
            ).encode(),
            "invalid_event",
            "(event)",
        ),
        (
            json.dumps(
                {
                    **BASE,
                    "type": "replica_heartbeat",
                    "details": {"replica_id": "r", "champion_version": "abc"},
                }
            ).encode(),
            "invalid_event",
            "(event)",
        ),
        (json.dumps({**BASE, "reason": "a\u0000b"}).encode(), "invalid_event", "(event)"),
        (json.dumps({**BASE, "details": {"k\u0000": 1}}).encode(), "invalid_event", "(event)"),
    ],
)
def test_records_no_consumer_could_use_are_refused_at_decode_with_a_reason(raw, reason, field):
    with pytest.raises(InvalidRecord) as err:
        decode_event(raw)
    assert err.value.reason == reason and err.value.errors[0]["field"] == field, err.value.errors


def test_a_lower_case_z_and_an_offset_decode_to_the_same_utc_instant():
    a = decode_event(json.dumps({**BASE, "ts": "2026-11-21T10:00:00z"}).encode())
    b = decode_event(json.dumps({**BASE, "ts": "2026-11-21T11:00:00+01:00"}).encode())
    assert a.ts == b.ts and a.ts.utcoffset().total_seconds() == 0


def test_an_event_the_projections_cannot_take_is_skipped_alone(session: Session, monkeypatch):
    events = [
        DeploymentEvent(type="promoted", model="m", version="1", source="controller"),
        DeploymentEvent(type="canary_paused", model="m", version="1", source="api"),
        DeploymentEvent(type="promoted", model="m", version="2", source="controller"),
    ]
    store = projector._store

    def refuse(session, row, before, after):
        store(session, row, before, after)
        if after.last_event_id == events[1].event_id:  # storing the canary_paused fails half-way
            session.get(DeploymentState, "m").champion = "99"  # a change that must not survive
            raise RuntimeError("cannot project")

    monkeypatch.setattr(projector, "_store", refuse)
    results = [projector.apply_or_skip(session, LoggedEvent(0, i, e)) for i, e in enumerate(events)]
    session.commit()
    assert [r[0] for r in results] == [True, False, True]
    assert (
        results[0][1] is None and isinstance(results[1][1], RuntimeError) and results[2][1] is None
    )
    assert session.get(DeploymentState, "m").champion == "2"
    assert session.scalar(sa.select(sa.func.count()).select_from(projector.EventRow)) == 2
    # the controller's fold of the same log (without the skipped event) agrees on the champion
    assert (
        fold("m", [events[0].model_dump(mode="json"), events[2].model_dump(mode="json")]).champion
        == "2"
    )
