"""The session ledger's version metrics (streams/ledger.py `LedgerMetrics`): a session that ends
with an outcome is counted once, in the version that served its last turn and the bucket of its
end, and goes out as a partial of stage "sessions" that the aggregate stage's merger adds to the
bucket's closed labels; once across restarts and replays."""

from __future__ import annotations

import random
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.contracts.rollouts import SESSION_SUM_FIELDS, SUM_FIELDS, VersionMetrics, empty_sums
from streams.labels import MetricsMerger, Partial, partial_record
from streams.ledger import Emit, Ledger, LedgerConfig, LedgerMetrics
from tests.unit.streams.test_ledger import (
    BOUNDED,
    EOS,
    V2,
    _mixed_workload,
    agent_session,
    outcome_event,
    rollouts,
    turn_rec,
)

BUCKET = 60.0


def metered(
    cfg: LedgerConfig | None = None,
    table: dict | None = None,
    markers: dict | None = None,
    partition: int = 3,
    bucket: float = BUCKET,
) -> Ledger:
    """A ledger that counts ended sessions into `bucket`-second buckets of turns partition
    `partition`."""
    return Ledger(
        cfg or LedgerConfig(),
        {} if table is None else table,
        V2,
        LedgerMetrics(bucket, partition, V2.version, {} if markers is None else markers),
    )


def partials(out: list[Emit]) -> list[dict[str, Any]]:
    return [e.value for e in out if e.topic == "partials"]


def session_part(p: dict[str, Any]) -> dict[str, float]:
    """The sums of a session partial: the session fields only (the merger adds them to the
    bucket's per-completion sums)."""
    assert tuple(p["sums"]) == SESSION_SUM_FIELDS, p
    return p["sums"]


def sums(n=1.0, success=0.0, give_up=0.0, turns=0.0, tokens=0.0, errors=0.0) -> dict[str, float]:
    return dict(zip(SESSION_SUM_FIELDS, (n, success, give_up, turns, tokens, errors), strict=True))


def test_a_session_that_ends_with_an_outcome_is_one_partial_of_its_last_turns_version():
    recs = agent_session("s1", 3)
    recs[1]["tool_errors"] = [{"message": "boom", "hint": None, "token_index": 0}]
    recs[2]["model_version"] = "v8"  # the canary moved the session: its last turn served by v8
    markers: dict = {}
    ledger = metered(markers=markers)
    out = [e for i, r in enumerate(recs) for e in ledger.on_rollout(r, 1000.0 + i)]
    out += ledger.on_outcome(outcome_event("s1", "s1-t2", "success"), 1003.0)
    assert len(rollouts(out)) == 1 and partials(out) == [], "the bucket [960, 1020) is still open"
    assert ledger.session("s1").bucket == 960.0 and ledger.counts["sessions_counted"] == 1
    assert partials(ledger.advance(1019.9)) == []
    out = ledger.advance(1020.0)
    [p] = partials(out)
    assert [e.key for e in out if e.topic == "partials"] == [
        "v8"
    ]  # keyed like the labels' partials
    Partial.model_validate(p)
    assert {k: p[k] for k in p if k != "sums"} == {
        "model_version": "v8",
        "bucket_start": 960.0,
        "bucket_seconds": BUCKET,
        "partition": 3,
        "reward_spec": "sessions-v1",
        "stage": "sessions",
    }
    assert session_part(p) == sums(success=1.0, turns=3.0, tokens=9.0, errors=1.0)
    assert markers.keys() == {"960.0"}, markers
    assert partials(ledger.advance(5000.0)) == [], "a bucket goes out once"


def test_a_session_of_several_segments_is_counted_once():
    """A compacted history splits the session into two records that share the outcome: one session."""
    recs = agent_session("s1", 3)
    recs[2]["prompt_tokens"] = [1, 2, 3, 9]
    ledger = metered()
    out = [e for i, r in enumerate(recs) for e in ledger.on_rollout(r, 1.0 + i)]
    out += ledger.on_outcome(outcome_event("s1", "s1-t2", "failure"), 9.0)
    out += ledger.advance(120.0)
    assert [r["outcome"] for r in rollouts(out)] == ["failure", "failure"]
    [p] = partials(out)
    assert session_part(p) == sums(turns=3.0, tokens=9.0), p


def test_an_abandoned_session_whose_last_turn_never_comes_counts_at_the_time_it_was_due():
    """The end falls in the bucket of outcome + idle (70 s: [60, 120)), not in that of the
    tick that found it (200 s): a replay whose ticks come at other times counts it the same."""
    recs = agent_session("s1", 3)
    ledger = metered(LedgerConfig(idle_s=60, retention_s=600))
    out = ledger.on_rollout(recs[0], 1.0) + ledger.on_rollout(recs[1], 2.0)
    out += ledger.on_outcome(outcome_event("s1", "s1-t2", "abandoned"), 10.0)
    out += ledger.advance(200.0)
    [p] = partials(out)
    assert p["bucket_start"] == 60.0 and session_part(p) == sums(give_up=1.0, turns=2, tokens=6)
    again = metered(LedgerConfig(idle_s=60, retention_s=600))
    out = again.on_rollout(recs[0], 1.0) + again.on_rollout(recs[1], 2.0)
    out += again.on_outcome(outcome_event("s1", "s1-t2", "abandoned"), 10.0)
    out += again.advance(75.0) + again.advance(130.0)
    assert partials(out) == [p]


def test_sessions_without_an_outcome_are_not_counted_and_an_ended_one_with_one_is():
    ledger = metered(LedgerConfig(idle_s=60, retention_s=600))
    idle, ended, pending = (
        agent_session("idle", 2),
        agent_session("ended", 2),
        agent_session("p", 2),
    )
    out = []
    for i, r in enumerate([*idle, *ended, *pending[:1]]):
        out += ledger.on_rollout(r, 1.0 + i)
    out += ledger.end_session("ended", 6.0)  # the client ended it, without an outcome
    out += ledger.on_outcome(outcome_event("p", "p-t1", "success"), 7.0)  # its turn 1 not in yet
    out += ledger.end_session("p", 8.0)  # ended before that turn came: its outcome is known
    out += ledger.advance(200.0)
    assert len(rollouts(out)) == 3
    [p] = partials(out)
    assert session_part(p) == sums(success=1.0, turns=1.0, tokens=3.0), p


def test_an_outcome_after_the_session_closed_idle_is_late_for_the_trainer_but_counted():
    [rec] = agent_session("s1", 1)
    ledger = metered(LedgerConfig(idle_s=60, retention_s=600))
    out = ledger.on_rollout(rec, 1.0) + ledger.advance(100.0)
    assert rollouts(out)[0]["segment_closed_by"] == "idle"
    out = ledger.on_outcome(outcome_event("s1", "s1-t0", "abandoned"), 101.0)
    assert [e.value["reason"] for e in out if e.topic == "late"] == ["after_close"]
    [p] = partials(ledger.advance(180.0))
    assert p["bucket_start"] == 60.0 and session_part(p) == sums(give_up=1.0, turns=1, tokens=3)


def test_an_outcome_for_a_session_that_served_no_turn_is_not_counted():
    ledger = metered(LedgerConfig(idle_s=60, retention_s=600))
    out = ledger.on_outcome(outcome_event("ghost", "ghost-t3"), 1.0) + ledger.advance(500.0)
    assert partials(out) == [] and ledger.counts["sessions_counted"] == 0


def test_sessions_of_one_bucket_go_out_per_version_and_other_buckets_apart():
    ledger = metered()
    out = []
    for sid, version, outcome, t in (
        ("a", "v7", "success", 10.0),
        ("b", "v8", "failure", 20.0),
        ("c", "v7", "abandoned", 30.0),
        ("d", "v7", "success", 70.0),
    ):
        [rec] = agent_session(sid, 1)
        rec["model_version"] = version
        out += ledger.on_rollout(rec, t) + ledger.on_outcome(
            outcome_event(sid, f"{sid}-t0", outcome), t
        )
    out += ledger.advance(1000.0)
    got = [(p["model_version"], p["bucket_start"], session_part(p)) for p in partials(out)]
    assert got == [
        ("v7", 0.0, sums(n=2.0, success=1.0, give_up=1.0, turns=2, tokens=6)),
        ("v8", 0.0, sums(turns=1, tokens=3)),
        ("v7", 60.0, sums(success=1.0, turns=1, tokens=3)),
    ], got


def _snapshot(table: dict, markers: dict) -> tuple[dict, dict]:
    """What a restarted stage recovers: JSON copies of its tables."""
    return orjson.loads(orjson.dumps(table)), orjson.loads(orjson.dumps(markers))


def test_a_restart_counts_a_session_once_whatever_the_state_kept():
    """Outputs go before the state, the sessions changelog before the markers: a crash can leave
    (a) neither the end nor the marker, (b) the end but not the marker, (c) both. Replaying the
    records after each gives the bucket's sums once (the merger keeps the latest partial of
    (stage, partition) in a bucket, so a partial sent again replaces an identical one)."""
    recs = [*agent_session("s1", 2), outcome_event("s1", "s1-t1")]
    table, markers = {}, {}
    ledger = metered(table=table, markers=markers)
    ledger.on_rollout(recs[0], 10.0)
    before_end = _snapshot(table, markers)
    first = ledger.on_rollout(recs[1], 11.0) + ledger.on_outcome(recs[2], 12.0)
    after_end = _snapshot(table, markers)
    first += ledger.advance(61.0)
    [sent] = partials(first)
    after_marker = _snapshot(table, markers)

    def replay(state: tuple[dict, dict]) -> list[dict]:
        t, m = state
        led = metered(table=t, markers=m)
        out = led.on_rollout(recs[1], 11.0) + led.on_outcome(recs[2], 12.0) + led.advance(61.0)
        return partials(out + led.advance(4000.0))

    assert replay(before_end) == [sent], (
        "(a) counted again from the state before the end: same sums"
    )
    assert replay(after_end) == [sent], (
        "(b) the end survived, the marker not: the same partial again"
    )
    assert replay(after_marker) == [], "(c) it went out: nothing again"
    assert session_part(sent) == sums(success=1.0, turns=2, tokens=6)


def _merged(out: list[Emit]) -> dict[tuple[str, float], dict[str, float]]:
    """The merger's view of the partials of one partition: the latest per (version, bucket)."""
    merged: dict[tuple[str, float], dict[str, float]] = {}
    for p in partials(out):
        merged[p["model_version"], p["bucket_start"]] = session_part(p)
    return merged


def _feed_metered(
    recs: list[dict[str, Any]], crash: tuple[int, int] | None = None, cfg: LedgerConfig = BOUNDED
) -> tuple[list[Emit], int]:
    """`_feed` of tests/unit/streams/test_ledger.py with metrics on. With `crash` (k, m): after
    record k the state is snapshotted; records k..m-1 are applied and their outputs sent, then
    the worker dies before it persisted their state: a new ledger on the snapshot replays from k.
    Returns the outputs and the sessions the last ledger counted. Buckets of 10 s (5 records)."""
    table, markers = {}, {}
    ledger, out = metered(cfg, table, markers, bucket=10.0), []
    snapshot, i = None, 0
    while i < len(recs):
        if crash is not None and i == crash[0] and snapshot is None:
            snapshot = _snapshot(table, markers)
        if crash is not None and i == crash[1] and snapshot is not None:
            table, markers = snapshot
            ledger, i, crash = metered(cfg, table, markers, bucket=10.0), crash[0], None
        rec, now = recs[i], 100.0 + 2.0 * i
        if rec.get("type") == "session_outcome":
            out += ledger.on_outcome(rec, now)
        else:
            out += ledger.on_rollout(rec, now)
        i += 1
    t = 100.0 + 2.0 * len(recs)
    for sid in sorted({r["session_id"] for r in recs}):
        out += ledger.end_session(sid, t)
    return out + ledger.advance(t + 1000.0), ledger.counts["sessions_counted"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(0, 30), m=st.integers(0, 30))
def test_a_crash_between_outputs_and_state_replayed_gives_the_same_session_sums(seed, k, m):
    recs = _mixed_workload(seed)
    clean, counted = _feed_metered(recs)
    crashed, _ = _feed_metered(recs, (min(k, m), max(k, m)))
    assert _merged(crashed) == _merged(clean)
    assert sum(s["sessions_n"] for s in _merged(clean).values()) == counted, "all went out"
    outcomes = {r["session_id"] for r in recs if r.get("type") == "session_outcome"}
    assert counted <= len(outcomes), "a session is counted at most once"
    ended = {r["session_id"] for r in rollouts(clean) if "outcome" in r}
    assert counted >= len(ended), "a session whose records carry its outcome is counted"


def test_the_merger_adds_a_session_partial_to_the_buckets_labels_and_replaces_it_on_redelivery():
    labels = dict(empty_sums(), n=4.0, reward_sum=2.0, reward_sumsq=1.5, accepts=3.0)
    merger = MetricsMerger({})
    first = merger.on_partial(partial_record("v8", 960.0, BUCKET, 3, "sessions-v1", labels))
    session = dict(empty_sums(), **sums(n=2.0, success=1.0, give_up=1.0, turns=5, tokens=40))
    merged = merger.on_partial(
        partial_record("v8", 960.0, BUCKET, 3, "sessions-v1", session, "sessions")
    )
    again = merger.on_partial(
        partial_record("v8", 960.0, BUCKET, 3, "sessions-v1", session, "sessions")
    )
    assert first.value["session_partitions"] == [] and first.value["task_success_rate"] is None
    assert again == merged, "a partial sent again replaces the identical one"
    rec = VersionMetrics.model_validate(merged.value)
    assert rec.partitions == [3] and rec.session_partitions == [3], "partition 3 twice, apart"
    assert rec.n == 4 and rec.sums["accepts"] == 3.0 and rec.sums["sessions_n"] == 2.0
    assert (rec.task_success_rate, rec.give_up_rate, rec.mean_session_turns) == (0.5, 0.5, 2.5)
    assert rec.mean_session_tokens == 20.0 and rec.session_tool_error_rate == 0.0
    later = dict(session, **sums(n=3.0, success=2.0, give_up=1.0, turns=6, tokens=48))
    rec = VersionMetrics.model_validate(
        merger.on_partial(
            partial_record("v8", 960.0, BUCKET, 3, "sessions-v1", later, "sessions")
        ).value
    )
    assert rec.sums["sessions_n"] == 3.0 and rec.n == 4, "the later partial replaced the first"


def test_records_and_partials_written_before_the_session_sums_still_parse():
    old = {
        "bucket_id": "v8/960/60",
        "model_version": "v8",
        "bucket_start": 960.0,
        "bucket_seconds": 60.0,
        "reward_spec": "v1",
        "partitions": [0],
        "sums": {k: 1.0 for k in SUM_FIELDS if k not in SESSION_SUM_FIELDS},
        "n": 1,
        **dict.fromkeys(
            (
                "accept_rate reject_rate mean_persistence mean_rating mean_followup reward_mean "
                "reward_variance tool_error_rate empty_completion_rate mean_completion_length"
            ).split(),
            1.0,
        ),
    }
    rec = VersionMetrics.model_validate(old)
    assert rec.session_partitions == [] and rec.task_success_rate is None
    partial = {
        k: old[k] for k in ("model_version", "bucket_start", "bucket_seconds", "reward_spec")
    }
    merged = MetricsMerger({}).on_partial({**partial, "partition": 0, "sums": old["sums"]})
    assert merged.value["sums"]["sessions_n"] == 0.0 and merged.value["n"] == 1


def test_a_partials_version_is_the_last_applied_turns_even_after_a_rewritten_history():
    """A client that compacted its history calls again on turn 1 later: that call was the
    session's last, so its version is the one the session is counted in."""
    recs = agent_session("s1", 3)
    compacted = turn_rec(
        "s1", 1, [1, 2, 3, 9], [7, 8, EOS], rid="s1-c", generated_at="2099-01-01T00:00:00Z"
    )
    compacted["model_version"] = "v9"
    ledger = metered()
    out = [e for i, r in enumerate([*recs, compacted]) for e in ledger.on_rollout(r, 1.0 + i)]
    out += ledger.on_outcome(outcome_event("s1", "s1-c"), 9.0) + ledger.advance(200.0)
    [p] = partials(out)
    assert p["model_version"] == "v9" and session_part(p) == sums(success=1, turns=4, tokens=12)


def test_random_sessions_count_each_ended_session_once():
    rng = random.Random(7)
    ledger, expected, out = metered(LedgerConfig(idle_s=60, retention_s=600)), 0, []
    for s in range(40):
        recs = agent_session(f"s{s}", rng.randint(1, 4))
        t = 10.0 * s
        for i, r in enumerate(recs):
            out += ledger.on_rollout(r, t + i)
        if rng.random() < 0.7:
            ev = outcome_event(f"s{s}", recs[-1]["request_id"], rng.choice(["success", "failure"]))
            out += ledger.on_outcome(ev, t + 5) + ledger.on_outcome(ev, t + 6)  # and a duplicate
            expected += 1
    out += ledger.advance(5000.0)
    assert sum(s["sessions_n"] for s in _merged(out).values()) == expected


def test_a_session_that_ends_into_a_bucket_already_sent_sends_it_again_also_after_a_restart():
    """A turns record stamped behind the ledger's time (the ticks' clock ran ahead of its
    producer's) ends a session in a bucket whose partial went out: the whole bucket goes again,
    and the merger's copy is replaced; a restart in between still sends it (the marker counted
    one session, the bucket now holds two)."""
    table, markers = {}, {}
    ledger = metered(table=table, markers=markers)
    [a] = agent_session("a", 1)
    ledger.on_rollout(a, 70.0)
    out = ledger.on_outcome(outcome_event("a", "a-t0"), 71.0) + ledger.advance(130.0)
    [first] = partials(out)
    assert first["bucket_start"] == 60.0 and session_part(first)["sessions_n"] == 1.0
    [b] = agent_session("b", 1)
    ledger.on_rollout(b, 100.0)  # behind the ledger's time (130): ends in [60, 120)
    assert partials(ledger.on_outcome(outcome_event("b", "b-t0", "failure"), 100.0)) == []
    state = _snapshot(table, markers)
    [again] = partials(ledger.advance(131.0))
    assert again["bucket_start"] == 60.0 and session_part(again) == sums(
        n=2.0, success=1.0, turns=2, tokens=6
    )
    restarted = metered(table=state[0], markers=state[1])
    assert partials(restarted.advance(131.0)) == [again]
