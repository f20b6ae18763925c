"""The Faust agent with `test_context()`: records in, rollouts/late/DLQ and changelog records out, no broker.

The runtime's outbox (what sends records to Kafka) is swapped for an in-memory one that
keeps every (topic, key, value, partition) so the test reads what the agent produced;
the agent code, the Faust stream with its batches, the aggregator and the tables are the
real ones. The broker-backed path is covered by tests/integration/streams.
"""

from __future__ import annotations

import asyncio
import base64
import json

from faust.types import Message

from app.settings import Settings
from streams.app import build_app
from streams.config import StreamsConfig
from tests.unit.streams.factories import feedback, generation


class ListOutbox:
    """Stands in for streams.outbox.KafkaOutbox: keeps (topic, key, value, partition) of every record sent."""

    def __init__(self):
        self.sent: list[tuple[str, bytes | None, bytes | None, int | None]] = []

    async def send(self, topic, records):
        self.sent += [(topic, *rec) for rec in records]
        return {}

    def values(self, topic: str) -> list[tuple[bytes | None, bytes | None]]:
        return [(k, v) for t, k, v, _ in self.sent if t == topic]


def _setup(**cfg):
    app, rt = build_app(
        Settings(kafka_bootstrap="127.0.0.1:1", wait_window=5.0, topic_namespace="unit"),
        StreamsConfig(metrics_port=0, **cfg),
    )
    rt.outbox = ListOutbox()
    return app, rt, rt.outbox


def _delivered(
    rt, rid: str, partition: int, offset: int, generation_id: int = 0, ts: float = 100.0
):
    """A generation record of the interactions topic as the agent's batch holds it (Faust's event)."""
    from types import SimpleNamespace

    value = json.dumps(generation(rid)).encode()
    msg = Message(
        rt.interactions,
        partition,
        offset,
        ts,
        0,
        None,
        rid.encode(),
        value,
        b"",
        generation_id=generation_id,
    )
    return SimpleNamespace(message=msg, key=rid.encode(), value=value)


async def _settle(rt, outbox, n_in: int) -> None:
    """Wait until the agent finished the batches holding `n_in` records (the last one closes after batch_within)."""
    for _ in range(250):
        if rt.records_done >= n_in:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"agent finished {rt.records_done} of {n_in} records")


def test_agent_joins_labels_and_dead_letters_via_test_context():
    async def scenario():
        app, rt, outbox = _setup()
        agent = app.flywheel_agents["aggregate"]
        async with agent.test_context() as ctx:
            put = ctx.put
            await put(
                key=b"r1", value=json.dumps(feedback("r1", "a", "accept")).encode(), timestamp=100.0
            )
            await put(key=b"r1", value=json.dumps(generation("r1")).encode(), timestamp=101.0)
            await put(
                key=b"r1", value=json.dumps(feedback("r1", "a", "accept")).encode(), timestamp=102.0
            )  # duplicate
            await put(key=b"r2", value=json.dumps(generation("r2")).encode(), timestamp=103.0)
            await put(key=b"x", value=b"{broken", timestamp=104.0)
            await put(
                key=b"zz", value=json.dumps(feedback("r9", "b", "reject")).encode(), timestamp=104.5
            )
            await put(
                key=b"r1", value=json.dumps(feedback("r1", "c", "reject")).encode(), timestamp=106.5
            )  # closes r1
            await put(
                key=b"r3", value=json.dumps(feedback("r3", "d", "rating")).encode(), timestamp=109.0
            )  # closes r2
            await put(
                key=b"r3", value=json.dumps(feedback("r3", "e", "rating")).encode(), timestamp=115.0
            )  # orphans d
            await _settle(rt, outbox, 9)
        rollouts = [json.loads(v) for _, v in outbox.values("unit.rollouts")]
        late = [json.loads(v) for _, v in outbox.values("unit.late")]
        dlq = [json.loads(v) for _, v in outbox.values("unit.dlq")]
        assert [(r["request_id"], r["reward"], r["components"] is None) for r in rollouts] == [
            ("r1", 0.75, False),
            ("r2", 0.0, True),
        ]
        assert sorted((x["reason"], x["event"]["event_id"]) for x in late) == [
            ("after_close", "c"),
            ("orphan", "d"),
        ]
        assert [d["reason"] for d in dlq] == ["invalid_json", "key_mismatch"]
        assert base64.b64decode(dlq[0]["value_b64"]) == b"{broken"
        assert rt.aggregator.duplicates == 1
        assert [k for k, _ in outbox.values("unit.rollouts")] == [b"r1", b"r2"]
        assert all(k is None for k, _ in outbox.values("unit.dlq"))

    asyncio.run(scenario())


def test_a_batch_writes_each_touched_key_once_to_the_changelog_after_its_outputs():
    async def scenario():
        app, rt, outbox = _setup(batch_max_events=1000, batch_within=0.3)
        agent = app.flywheel_agents["aggregate"]
        labels = rt.views["labels"].table
        async with agent.test_context() as ctx:
            # one batch: a generation and four feedback events of r1, then a record that closes r1
            await ctx.put(
                key=b"r1", value=json.dumps(generation("r1")).encode(), timestamp=100.0, partition=1
            )
            for i, kind in enumerate(["accept", "rating", "followup", "edit_persistence"]):
                await ctx.put(
                    key=b"r1",
                    value=json.dumps(feedback("r1", f"f{i}", kind)).encode(),
                    timestamp=101.0 + i,
                    partition=1,
                )
            await ctx.put(
                key=b"r2", value=json.dumps(generation("r2")).encode(), timestamp=106.0, partition=1
            )
            await _settle(rt, outbox, 6)
        changelog = labels.changelog_topic.get_topic_name()
        label_writes = [(json.loads(k), p) for t, k, _, p in outbox.sent if t == changelog]
        assert sorted(label_writes) == [("r1", 1), ("r2", 1)], (
            label_writes
        )  # not one record per event
        topics = [t for t, *_ in outbox.sent]
        assert topics.index("unit.rollouts") < topics.index(changelog), (
            topics
        )  # outputs first, then state
        [(_, value)] = outbox.values("unit.rollouts")
        assert json.loads(value)["reward"] == 0.75 + 0.5 + 0.25 + 0.5
        # the changelog record decodes (as Faust's recovery decodes it) to what the store holds
        [(key, value)] = [
            (k, v) for t, k, v, _ in outbox.sent if t == changelog and json.loads(k) == "r1"
        ]
        msg = Message(changelog, 1, 0, 0.0, 0, None, key, value, b"")
        event = await labels.changelog_topic.decode(msg)
        assert (
            event.key == "r1" and event.value == labels.data["r1"] and event.value["st"] == "closed"
        )

    asyncio.run(scenario())


def test_the_state_carries_its_input_progress_and_a_generation_goes_only_after_its_closed_label():
    """Per batch: labels and generation upserts, then the buckets changelog with the progress of
    each input partition (last, so a state that has the progress has everything before it); the
    deletion of a closed label's generation waits for the next batch. A restarted worker resumes at
    progress + 1 (resume_from_state, covered on the broker by tests/integration/streams)."""
    from streams.runtime import progress_key

    async def scenario():
        app, rt, outbox = _setup(batch_max_events=1000, batch_within=0.3)
        agent = app.flywheel_agents["aggregate"]
        names = {n: v.changelog for n, v in rt.views.items()}
        async with agent.test_context() as ctx:
            await ctx.put(
                key=b"r1", value=json.dumps(generation("r1")).encode(), timestamp=100.0, partition=2
            )
            await ctx.put(
                key=b"r1",
                value=json.dumps(feedback("r1", "f0", "accept")).encode(),
                timestamp=101.0,
                partition=2,
            )
            await ctx.put(
                key=b"r2", value=json.dumps(generation("r2")).encode(), timestamp=106.0, partition=2
            )  # closes r1
            last_offset = ctx.sent_offset - 1
            await _settle(rt, outbox, 3)
            first_batch = list(outbox.sent)
            await ctx.put(
                key=b"r3", value=json.dumps(generation("r3")).encode(), timestamp=106.5, partition=2
            )
            await _settle(rt, outbox, 4)
        order = [(t, json.loads(k) if t in names.values() else k, v) for t, k, v, _ in first_batch]
        topics = [t for t, *_ in order]
        progress = [
            i for i, (t, k, _) in enumerate(order) if t == names["buckets"] and k == progress_key(2)
        ]
        assert progress and progress[-1] == len(order) - 1, (
            topics
        )  # the progress is the batch's last record
        assert json.loads(order[progress[-1]][2]) == {"offset": last_offset}
        assert rt.views["buckets"].table.data[progress_key(2)] == {
            "offset": last_offset + 1
        }  # after the second batch
        gen_writes = [(k, v) for t, k, v in order if t == names["generations"]]
        assert ("r1", None) not in gen_writes, (
            "r1's generation is deleted only after its closed label is on the changelog"
        )
        assert gen_writes and {k for k, v in gen_writes} == {
            "r2"
        }  # r1 came and went inside the batch
        later = [
            (json.loads(k), v)
            for t, k, v, _ in outbox.sent[len(first_batch) :]
            if t == names["generations"]
        ]
        assert ("r1", None) in later, later
        assert topics.index(names["labels"]) < progress[-1]

    asyncio.run(scenario())


def test_a_replayed_generation_restores_a_payload_lost_between_two_changelog_writes():
    """A crash after the label's changelog record (generation seen, label open) but before the
    generation's own record: the replayed generation is a duplicate by event_id, yet it restores
    the payload, so the label still closes into a rollout."""
    from streams.labels import Aggregator
    from streams.reward import resolve_spec

    labels, gens, buckets = {}, {}, {}
    agg = Aggregator(resolve_spec("v1"), 5.0, 10.0, 10.0, labels, gens, buckets)
    g = generation("r1")
    agg.on_event(0, g, 100.0)
    gens.clear()  # what the restarted worker recovers: the label, not the generation
    agg2 = Aggregator(resolve_spec("v1"), 5.0, 10.0, 10.0, labels, gens, buckets)
    assert agg2.on_event(0, g, 100.0) == [] and agg2.duplicates == 1
    out = agg2.on_tick(0, 106.0)
    assert [e.topic for e in out if e.topic == "rollouts"] == ["rollouts"] and out[0].key == "r1"


def test_records_of_a_revoked_partition_or_an_earlier_assignment_are_dropped_not_processed():
    """A rebalance can leave records in flight: a take_events batch flushed after its partition was
    revoked, or a delivery Faust's conductor parked on a full buffer landing after the rebalance.
    The agent must not fold them into the state (the partition's derived state is forgotten, its
    progress would jump past records fetched again): they are dropped, counted, and re-fetched by
    whoever owns the partition from its progress. Records of the current assignment still count."""
    from streams.runtime import STALE, progress_key

    async def scenario():
        app, rt, outbox = _setup()
        app.consumer_generation_id = 7
        rt.owned = {1}
        names = {n: v.changelog for n, v in rt.views.items()}
        before = {r: STALE.labels(r)._value.get() for r in ("revoked", "old_generation")}
        await rt.on_batch(
            [
                _delivered(rt, "r1", 2, 40, 7),  # partition 2 is not (any longer) this worker's
                _delivered(rt, "r2", 1, 10, 6),  # fetched under generation 6, before the rebalance
                _delivered(rt, "r3", 1, 11, 7, ts=100.5),  # current
            ]
        )
        after = {r: STALE.labels(r)._value.get() - before[r] for r in before}
        assert after == {"revoked": 1, "old_generation": 1}
        progress = {
            json.loads(k): json.loads(v) for t, k, v, _ in outbox.sent if t == names["buckets"]
        }
        assert progress == {progress_key(1): {"offset": 11}}, (
            progress
        )  # nothing for partition 2, 11 not 10
        gens = {json.loads(k) for t, k, v, _ in outbox.sent if t == names["generations"]}
        assert gens == {"r3"}
        assert rt.last_processed == {1: 11}

    asyncio.run(scenario())


def test_progress_only_advances_over_records_folded_in_order_and_a_gap_is_fetched_again():
    """The state's progress must never jump past a record it did not fold (a restart would resume
    after it: the record would be lost). With a consumer group (`owned` tracked), a record past
    `last + 1` is dropped and the partition sought back to `last + 1`; stale later records keep
    being dropped until it arrives; re-deliveries at or below the progress are dropped; a record
    fetched again after the seek at the same offset proves the log has nothing in between."""
    from streams.runtime import GAPS, progress_key

    async def scenario():
        app, rt, outbox = _setup()
        rt.owned = {1}
        sought: list[tuple[int, int]] = []

        async def seek(partition, offset):
            sought.append((partition, offset))

        rt.seek = seek
        names = {n: v.changelog for n, v in rt.views.items()}

        def event(rid, offset):
            return _delivered(rt, rid, 1, offset)

        def marks():
            return [
                json.loads(v)
                for t, k, v, _ in outbox.sent
                if t == names["buckets"] and json.loads(k) == progress_key(1)
            ]

        def gens():
            return {json.loads(k) for t, k, v, _ in outbox.sent if t == names["generations"]}

        refetched = GAPS.labels("refetched")._value.get()
        await rt.on_batch(
            [event("a", 10), event("b", 11)]
        )  # no progress yet: the first record sets it
        await rt.on_batch([event("c", 13), event("d", 14)])  # 12 never arrived: a gap
        assert sought == [(1, 12)] and marks()[-1] == {"offset": 11} and gens() == {"a", "b"}
        assert GAPS.labels("refetched")._value.get() == refetched + 1
        await rt.on_batch(
            [event("e", 15), event("a", 10)]
        )  # stale later one, a re-delivery: both dropped
        assert sought == [(1, 12)] and gens() == {"a", "b"}
        await rt.on_batch([event("x", 12), event("c", 13), event("d", 14)])  # fetched again from 12
        assert marks()[-1] == {"offset": 14} and gens() == {"a", "b", "x", "c", "d"}
        # a gap the log really has (nothing at 15): the record at 16 comes back after the seek
        confirmed = GAPS.labels("confirmed")._value.get()
        await rt.on_batch([event("f", 16)])
        assert sought[-1] == (1, 15)
        await rt.on_batch(
            [event("f", 16)]
        )  # a new message object at the same offset: fetched again
        assert marks()[-1] == {"offset": 16} and "f" in gens()
        assert GAPS.labels("confirmed")._value.get() == confirmed + 1

    asyncio.run(scenario())


def test_a_partition_waiting_behind_a_gap_is_sought_again_by_the_timer_without_new_records():
    """After a gap the agent seeks back and waits for `last + 1`. If that record does not come and
    no later record of the partition arrives either, nothing in `in_order` would seek again: the
    tick timer does, `refetch_retry_s` after the last seek, until the record arrives; a revoked
    partition is let go (its next owner resumes from the progress)."""
    from streams.runtime import GAPS

    async def scenario():
        app, rt, outbox = _setup()
        rt.owned = {1, 2}
        rt.refetch_retry_s = 5.0
        sought: list[tuple[int, int]] = []

        async def seek(partition, offset):
            sought.append((partition, offset))

        rt.seek = seek
        await rt.on_batch([_delivered(rt, "a", 1, 10), _delivered(rt, "c", 1, 13)])  # 11, 12 lost
        assert sought == [(1, 11)]
        since = rt.refetching[1].since
        resought = GAPS.labels("resought")._value.get()
        assert await rt.retry_refetches(now=since + 1.0) == [], (
            "too early: the seek may still deliver"
        )
        assert await rt.retry_refetches(now=since + 6.0) == [1] and sought[-1] == (1, 11)
        assert await rt.retry_refetches(now=since + 7.0) == [], "the retry restarts the clock"
        assert await rt.retry_refetches(now=since + 12.0) == [1]
        assert GAPS.labels("resought")._value.get() == resought + 2
        await rt.on_batch([_delivered(rt, "b", 1, 11)])  # it came: the wait is over
        assert 1 not in rt.refetching and await rt.retry_refetches(now=since + 30.0) == []
        await rt.on_batch([_delivered(rt, "d", 2, 5), _delivered(rt, "e", 2, 9)])
        assert 2 in rt.refetching
        rt.owned = {1}
        assert await rt.retry_refetches(now=since + 60.0) == [] and 2 not in rt.refetching

    asyncio.run(scenario())


def test_the_faust_data_dir_is_inside_the_flywheel_data_dir(tmp_path):
    """Faust's default datadir is `<app id>-data` in the working directory (stray folders in a
    checkout); the worker's app keeps it in FLYWHEEL_DATA_DIR instead."""
    app, _ = build_app(
        Settings(kafka_bootstrap="127.0.0.1:1", topic_namespace="unit", data_dir=tmp_path),
        StreamsConfig(metrics_port=0),
    )
    assert app.conf.datadir == tmp_path / "unit-streams-data"
    assert app.conf.appdir.is_relative_to(tmp_path) and app.conf.tabledir.is_relative_to(tmp_path)


def test_the_session_stage_counts_an_ended_session_once_after_its_outputs_and_before_its_marker():
    """The `assemble` agent on labelled turns and an outcome: the session's sums go to the metric
    partials (stage "sessions", its turns partition) with the batch's other outputs, before the
    `sessions` changelog that records the end and the count; the bucket's marker follows in the
    `session-progress` changelog before the progress. The aggregate stage's merger turns the
    partial into the version's version-metrics record."""
    from app.contracts.rollouts import VersionMetrics
    from streams.labels import MetricsMerger
    from streams.runtime import progress_key
    from tests.unit.streams.test_ledger import agent_session, outcome_event

    async def scenario():
        app, rt, outbox = _setup(batch_max_events=1000, batch_within=0.3)
        stage = app.flywheel_sessions
        stage.outbox = outbox
        agent = app.flywheel_agents["assemble"]
        recs = [*agent_session("s1", 2), outcome_event("s1", "s1-t1", "success")]
        [later] = agent_session("s2", 1)  # moves the ledger's time past the bucket of s1's end
        async with agent.test_context() as ctx:
            for t, rec in zip((1000.0, 1001.0, 1003.0, 1100.0), [*recs, later], strict=True):
                key = rec["session_id"].encode()
                await ctx.put(key=key, value=json.dumps(rec).encode(), timestamp=t, partition=1)
            await _settle(stage, outbox, 4)
        names = {n: v.changelog for n, v in stage.views.items()}
        order = [(t, json.loads(k) if t in names.values() else k) for t, k, _, _ in outbox.sent]
        [(partial_at, value)] = [
            (i, v)
            for i, (t, k, v, _) in enumerate(outbox.sent)
            if t == "unit.streams-metric-partials"
        ]
        partial = json.loads(value)
        assert (partial["stage"], partial["partition"], partial["bucket_start"]) == (
            "sessions",
            1,
            960.0,
        )
        assert partial["sums"]["sessions_n"] == 1.0 and partial["sums"]["session_turns_sum"] == 2.0
        ended = max(i for i, (t, k) in enumerate(order) if (t, k) == (names["sessions"], "1|s1"))
        marker = order.index((names["buckets"], "1|960.0"))
        progress = max(i for i, e in enumerate(order) if e == (names["buckets"], progress_key(1)))
        assert partial_at < ended < marker < progress, order
        assert stage.views["sessions"].table.data["1|s1"]["mb"] == 960.0
        merged = MetricsMerger({}).on_partial(partial)  # the merge_metrics agent's logic
        rec = VersionMetrics.model_validate(merged.value)
        assert rec.bucket_id == "v7/960/60" and rec.session_partitions == [1] and rec.n == 0
        assert rec.task_success_rate == 1.0 and rec.mean_session_turns == 2.0

    asyncio.run(scenario())
