"""The sessions projection of `<ns>.rollouts` (app/projector/sessions.py) on a real (SQLite)
database, without a broker: a record's segment and turn rows, one-call records, relabelled
copies, redelivery, refusals, the rebuild's reset, and a record the real session ledger wrote."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from app.contracts.deployments import InvalidRecord
from app.db.models import SessionSegment, SessionTurn
from app.projector.projector import apply_rollout_or_skip, projection_rows, reset_projections
from app.projector.sessions import apply_rollout, decode_rollout, session_rows
from tests.unit.deployments.rollout_records import logged, one_call, segment, weakened_segment


def _turns(session: Session, key: str) -> list[SessionTurn]:
    return list(
        session.scalars(
            sa.select(SessionTurn)
            .where(SessionTurn.record_key == key)
            .order_by(SessionTurn.position)
        )
    )


def test_a_multi_turn_record_is_one_segment_with_a_row_per_turn(session: Session) -> None:
    rec = segment(
        "s1",
        ["r0", "r1", "r2"],
        ["4", "4", "5"],
        [0.5, -0.25, 0.0],
        outcome="success",
        outcome_reward=1.0,
        closed_by="idle",
    )
    assert apply_rollout(session, logged(rec, partition=2, offset=17)) is True
    session.commit()
    seg = session.get(SessionSegment, "r0")
    assert (seg.session_id, seg.request_id, seg.relabel_run, seg.reward_spec) == (
        "s1",
        "r0",
        None,
        "v1",
    )
    assert (seg.opened_by, seg.closed_by, seg.outcome, seg.outcome_reward) == (
        "session_start",
        "idle",
        "success",
        1.0,
    )
    assert (seg.turn_count, seg.prompt_tokens, seg.completion_tokens, seg.sampled_tokens) == (
        3,
        3,
        13,
        9,
    ), "13 completion tokens: 3 sampled per turn and 2 of each tool answer between them"
    assert seg.reward == pytest.approx(1.25) and seg.model_version == "5"
    assert (seg.kafka_partition, seg.kafka_offset) == (2, 17)
    assert seg.generated_at.replace(tzinfo=UTC) == datetime(2026, 11, 27, 10, 0, tzinfo=UTC)
    turns = _turns(session, "r0")
    assert [(t.position, t.request_id, t.model_version, t.reward) for t in turns] == [
        (0, "r0", "4", 0.5),
        (1, "r1", "4", -0.25),
        (2, "r2", "5", 0.0),
    ]
    assert {t.session_id for t in turns} == {"s1"} and [t.sampled_tokens for t in turns] == [3] * 3
    assert [t.finish_reason for t in turns] == ["tool_calls", "tool_calls", "stop"]


def test_a_one_call_record_is_a_segment_of_one_turn_whose_reward_leaves_out_the_outcome(
    session: Session,
) -> None:
    rec = one_call("c1", "s2", version="7", reward=1.75, outcome="failure", outcome_reward=1.0)
    assert apply_rollout(session, logged(rec)) is True
    seg = session.get(SessionSegment, "c1")
    assert (seg.turn_count, seg.sampled_tokens, seg.opened_by, seg.closed_by) == (1, 3, None, None)
    assert (seg.reward, seg.outcome) == (1.75, "failure")
    [turn] = _turns(session, "c1")
    assert (turn.request_id, turn.model_version, turn.reward) == ("c1", "7", 0.75), (
        "a turn's own reward is the record's less the outcome's share"
    )
    assert turn.components["decision"] == 0.75


def test_a_redelivered_record_changes_nothing_and_keeps_its_first_offset(session: Session) -> None:
    rec = segment("s3", ["a0", "a1"], ["2", "2"], [0.25, 0.5])
    assert apply_rollout(session, logged(rec, offset=5)) is True
    session.commit()
    before = session_rows(session)
    again = {**rec, "labelled_at": "2026-11-27T11:00:00.000000Z"}  # a re-delivery after a crash
    assert apply_rollout(session, logged(again, offset=9)) is False
    assert apply_rollout(session, logged(rec, offset=5)) is False, "the same record read again"
    session.commit()
    assert session_rows(session) == before
    assert session.get(SessionSegment, "a0").kafka_offset == 5


def test_a_relabelled_record_is_its_own_segment_beside_the_live_one(session: Session) -> None:
    live = segment("s4", ["b0", "b1"], ["3", "3"], [0.75, 0.0])
    relabelled = {**live, "reward_spec": "hackable-tools", "relabel_run": "run-1", "reward": 2.0}
    assert apply_rollout(session, logged(live, offset=1)) is True
    assert apply_rollout(session, logged(relabelled, offset=2)) is True
    session.commit()
    keys = session.scalars(
        sa.select(SessionSegment.record_key).where(SessionSegment.session_id == "s4")
    ).all()
    assert sorted(keys) == ["b0", "b0|hackable-tools"]
    copy = session.get(SessionSegment, "b0|hackable-tools")
    assert (copy.relabel_run, copy.reward_spec, copy.reward) == ("run-1", "hackable-tools", 2.0)
    assert len(_turns(session, "b0|hackable-tools")) == 2


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"not json", "invalid_json"),
        (b"", "invalid_json"),
        (b'{"request_id": "x"}', "invalid_rollout"),
    ],
)
def test_a_record_that_is_not_a_rollout_is_refused_at_decode_with_a_reason(
    value: bytes, reason: str
) -> None:
    with pytest.raises(InvalidRecord) as err:
        decode_rollout(value)
    assert err.value.reason == reason and err.value.errors, err.value


def test_a_value_too_long_for_its_column_is_refused_alone_and_leaves_no_row(
    session: Session,
) -> None:
    bad = one_call("long", "s5", version="9" * 33)
    good = one_call("ok", "s5")
    applied, failed = apply_rollout_or_skip(session, logged(bad, offset=0))
    assert not applied and isinstance(failed, ValueError) and "model_version" in str(failed)
    assert apply_rollout_or_skip(session, logged(good, offset=1)) == (True, None)
    session.commit()
    assert session.scalars(sa.select(SessionSegment.record_key)).all() == ["ok"]
    assert [t.record_key for t in session.scalars(sa.select(SessionTurn))] == ["ok"]


def test_the_rebuild_reset_empties_the_sessions_tables(session: Session) -> None:
    apply_rollout(session, logged(segment("s6", ["c0", "c1"], ["1", "2"], [0.0, 0.0])))
    session.commit()
    reset_projections(session)
    session.commit()
    rows = projection_rows(session)
    assert rows["session_segments"] == [] and rows["session_turns"] == []


def test_a_segment_the_session_ledger_assembled_projects_turn_for_turn(session: Session) -> None:
    from tests.unit.streams.test_ledger import agent_session, rollouts, run

    _, out = run(agent_session("agent", 3))
    [emit] = [e for e in out if e.topic == "rollouts"]
    rec = {**rollouts([emit])[0]}
    # what the ledger's worker adds to the record it emits (app/contracts/rollouts.py)
    rec.update(segment_opened_by=emit.opened_by, segment_closed_by=emit.closed_by)
    assert apply_rollout(session, logged(rec, offset=3)) is True
    seg = session.get(SessionSegment, emit.key)
    assert (seg.session_id, seg.turn_count, seg.opened_by, seg.closed_by) == (
        "agent",
        3,
        "session_start",
        "end",
    )
    assert seg.sampled_tokens == sum(rec["loss_mask"]) == 9
    assert [t.request_id for t in _turns(session, emit.key)] == [
        t["request_id"] for t in rec["turns"]
    ]


def test_a_segments_protected_writes_are_stored_as_the_record_gives_them(
    session: Session,
) -> None:
    hacked = weakened_segment("s7", ["h0", "h1"])
    clean = segment("s8", ["k0", "k1"], ["4", "4"], [0.0, 0.25], outcome="success")
    counted_none = one_call("z0", "s9", reward_spec="sessions-v2", protected_writes=0)
    for offset, rec in enumerate((hacked, clean, counted_none)):
        assert apply_rollout(session, logged(rec, offset=offset)) is True
    session.commit()
    got = {key: session.get(SessionSegment, key).protected_writes for key in ("h0", "k0", "z0")}
    assert got == {"h0": 2, "k0": None, "z0": 0}, (
        "2 as given; None without a count (not 0); a 0 the record gives stays 0"
    )


def test_a_segment_the_ledger_sent_under_sessions_v2_keeps_its_sessions_protected_writes(
    session: Session,
) -> None:
    from streams.ledger import Ledger, LedgerConfig
    from tests.unit.streams.test_ledger import GUARDED, guarded_session, outcome_event, rollouts

    ledger = Ledger(LedgerConfig(), {}, GUARDED)
    recs = guarded_session("v2", 3, {1: 2})  # turn 1 wrote the test file twice
    out = [e for i, r in enumerate(recs) for e in ledger.on_rollout(r, 1.0 + i)]
    out += ledger.on_outcome(outcome_event("v2", "v2-t2", "success"), 9.0)
    [rec] = rollouts(out)
    assert apply_rollout(session, logged(rec, offset=4)) is True
    seg = session.get(SessionSegment, "v2-t0")
    assert (seg.reward_spec, seg.outcome, seg.outcome_reward, seg.protected_writes) == (
        "sessions-v2",
        "success",
        -1.0,
        2,
    )
