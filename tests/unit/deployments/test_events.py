"""The deployment-event contract: required fields per type, strictness, JSON round trip."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from app.contracts.deployments import EVENT_TYPES, SOURCES, DeploymentEvent, decode_record


def _ev(**kw) -> DeploymentEvent:
    kw.setdefault("type", "promoted")
    kw.setdefault("model", "flywheel-policy")
    kw.setdefault("version", "3")
    kw.setdefault("source", "controller")
    return DeploymentEvent(**kw)


def test_types_and_sources_cover_the_design_contract() -> None:
    design = {
        "version_registered",
        "gate_passed",
        "gate_failed",
        "canary_started",
        "traffic_shifted",
        "canary_paused",
        "canary_resumed",
        "promoted",
        "rolled_back",
        "aborted",
        "alias_changed",
        "replica_synced",
        "replica_sync_failed",
    }
    assert design <= set(EVENT_TYPES) and set(EVENT_TYPES) - design == {"replica_heartbeat"}
    assert set(SOURCES) == {"trainer", "controller", "api", "mlflow-ui", "replica", "import"}


def test_json_round_trip_is_lossless_and_defaults_fill_id_and_ts() -> None:
    a, b = _ev(details={"analysis": {"verdict": "better"}, "step": 2}), _ev()
    assert a.event_id != b.event_id and len(a.event_id) == 32
    assert a.ts.tzinfo is not None
    assert DeploymentEvent.from_bytes(a.to_bytes()) == a
    assert set(json.loads(a.to_bytes())) == {
        "event_id",
        "type",
        "model",
        "version",
        "from_version",
        "traffic_pct",
        "source",
        "actor",
        "reason",
        "details",
        "ts",
    }


def test_timestamps_are_normalized_to_utc() -> None:
    local = datetime(2026, 3, 1, 10, 0, tzinfo=timezone(timedelta(hours=2)))
    e = _ev(ts=local)
    assert e.ts == local and e.ts.utcoffset() == timedelta(0) and e.ts.hour == 8


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"type": "shipped"}, "type"),
        ({"source": "cron"}, "source"),
        ({"version": None}, "needs `version`"),
        ({"type": "canary_started"}, "needs `traffic_pct`"),
        ({"type": "traffic_shifted", "traffic_pct": 120.0}, "less than or equal to 100"),
        ({"type": "alias_changed", "details": {"alias": "staging"}}, "details.alias"),
        ({"type": "replica_synced"}, "details.replica_id"),
        (
            {"type": "replica_synced", "details": {"replica_id": "r", "slot": "blue"}},
            "details.slot",
        ),
        ({"details": {"step": "2"}}, "details.step must be an integer"),
        ({"details": {"analysis": [1]}}, "details.analysis must be an object"),
        ({"ts": datetime(2026, 1, 1)}, "timezone"),
        ({"event_id": "x" * 65}, "at most 64"),
        ({"model": ""}, "at least 1"),
        ({"colour": "red"}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_events_are_rejected_with_a_reason(kw: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _ev(**kw)


def test_version_is_optional_only_for_alias_removal_and_heartbeats() -> None:
    assert _ev(type="alias_changed", version=None, details={"alias": "candidate"}).version is None
    assert (
        _ev(
            type="replica_heartbeat", version=None, source="replica", details={"replica_id": "r-1"}
        ).version
        is None
    )


def test_nan_in_details_cannot_reach_the_topic() -> None:
    with pytest.raises(ValidationError, match=r"details.analysis.delta is NaN or infinite"):
        _ev(details={"analysis": {"delta": float("nan")}})
    with pytest.raises(ValidationError, match=r"details.ci\[1\] is NaN or infinite"):
        _ev(details={"ci": [0.1, float("inf")]})


def test_decode_record_skips_garbage_and_keeps_valid_events() -> None:
    assert decode_record(0, 1, b"not json") is None
    assert decode_record(0, 2, None) is None
    assert decode_record(0, 3, b'{"type": "promoted"}') is None
    e = _ev()
    logged = decode_record(0, 4, e.to_bytes())
    assert logged is not None and (logged.partition, logged.offset, logged.event) == (0, 4, e)
