"""What the streams worker's agents share (streams/app.py builds them): `Runtime`, one agent's
machinery on one input topic: batches, ticks for caught-up partitions, the state's own input
progress, `resume_from_state` on every assignment, the in-order check that seeks back over gaps,
and the at-least-once order of outputs, state and acks per batch (streams/app.py's docstring).
The aggregate agent runs it on `<ns>.interactions` (the label join); the session stage
(streams/session_stage.py) on `<ns>.streams-turns`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import faust
import orjson
from prometheus_client import Counter, Gauge, Histogram

from app.contracts.deadletter import envelope
from app.settings import Settings
from streams.config import StreamsConfig
from streams.labels import Aggregator, Emit, MetricsMerger, Refused, decode_interaction
from streams.outbox import Outbox
from streams.state import BatchedTable

log = logging.getLogger(__name__)

EVENTS_IN = Counter("flywheel_streams_events_in_total", "Interaction records consumed", ["outcome"])
OUT = Counter("flywheel_streams_records_out_total", "Records produced", ["topic"])
LATE = Counter("flywheel_streams_late_total", "Events sent to the late topic", ["reason"])
DLQ = Counter("flywheel_streams_dlq_total", "Records sent to the dead-letter topic", ["reason"])
OPEN = Gauge(
    "flywheel_streams_open_labels", "Labels waiting for their window to close (pending + open)"
)
LATENCY = Histogram(
    "flywheel_streams_label_latency_seconds",
    "Wall time from a label's window close to its rollout being sent",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
WATERMARK_LAG = Gauge(
    "flywheel_streams_watermark_lag_seconds", "Wall time minus the lowest partition watermark held"
)
BATCH = Histogram(
    "flywheel_streams_batch_events",
    "Records per processed batch",
    buckets=(1, 10, 100, 500, 1000, 2000, 5000),
)
_EVENTS_OK, _EVENTS_DLQ = (
    EVENTS_IN.labels("ok"),
    EVENTS_IN.labels("dlq"),
)  # bound once: labels() costs a lock per call
_OUT: dict[str, Any] = {}
_SESSIONS_OFF = {
    "field": "type",
    "message": "session_outcome events need the session ledger (FLYWHEEL_STREAMS_SESSIONS=true)",
}
RESUME_CORRECTIONS = Counter(
    "flywheel_streams_resume_corrections_total",
    "Assignments where the group's committed offset differed from the state's progress "
    "(group_ahead: records the state never saw would have been skipped)",
    ["direction"],
)
RESUME_GAPS = Counter(
    "flywheel_streams_resume_gaps_total",
    "Partitions whose consumption resumed past the state's progress (records skipped: a bug)",
)
GAPS = Counter(
    "flywheel_streams_offset_gaps_total",
    "Interactions records delivered past the next offset the state expects (records in between never "
    "reached the agent). refetched: the consumer was sought back and the record dropped; resought: "
    "the wanted record had not arrived refetch_retry_s after the seek and the timer sought again; "
    "confirmed: fetching again showed the log has no records in between",
    ["outcome"],
)
BEHIND = Counter(
    "flywheel_streams_replayed_records_dropped_total",
    "Interactions records at or below the partition's progress delivered again (the state reflects them)",
)
STALE = Counter(
    "flywheel_streams_stale_records_dropped_total",
    "Records delivered to the agent after their partition was revoked, or fetched under an earlier "
    "assignment (they are fetched again from the state's progress; processing them would write "
    "state for a partition this worker no longer owns)",
    ["reason"],
)
ASSIGNED = Gauge(
    "flywheel_streams_assigned_partitions",
    "Interactions partitions this worker owns (set when a rebalance completes; 0 while one is under way)",
)
CHANGELOG = Counter(
    "flywheel_streams_changelog_records_total",
    "Changelog records written (one per touched key per batch)",
    ["table"],
)


# Faust topic options of every topic the agents read or write: records as bytes (the agents
# decode and encode them themselves), and of every table: JSON values under string keys
RAW = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}


def table_options(partitions: int) -> dict[str, Any]:
    return {"partitions": partitions, "key_type": str, "value_type": None, "default": None}


def dlq_envelope(
    reason: str,
    errors: list,
    topic: str,
    partition: int,
    offset: int | None,
    key: bytes | None,
    value: bytes | None,
) -> dict[str, Any]:
    """A `<ns>.dlq` record of the streams worker (app/contracts/deadletter.py's envelope)."""
    return envelope("streams", reason, errors, topic, partition, offset, key, value)


def _failure(field: str, exc: BaseException) -> dict[str, str]:
    return {"field": field, "message": f"{type(exc).__name__}: {exc}"[:2000]}


def progress_key(partition: int) -> str:
    """The `buckets` key holding the last interactions offset of `partition` the state reflects
    (bucket keys are '<partition>|<bucket start>', so the two cannot collide)."""
    return f"offset|{partition}"


class Refetch(NamedTuple):
    """A partition sought back after a gap: waiting for `want`, first seen `seen` (that message)."""

    want: int
    seen: int
    since: float  # time.monotonic() of the seek
    msg: Any


@dataclass
class Runtime:
    """What the agents share: the aggregator, output topics and per-partition progress."""

    settings: Settings
    cfg: StreamsConfig
    app: faust.App
    aggregator: Aggregator
    merger: MetricsMerger
    topics: dict[str, Any]
    interactions: str
    ticks: str
    views: dict[str, BatchedTable] = field(
        default_factory=dict
    )  # the aggregator's tables, write-back per batch
    outbox: Outbox = None  # type: ignore[assignment]  # where records go (streams/outbox.py); tests swap in a list
    last_processed: dict[int, int] = field(default_factory=dict)
    records_done: int = (
        0  # interaction and tick records whose batch completed (outputs and state sent)
    )
    offsets: Any = None
    resumed: set[int] = field(
        default_factory=set
    )  # partitions resumed from the state whose first record has not come
    deferred_tombstones: list = field(
        default_factory=list
    )  # generation deletions, sent after their labels
    owned: set[int] | None = (
        None  # interactions partitions assigned now (None: not tracked, e.g. tests without a group)
    )
    refetching: dict[int, Refetch] = field(default_factory=dict)
    refetch_retry_s: float = (
        5.0  # seek again if the wanted offset has not arrived this long after a seek
    )

    def current(self, msg: Any) -> bool:
        """Whether a delivered record belongs to the current assignment of its partition.

        Records can reach the agent after the assignment they were fetched under ended: a
        `take_events` batch still filling when a rebalance starts is flushed later, and a delivery
        Faust's conductor parked on a full stream buffer (`asyncio.ensure_future(chan.put(...))`,
        not cancelled with the fetch loop's delivery) lands after the buffers were cleared.
        Processing such a record would change the state of a partition this worker no longer owns
        (its in-memory derived state is already forgotten, so the changelog would get a wrong
        label) or move its progress past records the consumer is about to fetch again. Dropping
        it loses nothing: the partition's owner resumes from the state's progress and fetches it
        again."""
        reason = None
        if self.owned is not None and msg.partition not in self.owned:
            reason = "revoked"
        else:
            generation = getattr(msg, "generation_id", None)
            if generation is not None and generation != self.app.consumer_generation_id:
                reason = "old_generation"
        if reason is None:
            return True
        STALE.labels(reason).inc()
        log.info(
            "dropped %s record %s[%d]@%d (%s): its partition's owner fetches it again from the state's progress",
            "an interactions" if msg.topic == self.interactions else "a tick",
            msg.topic,
            msg.partition,
            msg.offset,
            reason,
        )
        return False

    async def in_order(self, msg: Any) -> bool:
        """Whether an interactions record is the next one the partition's state expects.

        The state's progress (`last_processed`, persisted as the batch's progress mark) must only
        ever advance over records it folded: if it jumped past one, a restart or a rebalance would
        resume after it and the record would be lost. Kafka delivers a partition in order, but
        around a rebalance Faust can hand the agent a record fetched before it and then skip the
        records it re-fetches (the fetch loop's read offset advanced by a delivery abandoned when
        the flow was suspended; seen as 2 lost rollouts in 600 when a worker joined mid-stream).
        So each record must be `last + 1`:
        - below it: a re-delivery the state already reflects, dropped;
        - above it (a gap): dropped, and the consumer is sought back to `last + 1` (which also
          resets Faust's read offset); records keep being dropped until `last + 1` arrives. If
          the record that revealed the gap is fetched *again* after the seek, the log has nothing
          in between (a compacted or transactional topic; not one Flywheel writes) and the gap is
          accepted. No progress yet (a partition never processed): anything goes.
        Not checked without a consumer group (`owned` None: test_context agents)."""
        p, offset = msg.partition, msg.offset
        last = self.last_processed.get(p)
        if self.owned is None or last is None:
            return True
        want = last + 1
        if offset == want:
            self.refetching.pop(p, None)
            self.resumed.discard(p)
            return True
        if offset < want:
            BEHIND.inc()
            return False
        now = time.monotonic()
        pending = self.refetching.get(p)
        if pending is not None and pending.want == want:
            if (
                offset == pending.seen and msg is not pending.msg
            ):  # fetched again: nothing lies between
                self.refetching.pop(p, None)
                self.resumed.discard(p)
                GAPS.labels("confirmed").inc()
                log.warning(
                    "partition %d: no records between offsets %d and %d in the log; going on",
                    p,
                    want,
                    offset,
                )
                return True
            if now - pending.since < self.refetch_retry_s:
                return False  # records fetched before the seek, still draining
        if p in self.resumed:
            RESUME_GAPS.inc()
            log.error(
                "partition %d resumed at offset %d but the state ends at %d: records were skipped",
                p,
                offset,
                want - 1,
            )
        GAPS.labels("refetched").inc()
        log.warning(
            "partition %d: record at offset %d delivered but the state expects %d next: "
            "dropping it and fetching again from %d",
            p,
            offset,
            want,
            want,
        )
        self.refetching[p] = Refetch(want, offset, now, msg)
        await self.seek(p, want)
        return False

    async def seek(self, partition: int, offset: int) -> None:
        """Make the consumer fetch `partition` of interactions again from `offset` (Faust's seek also
        resets its fetch loop's read offset). A partition revoked meanwhile cannot be sought: its
        next owner resumes from the state's progress anyway."""
        from faust.types import TP

        try:
            await self.app.consumer.seek(TP(self.interactions, partition), offset)
        except Exception as exc:
            log.warning(
                "partition %d: could not seek to %d (%s: %s); its owner resumes from the state's progress",
                partition,
                offset,
                type(exc).__name__,
                exc,
            )

    # --- rebalances ----------------------------------------------------------------------------
    def revoked(self, revoked: Any) -> None:
        """Partitions of the input were revoked: until the rebalance completes, their records are
        stale, and their derived state goes (their next owner rebuilds it from the tables)."""
        gone = {tp.partition for tp in revoked if tp.topic == self.interactions}
        self.owned = (self.owned or set()) - gone
        self.gauge_assigned()
        for p in gone:
            self.forget_partition(p)
            self.last_processed.pop(p, None)
            self.resumed.discard(p)
            self.refetching.pop(p, None)
        self.deferred_tombstones = [r for r in self.deferred_tombstones if r[2] not in gone]

    async def assigned(self) -> None:
        """A rebalance completed: own the input's partitions assigned now and resume them from the
        state (sent after table recovery, before Faust seeks to committed offsets)."""
        self.owned = {
            tp.partition for tp in self.app.consumer.assignment() if tp.topic == self.interactions
        }
        await self.resume_from_state()
        self.gauge_assigned()

    def forget_partition(self, p: int) -> None:
        self.aggregator.forget_partition(p)

    def gauge_assigned(self) -> None:
        ASSIGNED.set(len(self.owned or ()))

    # --- one batch of records ---------------------------------------------------------------
    async def on_batch(self, events: list[Any]) -> None:
        """Join a batch of interaction/tick records, then emit outputs and state in the at-least-once order."""
        out: list[Emit] = []
        views = self.views.values()
        last: dict[int, int] = {}  # interactions partition -> last offset in this batch
        for event in events:
            msg = event.message
            if not self.current(msg) or (msg.topic != self.ticks and not await self.in_order(msg)):
                continue
            for view in views:
                view.partition = msg.partition
            if msg.topic == self.ticks:
                out += self.on_tick(msg, event.value)
            else:
                out += self.on_record(msg, event.key, event.value)
                last[msg.partition] = msg.offset
        progress = self.views["buckets"]
        for p, offset in last.items():  # written last, after every state change of the batch
            progress.partition = p
            progress[progress_key(p)] = {"offset": offset}
        # 1. outputs, delivered, before 2. the state that reflects them (see the module docstring)
        by_topic: dict[str, list] = {}
        for e in out:
            by_topic.setdefault(e.topic, []).append(self.encode(e))
        await asyncio.gather(
            *(
                self.outbox.send(self.topics[t].get_topic_name(), recs)
                for t, recs in by_topic.items()
            )
        )
        now = time.time()
        for e in out:
            self.count(e, now)
        await self.persist()
        self.records_done += len(events)
        BATCH.observe(len(events))
        self.gauges()

    async def persist(self) -> None:
        """2. The state of the batch, after its outputs: (2a) labels and generations (deletions of
        generations wait one batch: a generation may only go once the changelog holds its closed
        label), then (2b) buckets, with the input progress."""
        drained = {name: view.drain() for name, view in self.views.items()}
        gens = drained["generations"]
        tombstones = [r for r in gens if r[1] is None]
        drained["generations"] = self.deferred_tombstones + [r for r in gens if r[1] is not None]
        await self._send_changelogs(drained, ("labels", "generations"))
        self.deferred_tombstones = tombstones
        await self._send_changelogs(drained, ("buckets",))

    def gauges(self) -> None:
        OPEN.set(self.aggregator.open_labels)

    async def _send_changelogs(self, drained: dict[str, list], names: tuple[str, ...]) -> None:
        sends = [(self.views[n], drained[n]) for n in names if drained[n]]
        firsts = await asyncio.gather(
            *(self.outbox.send(view.changelog, recs) for view, recs in sends)
        )
        for (view, recs), first in zip(sends, firsts):
            view.persisted(first)
            CHANGELOG.labels(view.table.name).inc(len(recs))

    async def resume_from_state(self) -> dict[int, int]:
        """After table recovery, before Faust seeks to the group's committed offsets: commit, for every
        assigned interactions partition, the offset after the last record the recovered state reflects.

        The state carries its own input progress (a `buckets` key per partition, written after every
        other state change of a batch), so a restart resumes exactly where the state ends whatever
        Faust committed: never past a record the state has not seen (which would lose it), and
        without replaying records it already has."""
        progress = self.views["buckets"]
        offsets: dict[Any, int] = {}
        for tp in self.app.consumer.assignment():
            if tp.topic != self.interactions:
                continue
            mark = progress.get(progress_key(tp.partition))
            if mark is not None:
                offsets[tp] = mark["offset"] + 1
                self.last_processed[tp.partition] = mark["offset"]
                self.resumed.add(tp.partition)
        if offsets:
            group = (
                await self.app.consumer.seek_to_committed()
            )  # what the group has (perform_seek re-seeks anyway)
            for tp, offset in offsets.items():
                had = group.get(tp)
                if had is not None and had >= 0 and had != offset:
                    RESUME_CORRECTIONS.labels(
                        "group_ahead" if had > offset else "group_behind"
                    ).inc()
                    (log.warning if had > offset else log.info)(
                        "partition %d: the group's committed offset is %d, the state ends before %d: resuming at %d",
                        tp.partition,
                        had,
                        offset,
                        offset,
                    )
            await self.app.consumer._commit_offsets(
                offsets
            )  # Faust's perform_seek() follows and reads these
            log.info(
                "resuming from the state's progress: %s",
                {tp.partition: o for tp, o in sorted(offsets.items())},
            )
        return {tp.partition: o for tp, o in offsets.items()}

    def on_record(self, msg: Any, key: bytes | None, value: bytes | None) -> list[Emit]:
        """Decode, validate and join one interactions record. A record that fails anywhere (decode,
        validation, key, or the join itself) becomes a DLQ record; it never raises."""
        p = msg.partition
        self.last_processed[p] = msg.offset
        obj = decode_interaction(key, value)
        if isinstance(obj, Refused):
            return [self._dlq(msg, key, value, obj.reason, obj.errors)]
        _EVENTS_OK.inc()
        if obj["type"] == "session_outcome":  # not joined: the session ledger applies it
            if self.cfg.sessions:
                return [Emit("turns", obj["session_id"], obj)]
            return [self._dlq(msg, key, value, "sessions_disabled", [_SESSIONS_OFF])]
        rt = msg.timestamp if msg.timestamp else time.time()
        try:
            out = self.aggregator.on_event(p, obj, rt)
        except Exception as exc:
            log.exception("interactions[%d]@%d could not be joined; dead-lettered", p, msg.offset)
            return [self._dlq(msg, key, value, "processing_failed", [_failure("(join)", exc)])]
        return [
            self._dlq(msg, key, value, e.value["reason"], e.value["errors"])
            if e.topic == "dlq" and e.key is None
            else self._resolve(p, e)
            for e in out
        ]

    def _route(self, e: Emit) -> Emit:
        """A labelled chat turn goes to the session ledger (`<ns>.streams-turns`, keyed by its
        session), not to the rollouts topic; everything else as it is."""
        if e.topic == "rollouts" and self.cfg.sessions and e.value.get("turn") is not None:
            return Emit("turns", e.value["session_id"], e.value)
        return e

    def _dlq(
        self, msg: Any, key: bytes | None, value: bytes | None, reason: str, errors: list
    ) -> Emit:
        """The DLQ record of the consumed record `msg` (its original bytes)."""
        _EVENTS_DLQ.inc()
        return Emit(
            "dlq",
            None,
            dlq_envelope(reason, errors, msg.topic, msg.partition, msg.offset, key, value),
        )

    def _resolve(self, p: int, e: Emit) -> Emit:
        """An aggregator output as sent: a DLQ entry about a stored event (a label that failed to
        close; `e.key` its request_id) gets the envelope of the event as it was on the topic."""
        if e.topic != "dlq":
            return self._route(e)
        return Emit(
            "dlq",
            None,
            dlq_envelope(
                e.value["reason"],
                e.value["errors"],
                self.interactions,
                p,
                None,
                e.key.encode(),
                orjson.dumps(e.value["event"]),
            ),
        )

    # --- ticks -------------------------------------------------------------------------------
    def on_tick(self, msg: Any, value: bytes | None) -> list[Emit]:
        p = msg.partition
        try:
            tick = orjson.loads(value if value is not None else b"")
            now, hw = float(tick["now"]), int(tick["hw"])
            assert math.isfinite(now), f"now is {now}"
        except Exception as exc:
            return [self._dlq(msg, msg.key, value, "invalid_tick", [_failure("(tick)", exc)])]
        processed = (
            self.last_processed.get(p, -1) + 1
        )  # set from the state's progress on assignment
        if processed < hw:
            return []  # records below the tick's end offset are still unprocessed: record time rules
        return self.advance(p, now - self.cfg.skew_margin)

    def advance(self, p: int, now: float) -> list[Emit]:
        """Move partition `p`'s time to `now` (a caught-up tick): labels whose window passed close."""
        out = self.aggregator.on_tick(p, now)  # a label that fails to close is a DLQ entry
        WATERMARK_LAG.set(
            max(0.0, time.time() - min(self.aggregator.watermark(q) for q in self.aggregator._wm))
        )
        return [self._resolve(p, e) for e in out]

    # --- metric partials -------------------------------------------------------------------------
    def on_partial(self, msg: Any, value: bytes | None) -> Emit:
        """Merge one partial into its version-metrics record, or dead-letter it (`invalid_partial`)."""
        try:
            return self.merger.on_partial(orjson.loads(value if value is not None else b""))
        except Exception as exc:
            log.exception(
                "%s[%d]@%d is not a usable metrics partial; dead-lettered",
                msg.topic,
                msg.partition,
                msg.offset,
            )
            return self._dlq(msg, msg.key, value, "invalid_partial", [_failure("(partial)", exc)])

    async def retry_refetches(self, now: float | None = None) -> list[int]:
        """Seek again every owned partition still waiting for the record its gap was sought back to,
        `refetch_retry_s` after the last seek. `in_order` re-seeks only when another record of the
        partition arrives; when none does (the stream ended, or every later record was already
        delivered and dropped) nothing else would, and the partition would stay stuck behind the gap
        while its ticks are withheld as backlogged. Called by the tick timer. Returns the partitions
        sought."""
        now = time.monotonic() if now is None else now
        sought = []
        for p, pending in list(self.refetching.items()):
            if self.owned is not None and p not in self.owned:
                self.refetching.pop(p, None)  # revoked: its next owner resumes from the progress
                continue
            if now - pending.since < self.refetch_retry_s:
                continue
            GAPS.labels("resought").inc()
            log.warning(
                "partition %d: offset %d has not arrived %.0f s after seeking to it; seeking again",
                p,
                pending.want,
                now - pending.since,
            )
            self.refetching[p] = pending._replace(since=now)
            await self.seek(p, pending.want)
            sought.append(p)
        return sought

    async def send_ticks(self) -> None:
        """Send one tick per assigned interactions partition (own Kafka clients: Faust's consumer thread stays free)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        parts = sorted(
            tp.partition
            for tp in self.app.consumer.assignment()
            if tp.topic == self.interactions and not self._backlogged(tp)
        )
        if not parts:
            return
        bootstrap = self.settings.kafka_bootstrap.split(",")
        if self.offsets is None:
            self.offsets = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
            await self.offsets.start()
        now = time.time()
        tps = [TopicPartition(self.interactions, p) for p in parts]
        hws = await self.offsets.end_offsets(tps)
        for tp in tps:
            tick = {"now": now, "hw": hws[tp]}
            await self.topics["ticks"].send(value=json.dumps(tick).encode(), partition=tp.partition)

    def _backlogged(self, tp: Any) -> bool:
        """The consumer's last fetch already showed records past the last one processed: a tick would be
        refused (records rule), so skip it and its end-offsets request (a draining worker sends none)."""
        p = tp.partition
        if p not in self.last_processed:
            return False
        hw = self.app.consumer.highwater(tp)
        return hw is not None and self.last_processed[p] + 1 < hw

    # --- output -------------------------------------------------------------------------------
    @staticmethod
    def encode(e: Emit) -> tuple[bytes | None, bytes, None]:
        """(key, value, partition) of one output record; the partition follows from the key."""
        return (e.key.encode() if e.key is not None else None, orjson.dumps(e.value), None)

    def count(self, e: Emit, now: float) -> None:
        out = _OUT.get(e.topic)
        if out is None:
            out = _OUT[e.topic] = OUT.labels(e.topic)
        out.inc()
        if e.topic == "rollouts":
            label = self.aggregator.label(e.key) if e.key is not None else None
            if label is not None and label.close is not None:
                LATENCY.observe(max(0.0, now - label.close.closed_at))
        elif e.topic == "late":
            LATE.labels(e.value["reason"]).inc()
        elif e.topic == "dlq":
            DLQ.labels(e.value["reason"]).inc()

    async def send(self, e: Emit) -> None:
        """Send one record and wait for it (the low-volume metrics merger)."""
        await self.outbox.send(self.topics[e.topic].get_topic_name(), [self.encode(e)])
        self.count(e, time.time())
