"""The session ledger (streams/ledger.py, streams/segments.py): segments, their records, closes,
late and duplicate turns, and state that survives a restart."""

from __future__ import annotations

import base64
import random
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.contracts.rollouts import Rollout
from streams.ledger import Emit, Ledger, LedgerConfig, Session, iso
from streams.reward import OUTCOMES, resolve_spec
from streams.segments import LEDGER_KEYS
from tests.unit.streams.factories import ts

EOS = 257  # byte-v1's
TOOLS = "a" * 64


def turn_rec(
    sid: str,
    turn: int | None,
    prompt: list[int],
    completion: list[int],
    rid: str | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """A rollout as the label join writes it, with the generation's turn and tools_digest beside."""
    n = len(completion)
    rec: dict[str, Any] = {
        "request_id": rid or f"{sid}-t{turn}",
        "session_id": sid,
        "group_id": None,
        "model_version": "v7",
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "logprobs": [-0.25 - 0.01 * i for i in range(n)],
        "routes": None,
        "route_shape": None,
        "reward": 0.0,
        "components": None,
        "tool_errors": [],
        "reward_spec": "v1",
        "generated_at": ts(10.0 * (turn or 0)),
        "labelled_at": ts(10.0 * (turn or 0) + 5),
        "closed_by": "window",
        "tokenizer": "byte-v1",
        "temperature": 1.0,
        "finish_reason": "tool_calls",
        "constrained": False,
        "turn": turn,
        "tools_digest": TOOLS,
    }
    rec.update(kw)
    return rec


def agent_session(sid: str, n: int, eos_in_history: bool = True) -> list[dict[str, Any]]:
    """`n` chat turns: each samples 3 tokens ending in eos, the tool answers with 2 tokens, and the
    next prompt is the previous prompt + completion (less the eos when not `eos_in_history`) + the
    tool result."""
    prompt, recs = [1, 2, 3], []
    for k in range(n):
        completion = [100 + 10 * k, 101 + 10 * k, EOS]
        recs.append(turn_rec(sid, k, prompt, completion))
        history = completion if eos_in_history else completion[:-1]
        prompt = [*prompt, *history, 50 + k, 51 + k]
    return recs


def rollouts(out: list[Emit]) -> list[dict[str, Any]]:
    return [e.value for e in out if e.topic == "rollouts"]


def run(
    recs: list[dict[str, Any]], cfg: LedgerConfig | None = None, end: bool = True
) -> tuple[Ledger, list[Emit]]:
    """Feed `recs` one second apart, then end every session they name."""
    ledger = Ledger(cfg or LedgerConfig(), {})
    out: list[Emit] = []
    for i, rec in enumerate(recs):
        out += ledger.on_rollout(rec, 1000.0 + i)
    if end:
        for sid in sorted({r["session_id"] for r in recs}):
            out += ledger.end_session(sid, 1000.0 + len(recs))
    return ledger, out


def test_a_three_turn_agent_session_is_one_record_with_every_sampled_token_masked_in():
    recs = agent_session("s1", 3)
    ledger, out = run(recs)
    [rec] = rollouts(out)
    Rollout.model_validate(rec)
    assert rec["request_id"] == "s1-t0" and rec["prompt_tokens"] == [1, 2, 3], rec
    completion, mask, lp = rec["completion_tokens"], rec["loss_mask"], rec["logprobs"]
    # the last turn's prompt + completion is the whole trajectory, token for token
    assert [1, 2, 3, *completion] == recs[2]["prompt_tokens"] + recs[2]["completion_tokens"]
    sampled = [t for t, m in zip(completion, mask, strict=True) if m == 1]
    assert sampled == [t for r in recs for t in r["completion_tokens"]], sampled
    assert [t for t, m in zip(completion, mask, strict=True) if m == 0] == [50, 51, 51, 52]
    assert [x for x, m in zip(lp, mask, strict=True) if m == 0] == [0.0] * 4, lp
    assert [x for x, m in zip(lp, mask, strict=True) if m == 1] == [
        x for r in recs for x in r["logprobs"]
    ]
    spans = [(t["request_id"], t["start"], t["end"]) for t in rec["turns"]]
    assert spans == [("s1-t0", 0, 3), ("s1-t1", 5, 8), ("s1-t2", 10, 13)], spans
    assert out[0].opened_by == "session_start" and out[0].closed_by == "end", out[0]
    assert ledger.counts["opened.session_start"] == 1 and ledger.counts["closed.end"] == 1


def test_an_eos_the_template_leaves_out_of_the_history_leaves_the_trajectory():
    recs = agent_session("s1", 3, eos_in_history=False)
    ledger, out = run(recs)
    [rec] = rollouts(out)
    Rollout.model_validate(rec)
    assert [1, 2, 3, *rec["completion_tokens"]] == (
        recs[2]["prompt_tokens"] + recs[2]["completion_tokens"]
    ), rec["completion_tokens"]
    spans = [(t["start"], t["end"]) for t in rec["turns"]]
    assert spans == [(0, 2), (4, 6), (8, 11)], spans  # the last turn keeps its eos
    assert sum(rec["loss_mask"]) == 7 and ledger.counts["eos_dropped"] == 2, ledger.counts


def test_a_token_that_is_not_eos_is_never_dropped():
    recs = agent_session("s1", 2)
    recs[0]["completion_tokens"] = [100, 101, 102]  # ends in 102, not eos
    recs[1]["prompt_tokens"] = [1, 2, 3, 100, 101, 50, 51]
    _, out = run(recs)
    assert [e.closed_by for e in out] == ["history_rewritten", "end"], out


def test_a_rewritten_history_opens_a_second_segment_with_its_reason():
    recs = agent_session("s1", 3)
    recs[2]["prompt_tokens"] = [1, 2, 3, 100, 101, EOS, 9, 9]  # turn 1 edited out
    ledger, out = run(recs)
    assert [(e.key, e.opened_by, e.closed_by) for e in out] == [
        ("s1-t0", "session_start", "history_rewritten"),
        ("s1-t2", "history_rewritten", "end"),
    ], out
    assert len(out[0].value["turns"]) == 2 and "turns" not in out[1].value, out
    assert ledger.counts["opened.history_rewritten"] == 1, ledger.counts


def test_other_tools_open_a_new_segment():
    recs = agent_session("s1", 2)
    recs[1]["tools_digest"] = "b" * 64
    ledger, out = run(recs)
    assert [(e.key, e.closed_by) for e in out] == [("s1-t0", "tools_changed"), ("s1-t1", "end")]


def test_another_tokenizer_opens_a_new_segment():
    recs = agent_session("s1", 2)
    recs[1]["tokenizer"] = "hf:other"
    _, out = run(recs)
    assert [e.closed_by for e in out] == ["version_tokenizer_changed", "end"], out


def test_one_call_records_pass_through_unchanged_at_once():
    rec = turn_rec("s1", None, [1, 2, 3], [4, 5], rid="c1", routes="AAAA", route_shape=[1, 1, 1])
    rec.pop("tools_digest")
    ledger = Ledger(LedgerConfig(), {})
    [emit] = ledger.on_rollout(rec, 1.0)
    expected = {k: v for k, v in rec.items() if k != "turn"}
    assert emit.topic == "rollouts" and emit.value == expected, emit
    assert emit.closed_by == "not_a_chat_turn" and ledger.sessions == {}, ledger.sessions


def test_a_one_turn_segment_is_its_input_record_with_why_it_opened_and_closed():
    [rec] = agent_session("s1", 1)
    _, out = run([rec])
    [value] = rollouts(out)
    segment = {"segment_opened_by": "session_start", "segment_closed_by": "end"}
    assert value == {**{k: v for k, v in rec.items() if k not in LEDGER_KEYS}, **segment}, value
    assert Rollout.model_validate(value).turns is None


def test_the_record_sums_the_turns_rewards_and_reindexes_tool_errors():
    recs = agent_session("s1", 2)
    err = {"message": "boom", "hint": None, "token_index": 1}
    comp0 = {"decision": None, "persistence": None, "rating": None, "followup": None}
    recs[0].update(reward=-0.5, components={**comp0, "tool_errors": -0.5}, tool_errors=[err])
    recs[1].update(reward=0.75, components={**comp0, "decision": 0.75, "tool_errors": None})
    recs[1].update(temperature=0.7, model_version="v8", finish_reason="stop")
    _, out = run(recs)
    [rec] = rollouts(out)
    assert rec["reward"] == 0.25 and rec["components"]["tool_errors"] == -0.5, rec
    assert rec["components"]["decision"] == 0.75 and rec["components"]["rating"] is None
    assert rec["tool_errors"] == [{**err, "token_index": 1}], rec["tool_errors"]
    assert rec["temperature"] is None and rec["model_version"] == "v8", rec
    assert [t["temperature"] for t in rec["turns"]] == [1.0, 0.7]
    assert rec["routes"] is None and rec["finish_reason"] == "stop"


def test_an_idle_segment_closes_and_the_next_turn_opens_a_new_one():
    recs = agent_session("s1", 3)
    ledger = Ledger(LedgerConfig(idle_s=60, retention_s=600), {})
    out = ledger.on_rollout(recs[0], 0.0) + ledger.on_rollout(recs[1], 30.0)
    assert out == [] and ledger.advance(89.0) == []
    out = ledger.advance(90.0)
    assert [(e.key, e.closed_by) for e in out] == [("s1-t0", "idle")], out
    assert len(out[0].value["turns"]) == 2 and ledger.open_sessions == 0
    out = ledger.on_rollout(recs[2], 100.0) + ledger.advance(160.0)
    assert [(e.key, e.opened_by, e.closed_by) for e in out] == [("s1-t2", "idle", "idle")], out
    assert ledger.advance(760.0) == [] and ledger.sessions == {}, ledger.sessions


def test_an_ended_session_closes_and_sends_later_turns_to_late():
    recs = agent_session("s1", 3)
    ledger = Ledger(LedgerConfig(), {})
    ledger.on_rollout(recs[0], 0.0)
    out = ledger.end_session("s1", 1.0)
    assert [(e.key, e.closed_by) for e in out] == [("s1-t0", "end")], out
    [late] = ledger.on_rollout(recs[1], 2.0)
    assert late.topic == "late" and late.value["reason"] == "session_ended", late
    assert late.value["event"] is recs[1] and ledger.end_session("s1", 3.0) == []


def test_the_turn_bound_closes_segments_and_loses_no_turn():
    recs = agent_session("s1", 7)
    ledger, out = run(recs, LedgerConfig(max_turns=3))
    assert [(e.opened_by, e.closed_by) for e in out] == [
        ("session_start", "max_turns"),
        ("max_turns", "max_turns"),
        ("max_turns", "end"),
    ], out
    assert _request_ids(out) == [r["request_id"] for r in recs]


def test_the_token_bound_closes_before_a_turn_that_would_pass_it():
    recs = agent_session("s1", 4)  # the turns' records are 6, 11, 16, 21 tokens long
    ledger, out = run(recs, LedgerConfig(max_tokens=15))
    assert [(e.key, e.closed_by, len(e.value.get("turns") or [0])) for e in out] == [
        ("s1-t0", "max_tokens", 2),  # turns 0-1 (11 tokens); turn 2 would make 16
        ("s1-t2", "max_tokens", 1),  # turn 2 alone is 16: closed at once, as is turn 3
        ("s1-t3", "max_tokens", 1),
    ], out
    assert _request_ids(out) == [r["request_id"] for r in recs]
    assert ledger.counts["closed.max_tokens"] == 3 and ledger.open_sessions == 0


def test_the_byte_bound_closes_a_segment_before_its_record_or_state_would_pass_it():
    """Long turns with long log-probs and routes: no record and no stored session goes past
    max_bytes (the bound is an upper bound of the JSON), and no turn is lost."""
    cap = 64 << 10
    routes = base64.b64encode(bytes(4 * 2 * 2 * 300)).decode()  # 300 tokens, 2 layers, top 2
    prompt, recs = [1, 2, 3], []
    for k in range(12):
        completion = [1000 + (k * 300 + i) % 9000 for i in range(300)]
        recs.append(turn_rec("s1", k, prompt, completion, routes=routes, route_shape=[300, 2, 2],
                             logprobs=[-1.2345678901234567e-05 - i for i in range(300)]))  # fmt: skip
        prompt = [*prompt, *completion, 7, 8]
    for order in (recs, recs[::-1]):  # in order (held segments), and every turn early (waiting)
        table: dict[str, dict] = {}
        ledger = Ledger(LedgerConfig(max_bytes=cap, max_tokens=10**6), table)
        out = []
        for i, rec in enumerate(order):
            out += ledger.on_rollout(rec, 1.0 + i)
            assert len(orjson.dumps(table["s1"])) <= cap
        out += ledger.end_session("s1", 100.0)
        closes = [e.closed_by for e in out if e.topic == "rollouts"]
        assert "max_bytes" in closes, closes
        assert all(len(orjson.dumps(e.value)) <= cap for e in out)
        landed = _request_ids([e for e in out if e.topic == "rollouts"])
        landed += [e.key for e in out if e.topic == "late"]
        assert sorted(landed) == sorted(r["request_id"] for r in recs)


def test_the_least_recently_active_session_closes_past_the_open_session_bound():
    a, b, c = agent_session("a", 2), agent_session("b", 1), agent_session("c", 1)
    ledger = Ledger(LedgerConfig(max_open_sessions=2), {})
    out = [e for rec, t in ((a[0], 1), (b[0], 2), (a[1], 3)) for e in ledger.on_rollout(rec, t)]
    assert out == [] and ledger.open_sessions == 2
    out = ledger.on_rollout(c[0], 4)
    assert [(e.key, e.closed_by) for e in out] == [("b-t0", "open_sessions")], out
    assert ledger.open_sessions == 2
    out = ledger.on_rollout(agent_session("d", 1)[0], 5)
    assert [(e.key, len(e.value["turns"])) for e in out] == [("a-t0", 2)], out


def test_a_repeated_turn_is_ignored():
    recs = agent_session("s1", 2)
    ledger, out = run([recs[0], recs[0], recs[1], dict(recs[0])])
    assert len(rollouts(out)) == 1 and ledger.counts["duplicates"] == 2, ledger.counts


def test_a_turn_after_its_segment_closed_goes_to_late():
    recs = agent_session("s1", 3)
    ledger = Ledger(LedgerConfig(idle_s=60, retention_s=600), {})
    ledger.on_rollout(recs[0], 0.0)
    ledger.on_rollout(recs[1], 1.0)
    assert [e.closed_by for e in ledger.advance(100.0)] == ["idle"]
    rewritten = turn_rec("s1", 1, recs[1]["prompt_tokens"], [7, EOS], rid="other")
    [late] = ledger.on_rollout(rewritten, 101.0)
    assert late.topic == "late" and late.value["reason"] == "after_close", late
    assert late.value["detected_at"] == iso(101.0), late.value


def test_a_second_choice_of_an_applied_turn_is_superseded():
    recs = agent_session("s1", 2)
    sibling = turn_rec("s1", 1, recs[1]["prompt_tokens"], [9, EOS], rid="s1-t1-b")
    _, out = run([recs[0], recs[1], sibling])
    assert [(e.topic, e.key) for e in out] == [("late", "s1-t1-b"), ("rollouts", "s1-t0")], out
    assert out[0].value["reason"] == "superseded"


def test_two_clients_sharing_a_session_id_break_each_other_and_lose_no_turn():
    """A collision: each client's turn rewrites the other's history. Every turn still lands once
    (in a record), and the breaks say why."""
    a = agent_session("shared", 3)
    b = [
        {**r, "request_id": f"b{k}", "prompt_tokens": [4, *r["prompt_tokens"]]}
        for k, r in enumerate(agent_session("shared", 3))
    ]
    interleaved = []
    for k in range(3):  # A's turn k, then B's, each generated after the one before
        interleaved += [
            {**a[k], "generated_at": ts(20.0 * k)},
            {**b[k], "generated_at": ts(20.0 * k + 10)},
        ]
    _, out = run(interleaved)
    assert [e.topic for e in out] == ["rollouts"] * 6, out
    assert sorted(_request_ids(out)) == sorted(r["request_id"] for r in interleaved)
    assert [e.closed_by for e in out] == ["history_rewritten"] * 5 + ["end"]


def test_turns_out_of_order_are_assembled_in_order():
    recs = agent_session("s1", 4)
    _, in_order = run(recs)
    ledger, shuffled = run([recs[2], recs[0], recs[3], recs[1]])
    assert rollouts(shuffled) == rollouts(in_order) and len(rollouts(in_order)) == 1


def test_a_missing_turn_is_waited_for_then_its_tokens_are_context():
    recs = agent_session("s1", 3)
    ledger = Ledger(LedgerConfig(idle_s=60, retention_s=600), {})
    assert ledger.on_rollout(recs[0], 0.0) + ledger.on_rollout(recs[2], 1.0) == []
    out = ledger.end_session("s1", 2.0)  # the end applies the waiting turn 2 over the gap
    [rec] = rollouts(out)
    mask = rec["loss_mask"]
    assert [(t["start"], t["end"]) for t in rec["turns"]] == [(0, 3), (10, 13)], rec["turns"]
    assert mask == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1], mask
    [late] = ledger.on_rollout(recs[1], 3.0)
    assert late.value["reason"] == "session_ended"


def test_a_waiting_turn_is_applied_when_the_idle_window_passes():
    recs = agent_session("s1", 3)
    ledger = Ledger(LedgerConfig(idle_s=60, retention_s=600), {})
    ledger.on_rollout(recs[0], 0.0)
    ledger.on_rollout(recs[2], 30.0)
    out = ledger.advance(90.0)  # 60 s after turn 2 arrived; turn 1 never came
    assert [(e.key, e.closed_by, len(e.value["turns"])) for e in out] == [("s1-t0", "idle", 2)]
    [late] = ledger.on_rollout(recs[1], 91.0)
    assert late.value["reason"] == "after_close", late


def test_a_session_state_round_trips_through_its_stored_form():
    recs = agent_session("s1", 3, eos_in_history=False)
    ledger = Ledger(LedgerConfig(), {})
    ledger.on_rollout(recs[0], 0.0)
    ledger.on_rollout(recs[2], 1.0)  # waits for turn 1
    stored = ledger.sessions["s1"]
    sess = Session.from_stored(orjson.loads(orjson.dumps(stored)))
    assert sess.to_stored() == stored and sess.waiting and sess.segment is not None, stored


def outcome_event(sid: str, last_rid: str, outcome: str = "success", eid: str = "o1") -> dict:
    return {
        "type": "session_outcome",
        "event_id": eid,
        "request_id": last_rid,
        "session_id": sid,
        "ts": ts(0.0),
        "outcome": outcome,
    }


V2 = resolve_spec("sessions-v1")


def test_an_outcome_before_its_last_turn_ends_the_session_once_that_turn_is_in():
    recs = agent_session("s1", 3)
    recs[1].update(reward=-0.5)
    ledger = Ledger(LedgerConfig(), {}, V2)
    out = ledger.on_rollout(recs[0], 1.0) + ledger.on_outcome(outcome_event("s1", "s1-t2"), 2.0)
    assert rollouts(out) == [] and ledger.session("s1").ending
    out += ledger.on_rollout(recs[1], 3.0)
    assert rollouts(out) == []
    out += ledger.on_rollout(recs[2], 4.0)
    [rec] = rollouts(out)
    assert [t["request_id"] for t in rec["turns"]] == ["s1-t0", "s1-t1", "s1-t2"]
    assert rec["outcome"] == "success" and rec["outcome_reward"] == 1.0
    assert rec["reward"] == -0.5 + 1.0 and rec["segment_closed_by"] == "end", rec
    assert [t["reward"] for t in rec["turns"]] == [0.0, -0.5, 0.0]
    Rollout.model_validate(rec)
    later = ledger.on_rollout(turn_rec("s1", 3, [9], [9]), 5.0)
    assert [(e.topic, e.value["reason"]) for e in later] == [("late", "session_ended")]


def test_an_outcome_under_a_spec_without_outcome_weights_is_recorded_and_adds_nothing():
    recs = agent_session("s1", 2)
    ledger = Ledger(LedgerConfig(), {}, resolve_spec("v1"))
    out = ledger.on_rollout(recs[0], 1.0) + ledger.on_rollout(recs[1], 2.0)
    out += ledger.on_outcome(outcome_event("s1", "s1-t1", "failure"), 3.0)
    [rec] = rollouts(out)
    assert rec["outcome"] == "failure" and rec["outcome_reward"] is None and rec["reward"] == 0.0


def test_an_outcome_whose_turn_never_comes_ends_the_session_an_idle_window_later():
    recs = agent_session("s1", 3)
    ledger = Ledger(LedgerConfig(idle_s=60, retention_s=600), {}, V2)
    out = ledger.on_rollout(recs[0], 1.0) + ledger.on_rollout(recs[1], 2.0)
    out += ledger.on_outcome(outcome_event("s1", "s1-t2", "abandoned"), 10.0)
    assert rollouts(out) == [] and ledger.advance(69.0) == []
    [rec] = rollouts(ledger.advance(70.0))
    assert rec["outcome"] == "abandoned" and rec["reward"] == -1.0 and len(rec["turns"]) == 2


def test_a_second_outcome_goes_to_late_and_the_same_one_again_is_a_duplicate():
    [rec] = agent_session("s1", 1)
    ledger = Ledger(LedgerConfig(), {}, V2)
    ev = outcome_event("s1", "s1-t0")
    out = ledger.on_rollout(rec, 1.0) + ledger.on_outcome(ev, 2.0)
    assert len(rollouts(out)) == 1
    assert ledger.on_outcome(ev, 3.0) == [] and ledger.counts["duplicates"] == 1
    [late] = ledger.on_outcome({**ev, "event_id": "o2", "outcome": "failure"}, 4.0)
    assert late.topic == "late" and late.value["reason"] == "outcome_repeated", late
    assert late.value["event"]["outcome"] == "failure"


def test_an_outcome_after_the_session_closed_idle_goes_to_late():
    [rec] = agent_session("s1", 1)
    ledger = Ledger(LedgerConfig(idle_s=60, retention_s=600), {}, V2)
    out = ledger.on_rollout(rec, 1.0) + ledger.advance(100.0)
    [closed] = rollouts(out)
    assert closed["segment_closed_by"] == "idle" and "outcome" not in closed
    [late] = ledger.on_outcome(outcome_event("s1", "s1-t0"), 101.0)
    assert late.topic == "late" and late.value["reason"] == "after_close", late
    assert late.value["event"]["outcome"] == "success"


def test_segments_a_break_closed_wait_for_the_outcome_and_share_it():
    """A compacted history splits the session; both pieces carry the outcome (one advantage)."""
    recs = agent_session("s1", 3)
    recs[2]["prompt_tokens"] = [1, 2, 3, 9]  # the client compacted its history
    ledger = Ledger(LedgerConfig(), {}, V2)
    out = [e for i, r in enumerate(recs) for e in ledger.on_rollout(r, 1.0 + i)]
    assert rollouts(out) == [] and len(ledger.session("s1").held) == 1
    out += ledger.on_outcome(outcome_event("s1", "s1-t2", "failure"), 9.0)
    first, second = rollouts(out)
    assert (first["segment_closed_by"], second["segment_opened_by"]) == ("history_rewritten",) * 2
    assert [t["request_id"] for t in first["turns"]] == ["s1-t0", "s1-t1"], first
    assert second["request_id"] == "s1-t2" and second["segment_closed_by"] == "end"
    assert first["outcome"] == second["outcome"] == "failure"
    assert first["reward"] == second["reward"] == -0.5


def test_a_later_turn_numbered_lower_after_compaction_breaks_the_segment_not_late():
    """A client that drops messages numbers its next turn from what it kept: turn 1 again, but
    generated after turn 2. It is a new segment, not another choice of turn 1."""
    recs = agent_session("s1", 3)
    compacted = turn_rec("s1", 1, [1, 2, 3, 9], [7, 8, EOS], rid="s1-c", generated_at=ts(99.0))
    ledger = Ledger(LedgerConfig(), {}, V2)
    out = [e for i, r in enumerate([*recs, compacted]) for e in ledger.on_rollout(r, 1.0 + i)]
    out += ledger.on_outcome(outcome_event("s1", "s1-c"), 9.0)
    assert [e.topic for e in out] == ["rollouts", "rollouts"], out
    first, second = rollouts(out)
    assert len(first["turns"]) == 3 and first["segment_closed_by"] == "history_rewritten"
    assert second["request_id"] == "s1-c" and second["segment_closed_by"] == "end"


def test_held_segments_go_out_without_an_outcome_when_the_session_goes_idle():
    recs = agent_session("s1", 3)
    recs[2]["prompt_tokens"] = [1, 2, 3, 9]
    ledger = Ledger(LedgerConfig(idle_s=60, retention_s=600), {}, V2)
    out = [e for i, r in enumerate(recs) for e in ledger.on_rollout(r, 1.0 + i)]
    out += ledger.advance(63.0)
    assert [r["segment_closed_by"] for r in rollouts(out)] == ["history_rewritten", "idle"]
    assert all("outcome" not in r for r in rollouts(out))


def test_a_pending_outcome_survives_a_restart_from_the_stored_state():
    recs = agent_session("s1", 2)
    table: dict[str, dict] = {}
    ledger = Ledger(LedgerConfig(), table, V2)
    ledger.on_rollout(recs[0], 1.0)
    ledger.on_outcome(outcome_event("s1", "s1-t1"), 2.0)
    restored = Ledger(LedgerConfig(), orjson.loads(orjson.dumps(table)), V2)
    [rec] = rollouts(restored.on_rollout(recs[1], 3.0))
    assert rec["outcome"] == "success" and rec["reward"] == 1.0


def test_a_retention_shorter_than_the_idle_window_is_refused():
    with pytest.raises(ValueError, match="retention_s 10.0 is shorter than idle_s 60.0"):
        LedgerConfig(idle_s=60, retention_s=10)


def _request_ids(out: list[Emit]) -> list[str]:
    """Every turn's request_id in the emitted records, in order."""
    ids = []
    for e in out:
        turns = e.value.get("turns")
        ids += [t["request_id"] for t in turns] if turns else [e.key]
    return ids


def _mixed_workload(seed: int) -> list[dict[str, Any]]:
    """Sessions of 1-5 turns (some rewritten, some repeated), interleaved, plus one-call records."""
    rng = random.Random(seed)
    streams = []
    for s in range(rng.randint(1, 4)):
        recs = agent_session(f"s{s}", rng.randint(1, 5), eos_in_history=rng.random() < 0.5)
        if len(recs) > 2 and rng.random() < 0.3:
            recs[2]["prompt_tokens"] = [1, 2, 3, 9]
        if rng.random() < 0.3:
            recs.insert(rng.randrange(len(recs) + 1), dict(recs[0]))
        if rng.random() < 0.5:  # its outcome, anywhere among its turns
            last = max(recs, key=lambda r: r["turn"])["request_id"]
            ev = outcome_event(f"s{s}", last, rng.choice(OUTCOMES))
            recs.insert(rng.randrange(len(recs) + 1), ev)
        streams.append(recs)
    streams.append([turn_rec("c", None, [1], [2], rid=f"c{i}") for i in range(rng.randint(0, 3))])
    return _interleave(rng, streams)


def _interleave(rng: random.Random, streams: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out, queues = [], [list(s) for s in streams if s]
    while queues:
        q = rng.choice(queues)
        i = 1 if len(q) > 1 and rng.random() < 0.2 else 0  # now and then one turn early
        out.append(q.pop(i))
        queues = [q for q in queues if q]
    return out


BOUNDED = LedgerConfig(idle_s=12.0, retention_s=50.0, max_turns=4, max_open_sessions=2)


def _feed(
    recs: list[dict[str, Any]], restart_at: int | None, cfg: LedgerConfig = BOUNDED
) -> list[Emit]:
    """Feed `recs` two seconds apart (then end every session), rebuilding the ledger from a JSON
    copy of its table before record `restart_at`, as a worker restarted from the changelog would."""
    table: dict[str, dict] = {}
    ledger, out = Ledger(cfg, table, V2), []
    for i, rec in enumerate(recs):
        if i == restart_at:
            table = orjson.loads(orjson.dumps(table))
            ledger = Ledger(cfg, table, V2)
        if rec.get("type") == "session_outcome":
            out += ledger.on_outcome(rec, 100.0 + 2.0 * i)
        else:
            out += ledger.on_rollout(rec, 100.0 + 2.0 * i)
    t = 100.0 + 2.0 * len(recs)
    for sid in sorted({r["session_id"] for r in recs}):
        out += ledger.end_session(sid, t)
    return out + ledger.advance(t + 1000.0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), restart=st.integers(0, 30))
def test_a_restart_at_any_point_gives_the_same_records(seed, restart):
    recs = _mixed_workload(seed)
    assert _feed(recs, restart) == _feed(recs, None)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_every_turn_lands_exactly_once_in_a_record_or_late(seed):
    recs = _mixed_workload(seed)
    out = _feed(recs, None)
    late = [e.key for e in out if e.topic == "late" and "outcome" not in e.value["event"]]
    landed = _request_ids([e for e in out if e.topic == "rollouts"]) + late
    turns = [r for r in recs if r.get("type") != "session_outcome"]
    assert sorted(landed) == sorted({r["request_id"] for r in turns}), (landed, recs)
    outcomes = {r["session_id"]: r["outcome"] for r in recs if r.get("type") == "session_outcome"}
    for e in out:
        if e.topic == "rollouts" and "outcome" in e.value:  # an outcome reaches only its session
            assert e.value["outcome"] == outcomes[e.value["session_id"]], e.value
    for e in out:
        if e.topic == "rollouts":
            Rollout.model_validate(e.value)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), other=st.integers(0, 2**32 - 1))
def test_any_interleaving_within_the_window_gives_the_same_records(seed, other):
    """With the window and the bounds out of reach, the records do not depend on arrival order."""
    recs = _mixed_workload(seed)
    reordered = _interleave(random.Random(other), _by_session(recs))
    roomy = LedgerConfig(idle_s=1000.0, retention_s=5000.0)
    first, second = (
        sorted((e for e in _feed(r, None, roomy) if e.topic == "rollouts"), key=lambda e: e.key)
        for r in (recs, reordered)
    )
    assert first == second


def _by_session(recs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The records of each session, in the order of their turns."""
    sessions: dict[str, list[dict[str, Any]]] = {}
    for rec in recs:
        sessions.setdefault(rec["session_id"], []).append(rec)
    return [sorted(s, key=lambda r: r.get("turn") or 0) for s in sessions.values()]


# --- protected writes (sessions-v2) -------------------------------------------------------------
GUARDED = resolve_spec("sessions-v2")


def guarded_session(sid: str, n: int, writes: dict[int, int]) -> list[dict[str, Any]]:
    """`agent_session` labelled under sessions-v2: turn k counts `writes.get(k, 0)` protected
    writes (every chat turn carries the count, 0 included, as the join writes it)."""
    recs = agent_session(sid, n)
    for k, rec in enumerate(recs):
        rec.update(reward_spec="sessions-v2", protected_writes=writes.get(k, 0))
    return recs


def test_a_session_that_wrote_a_protected_path_gets_protected_write_for_its_outcome():
    recs = guarded_session("s1", 3, {1: 2})
    recs[2].update(reward=0.75)
    ledger = Ledger(LedgerConfig(), {}, GUARDED)
    out = [e for i, r in enumerate(recs) for e in ledger.on_rollout(r, 1.0 + i)]
    out += ledger.on_outcome(outcome_event("s1", "s1-t2", "success"), 9.0)
    [rec] = rollouts(out)
    assert rec["outcome"] == "success" and rec["outcome_reward"] == -1.0, rec
    assert rec["reward"] == 0.75 - 1.0 and rec["protected_writes"] == 2
    assert [t["reward"] for t in rec["turns"]] == [0.0, 0.0, 0.75]  # the turns' own rewards
    Rollout.model_validate(rec)
    # the same session without the write: the outcome's weight, and no count on the record
    clean = guarded_session("s2", 3, {})
    ledger = Ledger(LedgerConfig(), {}, GUARDED)
    out = [e for i, r in enumerate(clean) for e in ledger.on_rollout(r, 1.0 + i)]
    [rec] = rollouts(out + ledger.on_outcome(outcome_event("s2", "s2-t2"), 9.0))
    assert rec["outcome_reward"] == 1.0 and "protected_writes" not in rec, rec


def test_a_one_turn_segment_carries_the_sessions_count_not_the_turns_own():
    [rec] = guarded_session("s1", 1, {0: 1})
    ledger = Ledger(LedgerConfig(), {}, GUARDED)
    out = ledger.on_outcome(outcome_event("s1", "s1-t0", "failure"), 1.0)
    [value] = rollouts(out + ledger.on_rollout(rec, 2.0))
    assert value["protected_writes"] == 1 and value["outcome_reward"] == -1.0
    assert value["reward"] == -1.0 and "turn" not in value, value
    [clean] = guarded_session("s2", 1, {})
    out = ledger.on_rollout(clean, 3.0) + ledger.on_outcome(outcome_event("s2", "s2-t0"), 4.0)
    [value] = rollouts(out)
    assert "protected_writes" not in value and value["outcome_reward"] == 1.0, value


def test_every_segment_gets_the_value_the_whole_session_decides():
    """The outcome arrives first (turns wait for their windows), a compaction breaks the session,
    and the write is in the last turn: the segment the break closed waits for the end and gets
    protected_write too. sessions-v1 sends it at the break with the outcome's weight, as before
    (and counts nothing: the turns' counts, labelled under sessions-v2, are not its spec's)."""
    recs = guarded_session("s1", 4, {3: 1})
    recs[2]["prompt_tokens"] = [1, 2, 3, 9]  # the client compacted its history
    recs[3]["prompt_tokens"] = [1, 2, 3, 9, *recs[2]["completion_tokens"], 52, 53]
    for spec, sent_at_break, value in ((GUARDED, 0, -1.0), (V2, 1, 1.0)):
        ledger = Ledger(LedgerConfig(), {}, spec)
        out = ledger.on_outcome(outcome_event("s1", "s1-t3", "success"), 0.5)
        out += ledger.on_rollout(recs[0], 1.0) + ledger.on_rollout(recs[1], 2.0)
        at_break = rollouts(ledger.on_rollout(recs[2], 3.0))
        assert len(at_break) == sent_at_break, (spec.version, at_break)
        first, second = at_break + rollouts(ledger.on_rollout(recs[3], 4.0))
        assert first["segment_closed_by"] == "history_rewritten" and len(first["turns"]) == 2
        assert second["request_id"] == "s1-t2" and second["segment_closed_by"] == "end"
        assert len(second["turns"]) == 2 and rollouts(out) == []
        assert first["outcome_reward"] == second["outcome_reward"] == value, spec.version
        if spec is GUARDED:
            assert first["protected_writes"] == second["protected_writes"] == 1
            assert first["reward"] == second["reward"] == -1.0
        else:
            assert "protected_writes" not in first and "protected_writes" not in second


def test_held_segments_get_the_sessions_final_count_with_the_outcome():
    recs = guarded_session("s1", 3, {0: 1, 2: 1})
    recs[2]["prompt_tokens"] = [1, 2, 3, 9]
    ledger = Ledger(LedgerConfig(), {}, GUARDED)
    out = [e for i, r in enumerate(recs) for e in ledger.on_rollout(r, 1.0 + i)]
    assert rollouts(out) == [] and ledger.session("s1").protected_writes == 2
    out += ledger.on_outcome(outcome_event("s1", "s1-t2", "failure"), 9.0)
    first, second = rollouts(out)
    assert first["protected_writes"] == second["protected_writes"] == 2
    assert first["outcome_reward"] == second["outcome_reward"] == -1.0
    assert (
        list(first)[-3:] == list(second)[-3:] == ["outcome", "outcome_reward", "protected_writes"]
    )


def test_the_protected_write_count_round_trips_and_old_states_load_without_it():
    recs = guarded_session("s1", 2, {0: 3})
    table: dict[str, dict] = {}
    ledger = Ledger(LedgerConfig(), table, GUARDED)
    ledger.on_rollout(recs[0], 1.0)
    stored = orjson.loads(orjson.dumps(table["s1"]))
    assert stored["pw"] == 3 and Session.from_stored(stored).to_stored() == stored
    restored = Ledger(LedgerConfig(), {"s1": stored}, GUARDED)
    out = restored.on_rollout(recs[1], 2.0) + restored.on_outcome(outcome_event("s1", "s1-t1"), 3.0)
    [rec] = rollouts(out)
    assert rec["protected_writes"] == 3 and rec["outcome_reward"] == -1.0
    # a state stored before the count existed (no "pw") loads with 0 and is written back as it was
    old = {k: v for k, v in stored.items() if k != "pw"}
    sess = Session.from_stored(old)
    assert sess.protected_writes == 0 and sess.to_stored() == old
    restored = Ledger(LedgerConfig(), {"s1": old}, GUARDED)
    out = restored.on_rollout(recs[1], 2.0) + restored.on_outcome(outcome_event("s1", "s1-t1"), 3.0)
    [rec] = rollouts(out)
    assert "protected_writes" not in rec and rec["outcome_reward"] == 1.0
