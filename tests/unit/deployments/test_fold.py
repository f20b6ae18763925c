"""The one fold of the deployment log (app/contracts/deployment_state.py): the rules where the
controller's fold and the projector once differed (docs/DEPLOYMENTS.md, "One fold"), and that
the fold is pure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app.contracts.deployment_state import DeploymentState, fold, replay
from app.contracts.deployments import DeploymentEvent

T0 = datetime(2026, 3, 1, tzinfo=UTC)
M = "m"


def ev(type_: str, version: str | None, i: int = 0, **kw) -> DeploymentEvent:
    kw.setdefault("source", "controller")
    if type_ in ("canary_started", "traffic_shifted"):
        kw.setdefault("traffic_pct", 5.0)
    return DeploymentEvent(type=type_, model=M, version=version, ts=T0 + timedelta(seconds=i), **kw)


def canary(candidate: str = "2", champion: str = "1") -> DeploymentState:
    return replay(
        M,
        [
            ev("promoted", champion, 0),
            ev("version_registered", candidate, 1, source="trainer"),
            ev("gate_passed", candidate, 2),
            ev("canary_started", candidate, 3, from_version=champion),
        ],
    )


def test_a_rollback_without_from_version_marks_the_candidate_bad() -> None:
    s = fold(canary(), ev("rolled_back", "1", 10))
    assert (s.champion, s.candidate, s.phase) == ("1", None, "idle")
    assert s.versions["2"].status == "rolled_back" and s.failed == ["2"]
    assert s.versions["1"].status == "champion" and "2" not in s.known_good


def test_a_rollback_without_canary_or_from_version_marks_the_old_champion_bad() -> None:
    s = replay(M, [ev("promoted", "1", 0), ev("promoted", "2", 1), ev("rolled_back", "1", 2)])
    assert (s.champion, s.failed, s.versions["2"].status) == ("1", ["2"], "rolled_back")
    assert s.rollback_targets(3) == []


def test_a_rollback_never_marks_the_version_it_rolls_back_to() -> None:
    s = replay(M, [ev("promoted", "1", 0), ev("rolled_back", "1", 1, from_version="1")])
    assert (s.champion, s.failed, s.versions["1"].status) == ("1", [], "champion")


def test_canary_started_does_not_move_the_champion() -> None:
    s = replay(
        M,
        [
            ev("promoted", "1", 0),
            ev("canary_started", "3", 1, from_version="2"),
        ],
    )
    assert (s.champion, s.candidate) == ("1", "3")
    s = fold(DeploymentState(model=M), ev("canary_started", "3", 1, from_version="2"))
    assert (s.champion, s.candidate) == (None, "3")


def test_a_canary_at_full_traffic_is_promoting_for_the_status_api_only() -> None:
    s = fold(canary(), ev("traffic_shifted", "2", 10, traffic_pct=100.0, details={"step": 3}))
    assert (s.phase, s.status_phase, s.step_index) == ("canary", "promoting", 3)
    paused = fold(s, ev("canary_paused", "2", 11))
    assert (paused.phase, paused.status_phase) == ("paused", "paused")
    resumed = fold(paused, ev("canary_resumed", "2", 12))
    assert resumed.status_phase == "promoting"


def test_promoting_or_aborting_another_version_ends_the_canary() -> None:
    for type_ in ("promoted", "aborted"):
        s = fold(canary(), ev(type_, "5", 10))
        assert (s.candidate, s.phase, s.traffic_pct, s.step_index) == (None, "idle", 0.0, None)


def test_the_fold_is_pure_and_ignores_other_models() -> None:
    s = canary()
    before = s.model_dump()
    after = fold(s, ev("promoted", "2", 10))
    assert s.model_dump() == before and after.champion == "2"
    other = DeploymentEvent(type="promoted", model="other", version="9", source="controller")
    assert fold(s, other) is s


def test_replay_counts_an_event_id_once() -> None:
    e = ev("canary_started", "2", 3, details={"step": 0})
    shifted = ev("traffic_shifted", "2", 4, traffic_pct=25.0)
    s = replay(M, [ev("promoted", "1"), e, shifted, shifted])
    assert (s.step, s.traffic_pct) == (1, 25.0)
