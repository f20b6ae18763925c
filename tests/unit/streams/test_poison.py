"""No record stops the streams worker: whatever fails after decode is a DLQ record and the worker goes on.

Drives the real Runtime and Aggregator without a broker (the outbox is the in-memory one of
test_agent.py). Where a failure inside the join has to be provoked, the reward computation is
replaced for one request_id by a function that raises (no valid event makes it raise any more:
that is the point of the shared timestamp parser); everything else is the real code. The
broker-backed counterpart is tests/integration/hostile/test_poison_records.py.
"""

from __future__ import annotations

import base64
import json
import math

import orjson
from faust.types import Message

import streams.labels as labels_mod
from app.contracts.rollouts import DlqRecord, empty_sums
from tests.unit.streams.factories import feedback, generation
from tests.unit.streams.test_agent import _setup
from tests.unit.streams.test_labels import make_agg


def _msg(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    ts: float = 100.0,
) -> Message:
    return Message(topic, partition, offset, ts, 0, None, key, value, b"")


def _failing_reward(bad_rid: str, monkeypatch) -> None:
    real = labels_mod.compute_reward

    def reward(spec, fb):
        if any(f["request_id"] == bad_rid for f in fb):
            raise RuntimeError("reward exploded")
        return real(spec, fb)

    monkeypatch.setattr(labels_mod, "compute_reward", reward)


def test_a_label_that_fails_to_close_is_dead_lettered_and_the_other_labels_still_close(monkeypatch):
    _failing_reward("bad", monkeypatch)
    agg = make_agg()
    out = []
    for rid, t in (("good1", 0.0), ("bad", 1.0), ("good2", 2.0)):
        out += agg.on_event(0, generation(rid), t)
        out += agg.on_event(0, feedback(rid, f"{rid}-a", "accept"), t + 0.5)
    out += agg.on_tick(0, 100.0)  # closes all three in one watermark move
    assert sorted(e.key for e in out if e.topic == "rollouts") == ["good1", "good2"]
    dead = [e for e in out if e.topic == "dlq"]
    assert sorted(e.value["event"]["event_id"] for e in dead) == sorted(
        [generation("bad")["event_id"], "bad-a"]
    )
    assert {e.key for e in dead} == {"bad"} and {e.value["reason"] for e in dead} == {
        "label_close_failed"
    }
    assert "reward exploded" in dead[0].value["errors"][0]["message"]
    assert (
        agg.labels["bad"]["st"] == "idle" and "bad" not in agg.generations and agg.open_labels == 0
    )
    # a replayed event of the failed label is a duplicate, not a new label
    assert agg.on_event(0, feedback("bad", "bad-a", "accept"), 101.0) == [] and agg.duplicates == 1


def test_the_runtime_turns_a_failed_close_into_the_event_s_dlq_envelope_and_a_failed_join_into_processing_failed(
    monkeypatch,
):
    _failing_reward("bad", monkeypatch)
    _, rt, _ = _setup()
    for offset, ev in enumerate((generation("bad"), feedback("bad", "bad-a", "reject"))):
        raw = json.dumps(ev).encode()
        assert (
            rt.on_record(_msg(rt.interactions, 0, offset, b"bad", raw, ts=100.0), b"bad", raw) == []
        )
    tick = json.dumps({"now": 1e9, "hw": 2}).encode()
    dead = rt.on_tick(_msg(rt.ticks, 0, 0, None, tick), tick)
    assert [d.topic for d in dead] == ["dlq", "dlq"]
    env = DlqRecord.model_validate(dead[0].value)
    assert (env.reason, env.consumer, env.topic, env.partition, env.offset) == (
        "label_close_failed",
        "streams",
        rt.interactions,
        0,
        None,
    )
    assert (
        orjson.loads(base64.b64decode(env.value_b64)) == generation("bad")
        and base64.b64decode(env.key_b64) == b"bad"
    )
    assert orjson.loads(base64.b64decode(dead[1].value["value_b64"]))["event_id"] == "bad-a"

    def explode(p, ev, rt_):
        raise KeyError("boom")

    monkeypatch.setattr(rt.aggregator, "on_event", explode)
    good = json.dumps(generation("g")).encode()
    [dead] = rt.on_record(_msg(rt.interactions, 0, 2, b"g", good), b"g", good)
    env = DlqRecord.model_validate(dead.value)
    assert (
        env.reason == "processing_failed"
        and env.offset == 2
        and base64.b64decode(env.value_b64) == good
    )
    assert "KeyError" in env.errors[0]["message"] and rt.last_processed[0] == 2


def test_a_feedback_with_a_lower_case_z_as_it_may_sit_on_the_topic_closes_its_label():
    """A record whose ts is not in ingest's canonical form (written by another producer, or
    before ingest rewrote `ts`), and the label closes with the feedback counted."""
    _, rt, _ = _setup()
    gen = generation("r1")
    fb = feedback("r1", "z1", "accept")
    fb["ts"] = fb["ts"].replace("Z", "z")
    assert fb["ts"].endswith("z")
    for offset, ev in enumerate((gen, fb)):
        raw = json.dumps(ev).encode()
        assert (
            rt.on_record(
                _msg(rt.interactions, 0, offset, b"r1", raw, ts=100.0 + offset), b"r1", raw
            )
            == []
        )
    tick = json.dumps({"now": 1e9, "hw": 2}).encode()
    out = rt.on_tick(_msg(rt.ticks, 0, 0, None, tick), tick)
    [rollout] = [e for e in out if e.topic == "rollouts"]
    assert rollout.value["reward"] == 0.75 and not [e for e in out if e.topic == "dlq"]


def test_malformed_ticks_and_partials_are_dead_lettered_with_their_bytes():
    _, rt, _ = _setup()
    for raw in (
        b"not json",
        b'{"now": "soon", "hw": 1}',
        b'{"hw": 1}',
        b'{"now": 1e999, "hw": 0}',
        None,
    ):
        [dead] = rt.on_tick(_msg(rt.ticks, 2, 5, None, raw), raw)
        assert dead.value["reason"] == "invalid_tick" and dead.value["topic"] == rt.ticks
        assert dead.value["value_b64"] == (
            base64.b64encode(raw).decode() if raw is not None else None
        )
    partials = rt.topics["partials"].get_topic_name()
    rt.merger.state = {}  # the Faust table takes writes only inside an agent's event; its contents are what matters here
    good = {
        "model_version": "7",
        "bucket_start": 0.0,
        "bucket_seconds": 2.0,
        "partition": 0,
        "reward_spec": "v1",
        "sums": dict(empty_sums(), n=1.0, reward_sum=0.5, reward_sumsq=0.25),
    }
    for bad in (
        b"[1, 2",
        json.dumps({**good, "sums": {"n": "many"}}).encode(),
        json.dumps({"partition": 0}).encode(),
        json.dumps({**good, "bucket_seconds": 0}).encode(),
    ):
        dead = rt.on_partial(_msg(partials, 0, 9, b"7", bad), bad)
        assert dead.topic == "dlq" and dead.value["reason"] == "invalid_partial"
        assert base64.b64decode(dead.value["value_b64"]) == bad
    assert dict(rt.merger.state) == {}  # nothing of a refused partial was stored
    rec = rt.on_partial(_msg(partials, 0, 10, b"7", b""), json.dumps(good).encode())
    assert (
        rec.topic == "version-metrics"
        and rec.value["n"] == 1
        and math.isclose(rec.value["reward_mean"], 0.5)
    )
