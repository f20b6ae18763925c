"""A realistic sequence of deployment events shared by the unit and integration tests.

Two models. `flywheel-policy`: v1 bootstrapped as champion, v2 passes every canary step and is
promoted, v3 fails the gate, v4 is rolled back automatically, v5 aborted by an operator, then
the champion is moved back to v1 in the MLflow UI. Replicas sync, fail once and heartbeat.
One event is re-published with the same event_id (the projections must count it once).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app.contracts.deployments import DeploymentEvent

T0 = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)
MODEL = "flywheel-policy"
OTHER = "other-policy"


GATE_OK = {
    "snips": 0.31,
    "dr": 0.30,
    "ci95": [0.27, 0.35],
    "ess": 812.5,
    "kl": 0.004,
    "checks": {"nan": False},
}
ANALYSIS_BETTER = {
    "candidate": {"reward_mean": 0.42, "n": 900},
    "champion": {"reward_mean": 0.38, "n": 8100},
    "lower_bound": 0.01,
    "verdict": "better",
}
ANALYSIS_WORSE = {
    "candidate": {"reward_mean": 0.11, "n": 700},
    "champion": {"reward_mean": 0.40, "n": 6000},
    "upper_bound": -0.2,
    "verdict": "worse",
}


class _Events:
    """Builds the scenario's events one minute apart, in the order they are made."""

    def __init__(self, model: str, other: str) -> None:
        self.model, self.other = model, other
        self.t = iter(T0 + timedelta(minutes=i) for i in range(1000))

    def ev(self, type_: str, version: str | None = None, **kw) -> DeploymentEvent:
        kw.setdefault("model", self.model)
        kw.setdefault("source", "controller")
        kw.setdefault("actor", "controller")
        return DeploymentEvent(type=type_, version=version, ts=next(self.t), **kw)

    def registered(self, v: str, parent: str | None, consumed: int) -> DeploymentEvent:
        return self.ev(
            "version_registered",
            v,
            from_version=parent,
            source="trainer",
            actor="trainer-0",
            details={
                "run_id": f"run-{v}",
                "rollouts_consumed": consumed,
                "reward_spec": "v1",
                "offsets": {"0": [consumed - 100 if consumed else 0, consumed]},
                "delta_bytes": 1234,
            },
        )

    def synced(self, version: str, replica: str, **details) -> DeploymentEvent:
        return self.ev(
            "replica_synced",
            version,
            source="replica",
            actor=replica,
            details={"replica_id": replica, **details},
        )

    def shifted(self, version: str, pct: float, step: int, analysis: dict) -> DeploymentEvent:
        return self.ev(
            "traffic_shifted",
            version,
            traffic_pct=pct,
            details={"step": step, "analysis": analysis},
        )


def _bootstrap(e: _Events) -> list[DeploymentEvent]:
    """v1 registered, made champion in the MLflow UI, synced by both replicas."""
    return [
        e.registered("1", None, 0),
        e.ev(
            "alias_changed",
            "1",
            source="mlflow-ui",
            actor="alice",
            reason="bootstrap",
            details={"alias": "champion"},
        ),
        e.synced("1", "r-a", url="http://r-a:8001"),
        e.synced("1", "r-b", url="http://r-b:8001"),
    ]


def _v2_promoted(e: _Events) -> list[DeploymentEvent]:
    """v2 passes the gate and every canary step and is promoted (the last event)."""
    return [
        e.registered("2", "1", 5000),
        e.ev("gate_passed", "2", details=GATE_OK),
        e.ev("canary_started", "2", from_version="1", traffic_pct=5.0, details={"step": 0}),
        e.synced("2", "r-a", slot="candidate"),
        e.shifted("2", 25.0, 1, ANALYSIS_BETTER),
        e.shifted("2", 50.0, 2, ANALYSIS_BETTER),
        e.shifted("2", 100.0, 3, ANALYSIS_BETTER),
        e.ev("promoted", "2", from_version="1", reason="candidate better at every step"),
    ]


def _v3_to_v5(e: _Events) -> list[DeploymentEvent]:
    """A heartbeat on v2, the other model's v1; v3 fails the gate, v4 is paused, resumed and
    rolled back, v5 aborted by an operator and a replica fails to sync it."""
    return [
        e.ev(
            "replica_heartbeat",
            "2",
            source="replica",
            actor="r-a",
            details={"replica_id": "r-a", "champion_version": "2", "candidate_version": None},
            traffic_pct=0.0,
        ),
        e.ev("version_registered", "1", model=e.other, source="trainer", details={"run_id": "o-1"}),
        e.registered("3", "2", 9000),
        e.ev("gate_failed", "3", details={"checks": {"nan": True}, "reason": "NaN in weights"}),
        e.registered("4", "2", 12000),
        e.ev("gate_passed", "4", details=GATE_OK),
        e.ev("canary_started", "4", from_version="2", traffic_pct=5.0, details={"step": 0}),
        e.ev(
            "canary_paused",
            "4",
            reason="inconclusive at deadline",
            details={"analysis": {"verdict": "inconclusive"}},
        ),
        e.ev("canary_resumed", "4", source="api", actor="bob", reason="give it more time"),
        e.shifted("4", 25.0, 1, ANALYSIS_WORSE),
        e.ev("rolled_back", "2", from_version="4", reason="candidate worse than champion"),
        e.registered("5", "2", 15000),
        e.ev("gate_passed", "5", details=GATE_OK),
        e.ev("canary_started", "5", from_version="2", traffic_pct=5.0),
        e.ev("aborted", "5", source="api", actor="alice", reason="manual abort"),
        e.ev(
            "replica_sync_failed",
            "5",
            source="replica",
            actor="r-b",
            details={
                "replica_id": "r-b",
                "slot": "candidate",
                "error": "sha256 mismatch on layers.0.w",
            },
        ),
    ]


def _champion_moved_back(e: _Events) -> list[DeploymentEvent]:
    """A heartbeat, the champion alias moved back to v1 in the MLflow UI (a rollback), and the
    other model's v2."""
    return [
        e.ev(
            "replica_heartbeat",
            "2",
            source="replica",
            actor="r-b",
            details={"replica_id": "r-b", "champion_version": "2"},
        ),
        e.ev(
            "alias_changed",
            "1",
            from_version="2",
            source="mlflow-ui",
            actor="alice",
            reason="moved in the UI",
            details={"alias": "champion"},
        ),
        e.ev(
            "rolled_back",
            "1",
            from_version="2",
            reason="champion alias moved to 1 in the MLflow UI",
        ),
        e.ev(
            "version_registered",
            "2",
            model=e.other,
            from_version="1",
            source="trainer",
            details={"run_id": "o-2"},
        ),
    ]


def scenario_events(model: str = MODEL, other: str = OTHER) -> list[DeploymentEvent]:
    """The module docstring's story, in order (each event one minute after the previous)."""
    e = _Events(model, other)
    events = _bootstrap(e)
    events += (v2 := _v2_promoted(e))
    events += _v3_to_v5(e)
    events += _champion_moved_back(e)
    events.append(v2[-1])  # v2's promotion re-published with the same event_id: must be a no-op
    return events


EXPECTED_STATUS = {
    "1": "champion",
    "2": "rolled_back",
    "3": "gate_failed",
    "4": "rolled_back",
    "5": "aborted",
}
