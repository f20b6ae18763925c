"""`GET /v1/sessions/{session_id}` and the lineage counts of `GET /v1/models/{version}` over real
HTTP (httpx ASGI transport) on SQLite and PostgreSQL, with the sessions projection and the
deployment projections built by the projector's own apply functions."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from app.contracts.deployments import DeploymentEvent, LoggedEvent
from app.projector.projector import apply_events
from app.projector.sessions import apply_rollout
from tests.integration.deployments.test_status_api import StatusApi, api  # noqa: F401  (fixture)
from tests.unit.deployments.rollout_records import (
    compacted_session,
    logged,
    one_call,
    segment,
    weakened_segment,
)
from tests.unit.deployments.scenario import MODEL

pytestmark = pytest.mark.integration


def _project(api: StatusApi, records: list[tuple[dict, int, int]], events=()) -> None:
    """Project rollout records at their (partition, offset) and deployment events."""
    engine = sa.create_engine(api.db_url)
    with Session(engine) as s:
        for rec, partition, offset in records:
            apply_rollout(s, logged(rec, partition, offset))
        apply_events(s, [LoggedEvent(0, i, e) for i, e in enumerate(events)])
        s.commit()
    engine.dispose()


def _registered(api: StatusApi, version: str, consumed: int, **lineage) -> DeploymentEvent:
    """A trainer's version_registered whose lineage names ranges of the API's rollouts topic."""
    parts = lineage.pop("partitions")
    return DeploymentEvent(
        type="version_registered",
        model=MODEL,
        version=version,
        source="trainer",
        details={
            "run_id": f"run-{version}",
            "rollouts_consumed": consumed,
            "kafka_offsets": {"topic": api.settings.topic("rollouts"), "partitions": parts},
            **lineage,
        },
    )


def test_a_session_shows_its_segments_in_order_with_turns_versions_rewards_and_outcome(
    api: StatusApi,
) -> None:
    first, second, relabelled = compacted_session()
    other = one_call("c0", "editor-1", at=50.0)
    # projected out of order: the answer orders by the segments' first generation
    _project(api, [(second, 0, 4), (relabelled, 1, 7), (other, 2, 1), (first, 0, 2)])

    r = api.get("/v1/sessions/agent-1")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["session_id"], body["turns"], body["outcome"], body["versions"]) == (
        "agent-1",
        5,
        "success",
        ["2", "3"],
    ), "turns and outcome count live segments only; the relabelled copy is beside them"
    segs = body["segments"]
    assert [(s["request_id"], s["relabel_run"]) for s in segs] == [
        ("a0", None),
        ("a0", "run-9"),
        ("a3", None),
    ]
    s0, _, s2 = segs
    assert [(t["request_id"], t["model_version"], t["reward"]) for t in s0["turns"]] == [
        ("a0", "2", 0.5),
        ("a1", "2", 0.0),
        ("a2", "3", 0.25),
    ]
    assert s0["versions"] == ["2", "3"] and s0["reward"] == pytest.approx(0.75)
    assert (s0["turn_count"], s0["sampled_tokens"], s0["outcome"]) == (3, 9, None)
    assert (s2["opened_by"], s2["closed_by"], s2["outcome"], s2["outcome_reward"]) == (
        "history_rewritten",
        "end",
        "success",
        1.0,
    )
    assert s2["reward"] == pytest.approx(1.75)
    assert (s0["kafka_partition"], s0["kafka_offset"]) == (0, 2)
    assert all(s["trained_by"] is None for s in segs), "no version's lineage names them yet"

    one = api.get("/v1/sessions/editor-1").json()
    [seg] = one["segments"]
    assert (seg["turn_count"], seg["turns"][0]["request_id"], one["turns"]) == (1, "c0", 1)


def test_a_segment_shows_the_protected_writes_its_record_gives_and_null_without(
    api: StatusApi,
) -> None:
    hacked = weakened_segment("weakened", ["w0", "w1"])
    clean = segment("honest", ["h0", "h1"], ["4", "4"], [0.0, 0.25], outcome="success")
    _project(api, [(hacked, 0, 0), (clean, 0, 1)])
    [seg] = api.get("/v1/sessions/weakened").json()["segments"]
    assert (seg["reward_spec"], seg["outcome_reward"], seg["protected_writes"]) == (
        "sessions-v2",
        -1.0,
        2,
    ), seg
    [seg] = api.get("/v1/sessions/honest").json()["segments"]
    assert "protected_writes" in seg and seg["protected_writes"] is None, seg


def test_trained_by_is_the_version_whose_lineage_ranges_hold_the_record_when_it_skipped_none(
    api: StatusApi,
) -> None:
    recs = [one_call(f"r{i}", "s-trained", at=float(i)) for i in range(5)]
    events = [
        # v2 read partition 0 [0, 2) and trained on both records: exact
        _registered(api, "2", 2, partitions={"0": [0, 2]}),
        # v3 read [2, 5) but trained on 2 of the 3: which one it skipped is not known
        _registered(api, "3", 2, partitions={"0": [2, 5]}),
        # v4 read [5, 8) and lists what it skipped: offset 6
        _registered(api, "4", 2, partitions={"0": [5, 8]}, skipped_offsets={"0": [6]}),
    ]
    other_topic = _registered(api, "5", 1, partitions={"0": [8, 9]})
    other_topic.details["kafka_offsets"]["topic"] = "elsewhere.rollouts"
    _project(
        api,
        [(recs[0], 0, 1), (recs[1], 0, 3), (recs[2], 0, 5), (recs[3], 0, 6), (recs[4], 0, 8)],
        [*events, other_topic],
    )
    segs = api.get("/v1/sessions/s-trained").json()["segments"]
    got = [(s["request_id"], s["consumed_by"], s["trained_by"]) for s in segs]
    assert got == [
        ("r0", "2", "2"),
        ("r1", "3", None),
        ("r2", "4", "4"),
        ("r3", "4", None),
        ("r4", None, None),
    ], got
    other = api.get("/v1/sessions/s-trained", model="another-model").json()["segments"]
    assert {s["trained_by"] for s in other} == {None}, "versions of another model do not count"


def test_an_unknown_session_is_404_naming_it(api: StatusApi) -> None:
    _project(api, [(one_call("c0", "known"), 0, 0)])
    r = api.get("/v1/sessions/nobody")
    assert r.status_code == 404, r.text
    assert "session 'nobody' is unknown" in r.json()["detail"]
    assert api.get("/v1/sessions/" + "x" * 129).status_code == 422


def test_the_sessions_endpoint_needs_a_key_with_the_read_scope(api: StatusApi) -> None:
    _project(api, [(one_call("c0", "known"), 0, 0)])
    assert api.get("/v1/sessions/known", key=None).status_code == 401
    for key in ("ingest", "admin"):
        r = api.get("/v1/sessions/known", key=key)
        assert r.status_code == 403 and "'read'" in r.json()["detail"], r.text
    assert api.get("/v1/sessions/known").status_code == 200


def test_model_lineage_has_sessions_and_turns_trained_when_the_trainer_tagged_them(
    api: StatusApi,
) -> None:
    tagged = _registered(api, "2", 40, partitions={}, sessions_trained=7, turns_trained=31)
    untagged = _registered(api, "3", 40, partitions={})
    malformed = _registered(api, "4", 40, partitions={}, sessions_trained="7", turns_trained=True)
    _project(api, [], [tagged, untagged, malformed])
    lineage = {v: api.get(f"/v1/models/{v}").json()["lineage"] for v in ("2", "3", "4")}
    assert (lineage["2"]["sessions_trained"], lineage["2"]["turns_trained"]) == (7, 31)
    assert (lineage["3"]["sessions_trained"], lineage["3"]["turns_trained"]) == (None, None)
    assert (lineage["4"]["sessions_trained"], lineage["4"]["turns_trained"]) == (None, None)
