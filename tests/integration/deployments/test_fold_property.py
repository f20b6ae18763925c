"""Property: for any valid sequence of deployment events, what the status API serves (the SQL
projections the projector stored, read over HTTP) equals the one fold's state
(app/contracts/deployment_state.py), on SQLite and on the real PostgreSQL.

hypothesis draws event sequences of valid shape over a few versions and replicas: every event
type, stale canary events, UI alias moves and answers, replica reports, and re-published events
(same event_id). Each example projects into the same database under its own model name and
replica ids, so the examples do not see each other's rows.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

from app.api.main import create_app
from app.contracts.deployment_state import DeploymentState, replay
from app.contracts.deployments import DeploymentEvent, LoggedEvent
from app.db.keys import create_key
from app.projector.projector import apply_events
from app.settings import Settings

pytestmark = pytest.mark.integration

VERSIONS = ["1", "2", "3", "4", "5"]
T0 = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)
_offsets = itertools.count()  # Kafka offsets unique across examples (the projector dedupes on them)

versions = st.sampled_from(VERSIONS)
maybe_version = st.none() | versions
metrics = st.fixed_dictionaries(
    {"reward_mean": st.sampled_from([0.1, 0.25, 0.5]), "n": st.integers(0, 5000)}
)
analysis = st.fixed_dictionaries(
    {"verdict": st.sampled_from(["better", "worse", "inconclusive"])},
    optional={"candidate": metrics, "champion": metrics},
)
canary_details = st.fixed_dictionaries(
    {}, optional={"step": st.integers(0, 4), "analysis": analysis}
)


_ABOUT_THE_CANARY = frozenset(
    {"traffic_shifted", "canary_paused", "promoted", "rolled_back", "aborted", "replica_synced"}
)


@st.composite
def event_specs(draw: st.DrawFn) -> dict[str, Any]:
    """One event's fields without model, ids and timestamps (the sequence adds them)."""
    t = draw(
        st.sampled_from(
            [
                "version_registered",
                "gate_passed",
                "gate_failed",
                "canary_started",
                "canary_started",
                "traffic_shifted",
                "traffic_shifted",
                "traffic_shifted",
                "canary_paused",
                "canary_resumed",
                "promoted",
                "rolled_back",
                "aborted",
                "alias_changed",
                "replica_synced",
                "replica_sync_failed",
                "replica_heartbeat",
            ]
        )
    )
    spec: dict[str, Any] = {"type": t, "version": draw(versions), "source": "controller"}
    if t in _ABOUT_THE_CANARY and draw(st.booleans()):
        spec["on_candidate"] = True  # about the version of the last canary_started (see `build`)
    if t == "version_registered":
        spec.update(
            source="trainer",
            from_version=draw(maybe_version),
            details=draw(
                st.fixed_dictionaries(
                    {"run_id": st.sampled_from(["run-a", "run-b"])},
                    optional={
                        "rollouts_consumed": st.integers(0, 10**6),
                        "reward_spec": st.just("v1"),
                        "offsets": st.just({"0": [0, 100]}),
                    },
                )
            ),
        )
    elif t in ("gate_passed", "gate_failed"):
        spec["details"] = draw(st.fixed_dictionaries({"snips": st.sampled_from([0.1, 0.3])}))
    elif t in ("canary_started", "traffic_shifted"):
        spec.update(
            traffic_pct=draw(st.sampled_from([5.0, 25.0, 50.0, 100.0])),
            from_version=draw(maybe_version),
            details=draw(canary_details),
        )
    elif t in ("canary_paused", "canary_resumed", "promoted", "rolled_back", "aborted"):
        spec.update(
            from_version=draw(maybe_version),
            details=draw(st.fixed_dictionaries({}, optional={"analysis": analysis})),
        )
    elif t == "alias_changed":
        spec.update(
            version=draw(maybe_version),
            source=draw(st.sampled_from(["mlflow-ui", "controller"])),
            details={"alias": draw(st.sampled_from(["champion", "candidate"]))},
        )
    else:
        spec["source"] = "replica"
        details: dict[str, Any] = {"replica_id": draw(st.sampled_from(["r-a", "r-b"]))}
        details.update(
            draw(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "url": st.sampled_from(["http://a:8001", "http://b:8001"]),
                        "slot": st.sampled_from(["champion", "candidate"]),
                        "error": st.just("sha256 mismatch"),
                    },
                )
            )
        )
        if t == "replica_heartbeat":
            spec["version"] = draw(maybe_version)
            spec["traffic_pct"] = draw(st.none() | st.sampled_from([0.0, 5.0]))
            details.update(
                draw(
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "champion_version": maybe_version,
                            "candidate_version": maybe_version,
                            "status": st.sampled_from(["serving", "draining"]),
                        },
                    )
                )
            )
        spec["details"] = details
    return spec


@st.composite
def sequences(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Specs in log order; some entries re-publish an earlier event (`{"again": i}`)."""
    specs = draw(st.lists(event_specs(), min_size=3, max_size=40))
    out: list[dict[str, Any]] = []
    for spec in specs:
        if out and draw(st.integers(0, 9)) == 0:
            out.append({"again": draw(st.integers(0, len(out) - 1))})
        out.append(spec)
    return out


def build(specs: list[dict[str, Any]], model: str) -> list[DeploymentEvent]:
    """The events of one example: its own model name and replica ids, increasing timestamps.

    `on_candidate` specs are about the version of the last canary_started (so canaries run their
    course as often as they go stale); an in_response_to answers the previous UI alias move (what
    the controller's answers do)."""
    events: list[DeploymentEvent] = []
    last_ui: str | None = None
    canary: str | None = None
    for i, spec in enumerate(specs):
        if "again" in spec:
            events.append(events[spec["again"]])
            continue
        spec = {**spec, "details": dict(spec.get("details", {}))}
        if spec.pop("on_candidate", False) and canary is not None:
            spec["version"] = canary
        if spec["type"] == "canary_started":
            canary = spec["version"]
        if "replica_id" in spec["details"]:
            spec["details"]["replica_id"] = f"{model}-{spec['details']['replica_id']}"
        elif last_ui is not None and spec["type"] in ("promoted", "aborted", "canary_started"):
            spec["details"]["in_response_to"], last_ui = last_ui, None
        ev = DeploymentEvent(model=model, ts=T0 + timedelta(seconds=7 * i), **spec)
        if ev.type == "alias_changed" and ev.source == "mlflow-ui":
            last_ui = ev.event_id
        events.append(ev)
    return events


@dataclass
class Api:
    client: TestClient
    headers: dict[str, str]
    db_url: str

    def project(self, events: list[DeploymentEvent]) -> None:
        engine = sa.create_engine(self.db_url)
        with Session(engine) as s:
            apply_events(s, [LoggedEvent(0, next(_offsets), e) for e in events])
            s.commit()
        engine.dispose()

    def get(self, path: str, **params: str) -> Any:
        return self.client.get(path, params=params, headers=self.headers)


@pytest.fixture()
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    engine = sa.create_engine(db_url)
    with Session(engine) as s:
        key, _ = create_key(s, ["read"], name="read")
        s.commit()
    engine.dispose()
    app = create_app(Settings(data_dir=tmp_path / "data", database_url=db_url))
    client = TestClient(app)  # lifespan not run: the status endpoints only read SQL (no Kafka)
    yield Api(client, {"Authorization": f"Bearer {key}"}, db_url)
    client.close()


def _ts(value: datetime | None) -> datetime | None:
    return value.astimezone(UTC) if value is not None else None


def _parsed(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value).astimezone(UTC)


def assert_api_serves(api: Api, state: DeploymentState) -> None:
    models = api.get("/v1/deployments", model=state.model).json()["models"]
    assert len(models) == 1, models
    got = models[0]
    candidate_pct = state.traffic_pct if state.candidate else 0.0
    assert {
        "champion": got["champion"],
        "candidate": got["candidate"],
        "phase": got["phase"],
        "step": got["step"],
        "candidate_pct": got["traffic"]["candidate_pct"],
        "last_analysis": got["last_analysis"],
        "last_event_id": got["last_event_id"],
        "updated_at": _parsed(got["updated_at"]),
        "last_registered_version": got["last_registered_version"],
        "last_registered_at": _parsed(got["last_registered_at"]),
    } == {
        "champion": state.champion,
        "candidate": state.candidate,
        "phase": state.status_phase,
        "step": state.step_index,
        "candidate_pct": candidate_pct,
        "last_analysis": state.last_analysis,
        "last_event_id": state.last_event_id,
        "updated_at": _ts(state.updated_at),
        "last_registered_version": state.last_registered_version,
        "last_registered_at": _ts(state.last_registered_at),
    }
    replicas = {
        r["replica_id"]: {
            "url": r["url"],
            "status": r["status"],
            "champion_version": r["champion_version"],
            "candidate_version": r["candidate_version"],
            "traffic_pct": r["traffic_pct"],
            "details": r["details"],
            "last_heartbeat": _parsed(r["last_heartbeat"]),
        }
        for r in got["replicas"]
    }
    assert replicas == {
        rid: {
            "url": r.url,
            "status": r.status,
            "champion_version": r.champion_version,
            "candidate_version": r.candidate_version,
            "traffic_pct": r.traffic_pct,
            "details": r.details,
            "last_heartbeat": _ts(r.last_heartbeat),
        }
        for rid, r in state.replicas.items()
    }
    for version in VERSIONS:
        resp = api.get(f"/v1/models/{version}", model=state.model)
        if version not in state.versions:
            assert resp.status_code == 404, (version, resp.json())
            continue
        body, vs = resp.json(), state.versions[version]
        assert {
            "status": body["rollout"]["status"],
            "parent_version": body["lineage"]["parent_version"],
            "run_id": body["lineage"]["run_id"],
            "rollouts_consumed": body["lineage"]["rollouts_consumed"],
            "reward_spec": body["lineage"]["reward_spec"],
            "lineage": body["lineage"]["details"],
            "gate": body["gate"],
            "online": body["online"],
            "created_at": _parsed(body["created_at"]),
            "updated_at": _parsed(body["updated_at"]),
        } == {
            "status": vs.status,
            "parent_version": vs.parent_version,
            "run_id": vs.run_id,
            "rollouts_consumed": vs.rollouts_consumed,
            "reward_spec": vs.reward_spec,
            "lineage": vs.lineage,
            "gate": vs.gate,
            "online": vs.online,
            "created_at": _ts(vs.created_at),
            "updated_at": _ts(vs.updated_at),
        }, f"version {version}"


def test_the_status_api_serves_the_folds_state(api: Api) -> None:
    """For 150 random deployment logs, the status API serves what the one fold of the log says.
    Needs up to a minute on PostgreSQL: each example projects its log through the database and
    reads it back over HTTP."""

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(specs=sequences())
    def check(specs: list[dict[str, Any]]) -> None:
        model = f"m-{uuid.uuid4().hex[:10]}"
        events = build(specs, model)
        api.project(events)
        assert_api_serves(api, replay(model, events))

    check()
