"""The pure parts of bench/sessions.py (no broker): the events it produces, its close and
latency arithmetic, its one-record-per-session check, its counter parsing and its flags."""

from __future__ import annotations

import math

import pytest

from app.contracts.events import parse_event
from bench.sessions import (
    TOOL_RESULT,
    Latency,
    build_workload,
    check_sessions,
    counters,
    parse_args,
    session_close,
)


def test_both_paths_carry_the_same_generations_and_every_event_is_valid():
    w = build_workload("t", sessions=3, turns=4)
    gens = [e for e in w.session_events if e["type"] == "generation"]
    twins = [e for e in w.call_events if e["type"] == "generation"]
    assert w.generations == len(twins) == 12 and w.sessions == 3, (w.generations, len(twins))
    for g, c in zip(gens, twins, strict=True):
        assert (g["prompt_tokens"], g["completion_tokens"]) == (
            c["prompt_tokens"],
            c["completion_tokens"],
        )
        assert "turn" not in c and "tools_digest" not in c, c
    kinds = [e["type"] for e in w.session_events]
    assert kinds.count("session_outcome") == 3 and len(kinds) == 12 + 3 + 3, kinds
    assert len(w.call_events) == 2 * 12 and len(w.session_slots) == len(w.session_events)
    for ev in w.session_events + w.call_events:
        parse_event(ev)  # raises on anything the worker would dead-letter


def test_each_turn_extends_the_previous_prompt_and_completion_exactly():
    w = build_workload("t", sessions=2, turns=5, seed=7)
    for sid in w.outcomes:
        turns = sorted(
            (e for e in w.session_events if e.get("turn") is not None and e["session_id"] == sid),
            key=lambda e: e["turn"],
        )
        assert [e["turn"] for e in turns] == list(range(5))
        assert len({e["tools_digest"] for e in turns}) == 1, "one tools digest per session"
        for prev, nxt in zip(turns, turns[1:], strict=False):
            history = prev["prompt_tokens"] + prev["completion_tokens"]
            assert nxt["prompt_tokens"][: len(history)] == history
            assert len(nxt["prompt_tokens"]) == len(history) + TOOL_RESULT


def test_each_session_has_one_feedback_and_an_outcome_naming_its_last_turn():
    w = build_workload("t", sessions=4, turns=3, seed=1)
    for sid, outcome in w.outcomes.items():
        evs = [e for e in w.session_events if e["session_id"] == sid]
        fb = [e for e in evs if e["type"] not in ("generation", "session_outcome")]
        (out,) = [e for e in evs if e["type"] == "session_outcome"]
        assert len(fb) == 1 and fb[0]["request_id"].startswith(f"{sid}-t"), fb
        assert out["request_id"] == f"{sid}-t2" and out["outcome"] == outcome, out
        assert evs[-1] is out, "the outcome is produced after the last turn"


def test_a_session_closes_at_the_later_of_its_outcome_and_its_last_label():
    assert session_close(outcome_ts=10.0, last_turn_ts=9.5, window=1.0) == 10.5
    assert session_close(outcome_ts=12.0, last_turn_ts=9.5, window=1.0) == 12.0


def test_latency_percentiles_by_nearest_rank_and_nan_when_empty():
    lat = Latency.of([float(i) for i in range(100)])
    assert (lat.n, lat.p50, lat.p99, lat.max) == (100, 50.0, 99.0, 99.0), lat
    empty = Latency.of([])
    assert empty.n == 0 and math.isnan(empty.p50) and math.isnan(empty.max), empty


def test_the_check_names_every_session_that_is_not_one_end_record_of_all_its_turns():
    w = build_workload("t", sessions=4, turns=3)
    s0, s1, s2, s3 = w.outcomes

    def rec(sid: str, n: int, closed_by: str = "end", outcome: str | None = None) -> dict:
        return {
            "session_id": sid,
            "turns": [{}] * n,
            "segment_closed_by": closed_by,
            "outcome": outcome or w.outcomes[sid],
        }

    good = {sid: [rec(sid, 3)] for sid in w.outcomes}
    assert check_sessions(w, good) == []
    bad = good | {s1: [rec(s1, 2), rec(s1, 1)], s2: [rec(s2, 3, "idle")], s3: []}
    problems = check_sessions(w, bad)
    assert [p.split(":")[0] for p in problems] == [s1, s2, s3], problems
    one_turn = build_workload("u", sessions=1, turns=1)
    (sid,) = one_turn.outcomes  # a one-turn segment's record has no `turns`
    ok = {sid: [{"segment_closed_by": "end", "outcome": one_turn.outcomes[sid]}]}
    assert check_sessions(one_turn, ok) == []


def test_counters_are_read_by_label_from_the_exposition_text():
    text = (
        "# HELP flywheel_streams_segments_total x\n# TYPE flywheel_streams_segments_total counter\n"
        'flywheel_streams_segments_total{closed_by="end",opened_by="session_start"} 12.0\n'
        'flywheel_streams_segments_total{closed_by="idle",opened_by="session_start"} 1.0\n'
    )
    assert counters(text, "flywheel_streams_segments_total") == {
        "closed_by=end,opened_by=session_start": 12.0,
        "closed_by=idle,opened_by=session_start": 1.0,
    }


def test_flags_default_to_the_full_run_and_quick_shrinks_it():
    full, quick = parse_args([]), parse_args(["--quick"])
    assert (full.sessions, full.turns, full.live_seconds) == (5000, 8, 15.0), full
    assert (quick.sessions, quick.live_seconds) == (300, 6.0), quick
    assert parse_args(["--sessions", "7", "--turns", "3"]).sessions == 7
    with pytest.raises(AssertionError, match="outlast the window"):
        parse_args(["--idle", "2", "--window", "1"])
