"""`flywheel streams relabel`: re-derive rewards from the interactions log under another reward spec.

When a reward spec turns out to be exploitable, an operator names a fixed spec (a new
version) and re-labels history under it. This module replays `<ns>.interactions` from
`--since` and writes the rollouts the live worker would have written had it run the new spec:

- **Same join.** Records are decoded by `streams.labels.decode_interaction` and joined by
  `streams.labels.Aggregator` (the live worker's code, on plain dicts), with the live worker's
  wait window and closed-label retention, on record time. So the same interactions give the
  same joins; only the reward spec differs.
- **In record-time order across partitions.** A session's events are keyed by request, so
  they sit on several partitions, and the ledger ends a session at its outcome: replayed a
  partition at a time, an outcome read before its session's turns on another partition ends
  the session, its later turns go to late (`turn_session_ended`) and the segment is written
  without them, paid the outcome under the new spec (docs/STREAMS.md has what it cost on a
  run's log). `TimeMerge` releases the partitions' records in record-time order, as the live
  worker reads them, and at the end the clock steps through the open windows' deadlines, so a
  session's last turns reach the ledger before its outcome's idle deadline.
- **Beside the live worker.** A plain consumer with manual assignment (no group, no offset
  commits), in-memory state (no tables, no changelogs), and no writes to `<ns>.late`, the
  ticks or the metric partials. It writes only relabelled rollouts and dead letters.
- **Finite.** The end offsets of every partition are captured at start; the replay stops
  there and exits. Labels still open at the end (their window had not closed when the run
  started, minus the skew margin) are skipped as `window_open`: the live worker labels them.
- **Both labels kept.** A relabelled rollout carries the new `reward_spec` and `relabel_run`
  (this run's id) and is keyed `<request_id>|<reward_spec>` (`relabel_key`), so the compacted
  rollouts topic keeps it beside the live record (keyed `<request_id>`), and the trainer, which
  dedupes by (request_id, reward_spec), trains on it once as new data.

Counts (`RelabelCounts`): records read; labelled (rollouts under the new spec); written;
duplicates (events already seen); dead-lettered records by reason; skipped by reason:

    no_feedback           a generation whose window closed without feedback (reward 0.0 under any spec)
    before_since          a generation recorded before --since (record times need not be monotonic)
    after_until           a generation recorded at or after --until
    window_open           a generation whose window was still open when the run started
    orphan_feedback       a feedback event whose generation is not in the replayed range (late: orphan)
    feedback_after_close  a feedback event after its label's window (late: after_close)
    session_open          a session whose segment was still open at the end (the live worker emits it)
    turn_<reason>         a chat turn the session ledger sent to late (superseded, after_close,
                          session_ended)
    outcome_<reason>      a session_outcome the ledger sent to late (repeated, after_close,
                          session_ended)

Sessions. With `FLYWHEEL_STREAMS_SESSIONS` on (the default), labelled chat turns and
`session_outcome` events go through the live worker's session ledger (streams/ledger.py, in
memory, on record time; the watermark at the end closes idle sessions), so a session's
relabelled segments are the live ones under the new spec: each turn's reward and the outcome's
are recomputed, the tokens and mask are the same. A segment is written when a turn got feedback
or the session an outcome (`no_feedback` otherwise).

    counts = relabel(settings, StreamsConfig(), RelabelOptions(spec, since=datetime(...)))
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from app.settings import Settings
from streams.config import StreamsConfig
from streams.labels import Aggregator, Emit, Refused, decode_interaction
from streams.ledger import Emit as LedgerEmit
from streams.ledger import Ledger, LedgerConfig
from streams.reward import RewardSpec

log = logging.getLogger(__name__)

SPEC_NAME = re.compile(
    r"^[A-Za-z0-9._-]{1,64}$"
)  # no '|': the relabelled key splits at its last '|'
SKIP_REASONS = (
    "no_feedback",
    "before_since",
    "after_until",
    "window_open",
    "orphan_feedback",
    "feedback_after_close",
    "session_open",
    "turn_superseded",
    "turn_after_close",
    "turn_session_ended",
    "outcome_repeated",
    "outcome_after_close",
    "outcome_session_ended",
)
_LATE = {"orphan": "orphan_feedback", "after_close": "feedback_after_close"}
SETTLE_EVERY = 10_000  # records sent between waits for the broker's acknowledgements
MERGE_BUFFER = 10_000  # records held per partition for the time merge before it is paused


class TimeMerge:
    """Records of several partitions, released in record-time order (ties: partition order).

    A record is released only while every partition still being read has one buffered: its
    records come in offset order, so the earliest head is the earliest record left of every
    partition. A partition that is done (`done`) no longer holds the others back."""

    def __init__(self, partitions: Any) -> None:
        self.buffers: dict[Any, deque] = {p: deque() for p in partitions}
        self.reading = set(self.buffers)

    def add(self, partition: Any, record: Any) -> None:
        self.buffers[partition].append(record)

    def done(self, partition: Any) -> None:
        self.reading.discard(partition)

    def held(self, partition: Any) -> int:
        return len(self.buffers[partition])

    def ready(self) -> Iterator[tuple[Any, Any]]:
        """(partition, record) in record-time order, as far as every partition being read allows."""
        order = {p: i for i, p in enumerate(self.buffers)}
        while all(self.buffers[p] for p in self.reading):
            heads = [p for p, b in self.buffers.items() if b]
            if not heads:
                return
            p = min(heads, key=lambda q: (self.buffers[q][0].timestamp, order[q]))
            yield p, self.buffers[p].popleft()


def relabel_key(request_id: str, reward_spec: str) -> str:
    """The rollouts-topic key of a relabelled rollout (the live worker keys by request_id alone)."""
    assert SPEC_NAME.match(reward_spec), (
        f"reward spec {reward_spec!r} must match {SPEC_NAME.pattern}"
    )
    return f"{request_id}|{reward_spec}"


@dataclass(frozen=True)
class RelabelOptions:
    """What to replay and how. Times are aware datetimes, compared with Kafka record timestamps."""

    spec: RewardSpec
    since: datetime
    until: datetime | None = None
    dry_run: bool = False
    idle_timeout_s: float = (
        60.0  # no record for this long while offsets remain below the end: fail, never hang
    )
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    def __post_init__(self) -> None:
        if not SPEC_NAME.match(self.spec.version):
            raise ValueError(
                f"reward spec version {self.spec.version!r} cannot name relabelled rollouts: use letters, "
                f"digits, '.', '_' or '-' (1-64 characters)"
            )
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ValueError(
                    f"--{name} {value.isoformat()} has no timezone; write e.g. 2026-11-21T10:00:00Z"
                )
        if self.until is not None and self.until <= self.since:
            raise ValueError(
                f"--until {self.until.isoformat()} must be after --since {self.since.isoformat()}"
            )
        assert self.idle_timeout_s > 0, f"idle timeout {self.idle_timeout_s} must be > 0"


@dataclass
class RelabelCounts:
    read: int = 0
    labelled: int = 0
    written: int = 0
    duplicates: int = 0
    dead_lettered: Counter = field(default_factory=Counter)  # reason -> records
    skipped: Counter = field(default_factory=lambda: Counter(dict.fromkeys(SKIP_REASONS, 0)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "labelled": self.labelled,
            "written": self.written,
            "duplicates": self.duplicates,
            "dead_lettered": dict(self.dead_lettered),
            "skipped": dict(self.skipped),
        }


class Relabeller:
    """The pure core: interactions records in, relabelled rollouts and dead letters out (no Kafka).

    `feed` one record at a time in record-time order across partitions (`TimeMerge`; record time
    `rt` in seconds), then `finish`
    with the watermark up to which windows are known to be complete."""

    def __init__(
        self,
        spec: RewardSpec,
        window_s: float,
        retention_s: float,
        bucket_s: float,
        *,
        since_s: float,
        until_s: float | None,
        run_id: str,
        topic: str,
        empty_max_tokens: int = 1,
        clock: Callable[[], float] = time.time,
        sessions: LedgerConfig | None = None,
    ):
        self.spec, self.since_s, self.until_s, self.run_id, self.topic = (
            spec,
            since_s,
            until_s,
            run_id,
            topic,
        )
        self.agg = Aggregator(
            spec,
            window_s,
            retention_s,
            bucket_s,
            {},
            {},
            {},
            empty_max_tokens=empty_max_tokens,
            clock=clock,
        )
        self.gen_rt: dict[
            str, float
        ] = {}  # request_id -> record time of its generation, until its label closes
        self.partitions: set[int] = set()
        self.counts = RelabelCounts()
        # the live worker's session ledger, in memory (None: chat turns are rollouts of their own)
        self.ledger = Ledger(sessions, {}, spec) if sessions is not None else None

    def feed(
        self, partition: int, offset: int, key: bytes | None, value: bytes | None, rt: float
    ) -> list[Emit]:
        self.counts.read += 1
        ev = decode_interaction(key, value)
        if isinstance(ev, Refused):
            return [
                self._dead_letter(ev.reason, ev.errors, self.topic, partition, offset, key, value)
            ]
        rid = ev["request_id"]
        if ev["type"] == "session_outcome":
            if self.ledger is None:
                return []  # the live worker dead-letters it (sessions_disabled); nothing to relabel
            self.partitions.add(partition)
            return self._from_ledger(self.ledger.on_outcome(ev, rt))
        if ev["type"] == "generation" and rid not in self.gen_rt:
            label = self.agg.label(rid)
            if label is None or label.generation_id is None:
                # the generation that opens the label (a repeat or a conflicting one does not)
                self.gen_rt[rid] = rt
        self.partitions.add(partition)
        before = self.agg.duplicates
        out = self.agg.on_event(partition, ev, rt)
        self.counts.duplicates += self.agg.duplicates - before
        return self._route(partition, out, self.topic, rt, (offset, key, value))

    def finish(self, watermark: float) -> list[Emit]:
        """Close every label whose window ended by `watermark`; count the ones still open as skipped."""
        out: list[Emit] = []
        # the clock steps through the open labels' deadlines, as the live worker's ticks move it:
        # a session's last turns reach the ledger when their windows close, before its outcome's
        # idle deadline, instead of all at the watermark, after it (`turn_session_ended`)
        steps = {
            label.deadline
            for _, label in self.agg.label_items()
            if label.status == "open" and label.deadline < watermark
        }
        for t in [*sorted(steps), watermark]:
            for p in sorted(self.partitions):
                out += self._route(p, self.agg.advance(p, t), self.topic, t)
            if self.ledger is not None:
                out += self._from_ledger(self.ledger.advance(t))
        if self.ledger is not None:
            self.counts.skipped["session_open"] += self.ledger.open_sessions
        for rid, label in self.agg.label_items():
            if label.status == "open":
                self.counts.skipped[self._range_reason(rid) or "window_open"] += 1
            elif label.status == "pending":
                self.counts.skipped["window_open"] += 1  # feedback still waiting for its generation
        return out

    def _range_reason(self, rid: str) -> str | None:
        rt = self.gen_rt.get(rid)
        if rt is None:
            return None
        if rt < self.since_s:
            return "before_since"
        if self.until_s is not None and rt >= self.until_s:
            return "after_until"
        return None

    def _route(
        self,
        partition: int,
        out: list[Emit],
        topic: str,
        now: float,
        record: tuple[int, bytes | None, bytes | None] | None = None,
    ) -> list[Emit]:
        """Aggregator outputs as this command writes them (`record`: the record being fed, if any;
        `now`: its record time, or the watermark). A chat turn in range goes to the ledger."""
        routed = []
        for e in out:
            if e.topic == "rollouts":
                rid = e.value["request_id"]
                reason = self._range_reason(rid)
                self.gen_rt.pop(rid, None)
                if reason is None and self.ledger is not None and e.value.get("turn") is not None:
                    routed += self._from_ledger(self.ledger.on_rollout(e.value, now))
                    continue
                if reason is None and e.value["components"] is None:
                    reason = "no_feedback"
                if reason is not None:
                    self.counts.skipped[reason] += 1
                    continue
                self.counts.labelled += 1
                routed.append(
                    Emit(
                        "rollouts",
                        relabel_key(rid, self.spec.version),
                        dict(e.value, relabel_run=self.run_id),
                    )
                )
            elif e.topic == "late":
                self.counts.skipped[_LATE[e.value["reason"]]] += 1
            elif (
                e.topic == "dlq" and e.key is None and record is not None
            ):  # the record at hand (conflicting generation)
                routed.append(
                    self._dead_letter(
                        e.value["reason"], e.value["errors"], topic, partition, *record
                    )
                )
            elif (
                e.topic == "dlq"
            ):  # an event from the state (a label that failed to close; key: its request_id)
                routed.append(
                    self._dead_letter(
                        e.value["reason"],
                        e.value["errors"],
                        topic,
                        partition,
                        None,
                        e.value["event"]["request_id"].encode(),
                        orjson.dumps(e.value["event"]),
                    )
                )
            # partials: version metrics are the live worker's (under the live spec); none are written
        return routed

    def _from_ledger(self, out: list[LedgerEmit]) -> list[Emit]:
        """Ledger outputs as this command writes them: a segment with feedback or an outcome,
        relabelled; late turns and outcomes counted as skipped."""
        routed = []
        for e in out:
            if e.topic == "late":
                kind = "outcome" if e.value["event"].get("type") == "session_outcome" else "turn"
                reason = e.value["reason"]
                self.counts.skipped[reason if reason.startswith(kind) else f"{kind}_{reason}"] += 1
            elif e.value["components"] is None and e.value.get("outcome") is None:
                self.counts.skipped["no_feedback"] += 1
            else:
                self.counts.labelled += 1
                key = relabel_key(e.value["request_id"], self.spec.version)
                routed.append(Emit("rollouts", key, dict(e.value, relabel_run=self.run_id)))
        return routed

    def _dead_letter(
        self,
        reason: str,
        errors: list,
        topic: str,
        partition: int,
        offset: int | None,
        key: bytes | None,
        value: bytes | None,
    ) -> Emit:
        from app.contracts.deadletter import envelope

        self.counts.dead_lettered[reason] += 1
        return Emit(
            "dlq", None, envelope("relabel", reason, errors, topic, partition, offset, key, value)
        )


def parse_time(text: str, option: str) -> datetime:
    """An RFC 3339 time with a timezone (the events' own parser), or ValueError naming the option."""
    from app.contracts.events import parse_ts

    try:
        return parse_ts(text)
    except ValueError as exc:
        raise ValueError(
            f"{option} {text!r} is not an RFC 3339 time with a timezone (e.g. 2026-11-21T10:00:00Z): "
            f"{exc}"
        ) from None


def _ms(t: datetime) -> int:
    return int(math.floor(t.timestamp() * 1000))


def plan_offsets(
    consumer: Any, topic: str, opts: RelabelOptions, window_s: float
) -> dict[Any, tuple[int, int]]:
    """Per partition (start, stop): from the first record at or after --since to the end offset now
    (or, with --until, the first record at or after until + window: later records cannot join)."""
    from kafka import TopicPartition

    parts = consumer.partitions_for_topic(topic)
    if not parts:
        raise RuntimeError(f"topic {topic} does not exist on the broker (nothing to relabel)")
    tps = [TopicPartition(topic, p) for p in sorted(parts)]
    end = consumer.end_offsets(tps)
    starts = consumer.offsets_for_times({tp: _ms(opts.since) for tp in tps})
    stops: dict[Any, Any] = {}
    if opts.until is not None:
        stops = consumer.offsets_for_times(
            {tp: _ms(opts.until) + int(window_s * 1000) for tp in tps}
        )
    plan = {}
    for tp in tps:
        start = starts[tp].offset if starts.get(tp) is not None else end[tp]
        stop = min(end[tp], stops[tp].offset) if stops.get(tp) is not None else end[tp]
        plan[tp] = (start, max(start, stop))
    return plan


def relabel(
    settings: Settings,
    cfg: StreamsConfig,
    opts: RelabelOptions,
    progress: Callable[[int, int], None] | None = None,
) -> RelabelCounts:
    """Replay, label and (unless a dry run) write. `progress(done, total)` is called as records are read.

    Raises kafka.errors.KafkaError when the broker refuses a write, RuntimeError when the topic is missing
    or the replay stops making progress (no record for `idle_timeout_s`)."""
    from app.infra.kafka import make_consumer, make_producer

    started = time.time()
    topic = settings.topic("interactions")
    window = settings.wait_window
    core = Relabeller(
        opts.spec,
        window,
        cfg.retention(window),
        cfg.metrics_bucket,
        since_s=opts.since.timestamp(),
        until_s=None if opts.until is None else opts.until.timestamp(),
        run_id=opts.run_id,
        topic=topic,
        empty_max_tokens=cfg.empty_completion_max_tokens,
        sessions=cfg.ledger() if cfg.sessions else None,
    )
    consumer = make_consumer(
        settings, group_id=None, consumer_timeout_ms=1000
    )  # no group: nothing is committed
    producer = None if opts.dry_run else make_producer(settings)
    sends: list[tuple[str, Any]] = []

    def settle() -> None:
        """Wait for every record sent so far; a record the broker refused fails the run (raises KafkaError)."""
        assert producer is not None, "a dry run sends nothing"
        producer.flush(timeout=max(30.0, settings.kafka_produce_timeout * 2))
        for kind, fut in sends:
            fut.get(timeout=settings.kafka_produce_timeout)
            if kind == "rollouts":
                core.counts.written += 1
        sends.clear()

    try:
        plan = plan_offsets(consumer, topic, opts, window)
        todo = {tp: rng for tp, rng in plan.items() if rng[1] > rng[0]}
        total = sum(stop - start for start, stop in todo.values())
        log.info(
            "relabel %s under %s: %s",
            topic,
            opts.spec.version,
            {
                tp.partition: list(rng)
                for tp, rng in sorted(plan.items(), key=lambda kv: kv[0].partition)
            },
        )
        if todo:
            consumer.assign(list(todo))
            for tp, (start, _) in todo.items():
                consumer.seek(tp, start)
        done, last_progress = 0, time.monotonic()
        merge = TimeMerge(sorted(todo, key=lambda tp: tp.partition))

        def emit(out: list[Emit]) -> None:
            for e in out:
                if producer is not None:
                    target = (
                        settings.topic("rollouts")
                        if e.topic == "rollouts"
                        else settings.topic("dlq")
                    )
                    sends.append(
                        (e.topic, producer.send(target, key=e.key, value=orjson.dumps(e.value)))
                    )
            if len(sends) >= SETTLE_EVERY:
                settle()  # bounded memory: futures of at most this many records are held

        while todo:
            batch = consumer.poll(timeout_ms=500, max_records=2000)
            for tp, records in batch.items():
                stop = todo.get(tp, (0, -1))[1]
                for rec in records:
                    if rec.offset >= stop:
                        break
                    merge.add(tp, rec)
            if batch:
                last_progress = time.monotonic()
            for tp in list(todo):
                if consumer.position(tp) >= todo[tp][1]:
                    del todo[tp]
                    consumer.pause(tp)
                    merge.done(tp)
            for tp in todo:  # bounded memory: a partition far ahead of the others waits
                (consumer.pause if merge.held(tp) >= MERGE_BUFFER else consumer.resume)(tp)
            for tp, rec in merge.ready():
                done += 1
                emit(
                    core.feed(tp.partition, rec.offset, rec.key, rec.value, rec.timestamp / 1000.0)
                )
            if batch and progress is not None:
                progress(done, total)
            if todo and time.monotonic() - last_progress > opts.idle_timeout_s:
                raise RuntimeError(
                    f"no interactions record arrived for {opts.idle_timeout_s:.0f}s while partitions "
                    f"{sorted(tp.partition for tp in todo)} are below their end offsets; stopped"
                )
        # windows that ended before the run started (minus the live worker's skew margin) are complete
        watermark = started - cfg.skew_margin
        if opts.until is not None:
            watermark = min(watermark, opts.until.timestamp() + window)
        emit(core.finish(watermark))
        if producer is not None:
            settle()
        if progress is not None:
            progress(total, total)
        return core.counts
    finally:
        consumer.close(autocommit=False)
        if producer is not None:
            producer.close(timeout=10)
