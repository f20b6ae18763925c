"""The join state machine (streams/labels.py) against the plain reference, without a broker.

Property tests generate requests with and without generations, random feedback, duplicated
event_ids, conflicting generations, random interleavings across two partitions, gaps around
the wait window (so feedback is early, in time, late or orphaned) and ticks, then compare
everything the aggregator emits with tests/unit/streams/reference.py.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.contracts.events import parse_event
from app.contracts.rollouts import Rollout, VersionMetrics, empty_sums, version_metrics
from streams.labels import Aggregator, MetricsMerger
from streams.reward import resolve_spec
from tests.unit.streams.factories import feedback as fb
from tests.unit.streams.factories import generation as gen
from tests.unit.streams.factories import random_feedback, tool_call
from tests.unit.streams.reference import Arrival, expected

W = 10.0


def make_agg(window=W, retention=1e9, bucket=60.0) -> Aggregator:
    return Aggregator(
        resolve_spec("v1"), window, retention, bucket, {}, {}, {}, clock=lambda: 1.8e9
    )


def drive(agg: Aggregator, steps: list[tuple]) -> list:
    """steps: ("ev", partition, rt, event) | ("tick", partition, wm); ends by closing everything."""
    out = []
    for step in steps:
        if step[0] == "ev":
            out += agg.on_event(step[1], step[3], step[2])
        else:
            out += agg.on_tick(step[1], step[2])
    for p in sorted({s[1] for s in steps}):
        out += agg.advance(p, math.inf)
    return out


def split(out):
    rollouts = [e for e in out if e.topic == "rollouts"]
    late = Counter(
        (e.value["reason"], e.value["event"]["event_id"]) for e in out if e.topic == "late"
    )
    dlq = Counter(e.value["event"]["event_id"] for e in out if e.topic == "dlq")
    return rollouts, late, dlq


def test_generation_without_feedback_closes_with_zero_and_null_components():
    agg = make_agg()
    out = agg.on_event(0, gen("r1"), 100.0)
    assert out == []
    assert agg.advance(0, 109.9) == []
    [emit] = agg.advance(0, 110.0)
    roll = Rollout.model_validate(emit.value)
    assert (roll.reward, roll.components, roll.closed_by, roll.reward_spec) == (
        0.0,
        None,
        "window",
        "v1",
    )
    assert emit.key == "r1" and roll.generated_at == gen("r1")["ts"]


def test_feedback_before_generation_waits_and_counts():
    agg = make_agg()
    assert agg.on_event(0, fb("r1", "a", "accept"), 100.0) == []
    agg.on_event(0, gen("r1"), 105.0)
    rollouts, late, _ = split(agg.advance(0, 200.0))
    assert [r.value["reward"] for r in rollouts] == [0.75] and not late


def test_orphan_and_after_close_go_to_late_and_duplicates_count_once():
    agg = make_agg()
    out = agg.on_event(0, fb("r1", "o", "rating"), 0.0)
    out += agg.on_event(0, gen("r2"), 1.0)
    out += agg.on_event(0, fb("r2", "a", "accept"), 2.0)
    out += agg.on_event(0, fb("r2", "a", "accept"), 3.0)  # duplicate
    out += agg.on_event(0, fb("r2", "late", "reject"), 11.0)  # closes r1 (orphan) and r2 first
    out += agg.on_event(0, fb("r2", "late", "reject"), 12.0)  # duplicate of a late one
    rollouts, late, dlq = split(out)
    assert [(r.key, r.value["reward"]) for r in rollouts] == [("r2", 0.75)]
    assert late == Counter({("orphan", "o"): 1, ("after_close", "late"): 1}) and not dlq
    assert agg.duplicates == 2


def test_conflicting_generation_goes_to_dlq():
    agg = make_agg()
    agg.on_event(0, gen("r1", "g1"), 0.0)
    _, _, dlq = split(agg.on_event(0, gen("r1", "g2"), 1.0))
    assert dlq == Counter({"g2": 1})


def test_closed_labels_are_forgotten_after_retention():
    agg = make_agg(retention=60.0)
    agg.on_event(0, gen("r1"), 0.0)
    agg.advance(0, 10.0)
    assert agg.labels["r1"]["st"] == "closed" and "r1" not in agg.generations
    agg.advance(0, 70.0)
    assert "r1" not in agg.labels


def test_restart_rebuilds_deadlines_from_the_tables():
    agg = make_agg()
    agg.on_event(1, gen("r1"), 0.0)
    agg.on_event(1, fb("r1", "a", "accept"), 1.0)
    fresh = Aggregator(
        agg.spec, W, 1e9, 60.0, dict(agg.labels), dict(agg.generations), dict(agg.buckets)
    )
    rollouts, _, _ = split(fresh.advance(1, 10.0))
    assert [r.value["reward"] for r in rollouts] == [0.75]


@st.composite
def scenarios(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    n_req = draw(st.integers(1, 8))
    events = []
    for i in range(n_req):
        rid = f"r{i}"
        if rng.random() < 0.8:
            events.append(
                gen(
                    rid,
                    t=rng.uniform(0, 5),
                    version=rng.choice(["v1", "v2"]),
                    n_tokens=rng.randint(1, 4),
                )
            )
            if rng.random() < 0.1:
                events.append(gen(rid, eid=f"{rid}-gen-b"))
        for j in range(rng.randint(0, 6)):
            events.append(random_feedback(rng, rid, f"{rid}-f{j}"))
    events += [dict(e) for e in events if rng.random() < 0.2]  # duplicates
    order = draw(st.permutations(list(range(len(events)))))
    gaps = draw(
        st.lists(
            st.sampled_from([0.01, 0.5, 3.0, 0.6 * W, 1.1 * W]),
            min_size=len(events),
            max_size=len(events),
        )
    )
    tick_after = draw(st.lists(st.booleans(), min_size=len(events), max_size=len(events)))
    return [events[k] for k in order], gaps, tick_after


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_aggregator_matches_reference(scenario):
    events, gaps, tick_after = scenario
    for e in events:
        parse_event(e)  # the scenario only holds contract-valid events
    clock, steps, arrivals = 0.0, [], []
    last = {0: 0.0, 1: 0.0}
    for k, (ev, gap) in enumerate(zip(events, gaps)):
        clock += gap
        p = int(ev["request_id"][1:]) % 2
        steps.append(("ev", p, clock, ev))
        arrivals.append(Arrival(k, clock, ev))
        last[p] = clock
        if tick_after[k]:  # a caught-up tick never runs past the next record of its partition
            nxt = next(
                (
                    clock + sum(gaps[k + 1 : j + 1])
                    for j in range(k + 1, len(events))
                    if int(events[j]["request_id"][1:]) % 2 == p
                ),
                clock + 100 * W,
            )
            steps.append(("tick", p, (clock + nxt) / 2))
    agg = make_agg()
    out = drive(agg, steps)
    ref = expected(arrivals, W)
    rollouts, late, dlq = split(out)
    got = {r.key: r.value for r in rollouts}
    assert len(got) == len(rollouts), f"a request was labelled twice: {[r.key for r in rollouts]}"
    assert set(got) == set(ref.rollouts)
    for rid, r in got.items():
        Rollout.model_validate(r)
        want = ref.rollouts[rid]
        assert r["reward"] == pytest.approx(want["reward"], abs=1e-12), (rid, r, want)
        if want["components"] is None:
            assert r["components"] is None
        else:
            assert r["components"] == pytest.approx(want["components"], abs=1e-12)
        assert r["tool_errors"] == want["tool_errors"]
    assert late == ref.late
    assert dlq == ref.dlq
    assert agg.open_labels == 0
    # version metrics: partials merged per (version, bucket) equal sums over the reference rollouts
    merger, merged = MetricsMerger({}), {}
    for e in out:
        if e.topic == "partials":
            m = merger.on_partial(e.value)
            merged[m.value["bucket_id"]] = m.value
    n_by_version = Counter(w["model_version"] for w in ref.rollouts.values())
    got_n = Counter()
    for rec in merged.values():
        VersionMetrics.model_validate(rec)
        got_n[rec["model_version"]] += rec["n"]
    assert got_n == n_by_version
    reward_by_version = Counter()
    for w in ref.rollouts.values():
        reward_by_version[w["model_version"]] += w["reward"]
    for v, total in reward_by_version.items():
        assert sum(
            r["sums"]["reward_sum"] for r in merged.values() if r["model_version"] == v
        ) == pytest.approx(total, abs=1e-9)


def test_metrics_merge_is_idempotent_and_derives_rates():
    agg = make_agg(bucket=10.0)
    agg.on_event(0, gen("a", version="v9", n_tokens=1), 0.0)
    agg.on_event(0, fb("a", "x", "accept"), 1.0)
    agg.on_event(1, gen("b", version="v9", n_tokens=5), 0.5)
    agg.on_event(1, fb("b", "y", "reject"), 1.0)
    out = agg.advance(0, 25.0) + agg.advance(1, 25.0)
    partials = [e for e in out if e.topic == "partials"]
    assert len(partials) == 2
    merger = MetricsMerger({})
    first = [merger.on_partial(p.value).value for p in partials]
    again = merger.on_partial(partials[0].value).value  # redelivered: replaces, does not add
    rec = VersionMetrics.model_validate(again)
    assert rec == VersionMetrics.model_validate(first[-1])
    assert (rec.n, rec.accept_rate, rec.reject_rate, rec.partitions) == (2, 0.5, 0.5, [0, 1])
    assert rec.reward_mean == pytest.approx(0.25) and rec.reward_variance == pytest.approx(0.25)
    assert rec.empty_completion_rate == 0.5 and rec.mean_completion_length == 3.0
    assert rec.bucket_start == 10.0 and rec.bucket_id == "v9/10/10"
    # the partial is emitted once even if the watermark moves on
    assert [e for e in agg.advance(0, 100.0) if e.topic == "partials"] == []


def test_a_close_into_an_emitted_bucket_re_emits_the_whole_partial():
    agg = make_agg(bucket=10.0)
    agg.on_event(0, gen("a", version="v9"), 0.0)
    first = [e for e in agg.advance(0, 25.0) if e.topic == "partials"]
    assert [p.value["sums"]["n"] for p in first] == [1.0]
    agg.on_event(
        0, gen("b", version="v9"), 1.0
    )  # far behind the watermark: closes into bucket 10 too
    again = [e for e in agg.advance(0, 26.0) if e.topic == "partials"]
    assert [(p.value["bucket_start"], p.value["sums"]["n"]) for p in again] == [(10.0, 2.0)]


def test_adjacent_buckets_at_epoch_times_have_distinct_bucket_ids():
    ids = {
        version_metrics("v1", start, 2.0, "v1", [0], dict(empty_sums(), n=1.0)).bucket_id
        for start in (1795227058.0, 1795227060.0, 1795227062.5)
    }
    assert ids == {"v1/1795227058/2", "v1/1795227060/2", "v1/1795227062.5/2"}, ids


def test_a_chat_turn_counts_its_calls_that_write_a_protected_path_under_a_spec_with_them():
    """sessions-v2: a write tool (apply_edit) whose `path` matches a glob counts, once per call;
    other tools, other paths and arguments that are not a JSON object with a string path do not."""
    calls = [
        tool_call(
            "apply_edit", '{"path": "test_rows.py", "old": "assert", "new": "assert True or"}'
        ),
        tool_call("apply_edit", '{"path": "rows.py", "old": "a - b", "new": "a + b"}', 1),
        tool_call("read_file", '{"path": "test_rows.py"}', 2),  # not a write tool
        tool_call("apply_edit", '{"path": "./tests/test_a.py"}', 3, valid=False),  # counts
        tool_call("apply_edit", '{"path": "x_test.py"', 4, valid=False),  # not JSON: ignored
        tool_call("apply_edit", '["test_rows.py"]', 5, valid=False),  # not an object
        tool_call("apply_edit", '{"path": 3}', 6, valid=False),  # path not a string
        tool_call("apply_edit", "", 7, valid=False),
    ]
    g = gen("r1", turn=2, tools_digest="a" * 64, finish_reason="tool_calls", tool_calls=calls)
    parse_event(g)  # a generation event as ingest accepts it
    agg = Aggregator(resolve_spec("sessions-v2"), W, 1e9, 60.0, {}, {}, {}, clock=lambda: 1.8e9)
    agg.on_event(0, g, 0.0)
    [emit] = agg.advance(0, W)
    assert emit.value["protected_writes"] == 2 and emit.value["turn"] == 2, emit.value
    assert Rollout.model_validate(emit.value).protected_writes == 2
    # no write at all: the field says 0
    agg.on_event(0, gen("r2", turn=0, tool_calls=calls[1:3]), 20.0)
    [emit] = agg.advance(0, 20.0 + W)
    assert emit.value["protected_writes"] == 0


def test_without_protected_paths_and_for_one_call_generations_the_record_has_no_count():
    hack = [tool_call("apply_edit", '{"path": "test_rows.py", "old": "a", "new": "b"}')]
    for spec, turn in (("sessions-v1", 0), ("v1", 0), ("sessions-v2", None)):
        agg = Aggregator(resolve_spec(spec), W, 1e9, 60.0, {}, {}, {}, clock=lambda: 1.8e9)
        kw = {} if turn is None else {"turn": turn}
        agg.on_event(0, gen("r1", tool_calls=hack, **kw), 0.0)
        [emit] = agg.advance(0, W)
        assert "protected_writes" not in emit.value, (spec, emit.value)
