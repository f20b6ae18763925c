"""The sessions projection of `<ns>.rollouts` on the real broker, SQLite and PostgreSQL: the
projector's follower projects agent sessions' records (a multi-turn segment, one-call records,
a relabelled copy, a re-delivered copy, a record that is not a rollout), dead-letters the bad
one, and a rebuild into an empty database and in place gives the same rows.

    .venv/bin/pytest tests/integration/deployments/test_sessions.py -q
"""

from __future__ import annotations

import json
import threading

import pytest
import sqlalchemy as sa
from kafka import TopicPartition
from sqlalchemy.orm import Session

from app.infra.kafka import make_consumer, make_producer
from app.projector.projector import follow, rebuild
from app.projector.sessions import session_rows
from tests.integration.streams.conftest import read_topic
from tests.unit.deployments.rollout_records import compacted_session, kafka_key, one_call
from tests.waiting import poll

pytestmark = pytest.mark.integration

GROUP = "sessions-test"


def _records() -> list[dict]:
    agent, second, relabelled = compacted_session()
    return [
        agent,
        second,
        one_call("c0", "editor-1"),
        one_call("c1", "editor-1", at=30.0),
        relabelled,
    ]


def _rows(url: str) -> dict:
    engine = sa.create_engine(url)
    try:
        with Session(engine) as s:
            return session_rows(s)
    finally:
        engine.dispose()


def _caught_up(settings) -> bool:
    """The follower committed every offset of `<ns>.rollouts` written so far."""
    topic = settings.topic("rollouts")
    c = make_consumer(settings, group_id=GROUP)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic))]
        end = c.end_offsets(tps)
        return all((c.committed(tp) or 0) >= end[tp] for tp in tps)
    finally:
        c.close()


def test_followed_sessions_equal_a_rebuild_and_a_bad_record_is_dead_lettered(
    make_settings, db_pair
) -> None:
    incremental, rebuilt = db_pair
    settings = make_settings()
    records = _records()
    stop = threading.Event()
    errors: list[BaseException] = []

    def _follow() -> None:
        try:
            follow(settings, db_url=incremental, stop=stop, group_id=GROUP, poll_timeout_s=0.2)
        except BaseException as exc:  # surfaced by the asserts below
            errors.append(exc)

    follower = threading.Thread(target=_follow, daemon=True)
    follower.start()
    producer = make_producer(settings, profile="immediate")
    topic = settings.topic("rollouts")
    try:
        for rec in records:
            producer.send(topic, key=kafka_key(rec), value=json.dumps(rec).encode()).get(10)
        again = {**records[0], "labelled_at": "2026-11-27T12:00:00.000000Z"}  # re-delivered
        producer.send(topic, key=kafka_key(again), value=json.dumps(again).encode()).get(10)
        producer.send(topic, key="bad", value=b'{"request_id": "bad"}').get(10)
        poll(
            lambda: errors or not follower.is_alive() or _caught_up(settings),
            120,
            "the follower to commit the rollouts topic",
        )
    finally:
        producer.close()
        stop.set()
        follower.join(30)
    assert not follower.is_alive() and not errors, errors

    a = _rows(incremental)
    keys = sorted(r["record_key"] for r in a["session_segments"])
    assert keys == ["a0", "a0|hackable-tools", "a3", "c0", "c1"], keys
    first = next(r for r in a["session_segments"] if r["record_key"] == "a0")
    assert first["labelled_at"].isoformat() != "2026-11-27T12:00:00+00:00", (
        "the re-delivered copy must not replace the first one"
    )
    assert len(a["session_turns"]) == 3 + 2 + 1 + 1 + 3

    letters = [
        json.loads(r.value)
        for r in read_topic(settings, settings.topic("dlq"), 1, timeout=20, settle=0.0)
    ]
    assert [(d["consumer"], d["reason"], d["topic"]) for d in letters] == [
        ("projector", "invalid_rollout", topic)
    ], letters

    report = rebuild(settings, db_url=rebuilt)
    assert (report.rollouts_read, report.rollouts_applied) == (len(records) + 2, len(records))
    assert _rows(rebuilt) == a, "the rebuilt sessions projection differs from the followed one"
    rebuild(settings, db_url=incremental)  # in place
    assert _rows(incremental) == a, "the sessions projection differs after an in-place rebuild"
