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


def scenario_events(model: str = MODEL, other: str = OTHER) -> list[DeploymentEvent]:
    t = iter(T0 + timedelta(minutes=i) for i in range(1000))

    def ev(type_: str, version: str | None = None, **kw) -> DeploymentEvent:
        kw.setdefault("model", model)
        kw.setdefault("source", "controller")
        kw.setdefault("actor", "controller")
        return DeploymentEvent(type=type_, version=version, ts=next(t), **kw)

    def registered(v: str, parent: str | None, consumed: int) -> DeploymentEvent:
        return ev(
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

    gate_ok = {
        "snips": 0.31,
        "dr": 0.30,
        "ci95": [0.27, 0.35],
        "ess": 812.5,
        "kl": 0.004,
        "checks": {"nan": False},
    }
    analysis_better = {
        "candidate": {"reward_mean": 0.42, "n": 900},
        "champion": {"reward_mean": 0.38, "n": 8100},
        "lower_bound": 0.01,
        "verdict": "better",
    }
    analysis_worse = {
        "candidate": {"reward_mean": 0.11, "n": 700},
        "champion": {"reward_mean": 0.40, "n": 6000},
        "upper_bound": -0.2,
        "verdict": "worse",
    }
    events = [
        registered("1", None, 0),
        ev(
            "alias_changed",
            "1",
            source="mlflow-ui",
            actor="alice",
            reason="bootstrap",
            details={"alias": "champion"},
        ),
        ev(
            "replica_synced",
            "1",
            source="replica",
            actor="r-a",
            details={"replica_id": "r-a", "url": "http://r-a:8001"},
        ),
        ev(
            "replica_synced",
            "1",
            source="replica",
            actor="r-b",
            details={"replica_id": "r-b", "url": "http://r-b:8001"},
        ),
        registered("2", "1", 5000),
        ev("gate_passed", "2", details=gate_ok),
        ev("canary_started", "2", from_version="1", traffic_pct=5.0, details={"step": 0}),
        ev(
            "replica_synced",
            "2",
            source="replica",
            actor="r-a",
            details={"replica_id": "r-a", "slot": "candidate"},
        ),
        ev(
            "traffic_shifted",
            "2",
            traffic_pct=25.0,
            details={"step": 1, "analysis": analysis_better},
        ),
        ev(
            "traffic_shifted",
            "2",
            traffic_pct=50.0,
            details={"step": 2, "analysis": analysis_better},
        ),
        ev(
            "traffic_shifted",
            "2",
            traffic_pct=100.0,
            details={"step": 3, "analysis": analysis_better},
        ),
        promoted_v2 := ev(
            "promoted", "2", from_version="1", reason="candidate better at every step"
        ),
        ev(
            "replica_heartbeat",
            "2",
            source="replica",
            actor="r-a",
            details={"replica_id": "r-a", "champion_version": "2", "candidate_version": None},
            traffic_pct=0.0,
        ),
        ev("version_registered", "1", model=other, source="trainer", details={"run_id": "o-1"}),
        registered("3", "2", 9000),
        ev("gate_failed", "3", details={"checks": {"nan": True}, "reason": "NaN in weights"}),
        registered("4", "2", 12000),
        ev("gate_passed", "4", details=gate_ok),
        ev("canary_started", "4", from_version="2", traffic_pct=5.0, details={"step": 0}),
        ev(
            "canary_paused",
            "4",
            reason="inconclusive at deadline",
            details={"analysis": {"verdict": "inconclusive"}},
        ),
        ev("canary_resumed", "4", source="api", actor="bob", reason="give it more time"),
        ev(
            "traffic_shifted",
            "4",
            traffic_pct=25.0,
            details={"step": 1, "analysis": analysis_worse},
        ),
        ev("rolled_back", "2", from_version="4", reason="candidate worse than champion"),
        registered("5", "2", 15000),
        ev("gate_passed", "5", details=gate_ok),
        ev("canary_started", "5", from_version="2", traffic_pct=5.0),
        ev("aborted", "5", source="api", actor="alice", reason="manual abort"),
        ev(
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
        ev(
            "replica_heartbeat",
            "2",
            source="replica",
            actor="r-b",
            details={"replica_id": "r-b", "champion_version": "2"},
        ),
        ev(
            "alias_changed",
            "1",
            from_version="2",
            source="mlflow-ui",
            actor="alice",
            reason="moved in the UI",
            details={"alias": "champion"},
        ),
        ev(
            "rolled_back",
            "1",
            from_version="2",
            reason="champion alias moved to 1 in the MLflow UI",
        ),
        ev(
            "version_registered",
            "2",
            model=other,
            from_version="1",
            source="trainer",
            details={"run_id": "o-2"},
        ),
    ]
    events.append(promoted_v2)  # re-published with the same event_id: must be a no-op
    return events


EXPECTED_STATUS = {
    "1": "champion",
    "2": "rolled_back",
    "3": "gate_failed",
    "4": "rolled_back",
    "5": "aborted",
}
