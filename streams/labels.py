"""The join: per-request label state, wait windows, dedupe and close (pure; no Faust, no Kafka).

`Aggregator` is the whole decision logic of the streams worker. The Faust agent feeds it
decoded interaction records and timer ticks and sends what it returns; tests drive it with
plain dicts. All state that must survive a restart lives in the three mappings it is given
(Faust tables with changelogs in the worker); the heaps and watermarks here are derived
and rebuilt from those mappings after a (re)assignment.

Time. "When a record reached the aggregator" is its Kafka record timestamp (`rt`), not the
wall clock at processing, so replaying the same records after a crash gives the same
labels. Per partition a watermark `wm` (the largest record timestamp processed, or a tick's
wall time minus a skew margin once the partition is caught up) decides closing: a label
whose deadline <= wm is closed before the next record is applied, so a feedback record
with rt >= deadline is `after_close`, one with rt < deadline is counted.

State that must survive a restart, one JSON-able value per key in the three mappings
(`labels`, `generations`, `buckets`), written and read through typed records: `Label` (per
request_id), `BucketMarker` (per emitted metrics bucket) and, for the merger, `MergedBucket`.
Each record's `from_stored`/`to_stored` is the one place that knows the stored form (short keys
such as `st`, `dl`, `fb`, `gen`, kept byte for byte: the tables' changelogs hold them). The
generation payload lives in `generations` until the close (written once, not per feedback).
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from app.contracts.events import EventValidationError, parse_event
from app.contracts.rollouts import (
    LABEL_SUM_FIELDS,
    SUM_FIELDS,
    add_sums,
    empty_sums,
    rollout_sums,
    version_metrics,
)
from streams.reward import RewardSpec, compute_reward, protected_writes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Emit:
    """One output record: `topic` is a logical name: rollouts | late | dlq | partials."""

    topic: str
    key: str | None
    value: dict[str, Any]


def iso_now(clock: Callable[[], float]) -> str:
    return datetime.fromtimestamp(clock(), tz=UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Refused:
    """Why an interactions record cannot be joined: a DLQ reason and its errors."""

    reason: str
    errors: list[dict[str, Any]]


def decode_interaction(key: bytes | None, value: bytes | None) -> dict[str, Any] | Refused:
    """The event of one interactions record, or why it is refused (`invalid_json`, `invalid_event`,
    `key_mismatch`). The one decoder of the topic for everything that joins it (the streams worker,
    `flywheel streams relabel`), so both accept and refuse exactly the same records."""
    try:
        obj = orjson.loads(
            value if value is not None else b""
        )  # strict: NaN/Infinity and bad UTF-8 rejected
    except orjson.JSONDecodeError as exc:
        return Refused("invalid_json", [{"field": "(record)", "message": f"not valid JSON: {exc}"}])
    try:
        parse_event(obj)
    except EventValidationError as exc:
        return Refused("invalid_event", [e.model_dump() for e in exc.errors])
    if key is None or key != obj["request_id"].encode():
        return Refused(
            "key_mismatch",
            [
                {
                    "field": "(key)",
                    "message": "the record key must be the event's request_id "
                    "(the join relies on it)",
                }
            ],
        )
    return obj


LabelStatus = Literal["pending", "open", "closed", "idle"]
WAITING: tuple[LabelStatus, ...] = ("pending", "open")  # statuses whose window is running
_STATUSES = frozenset(("pending", "open", "closed", "idle"))


@dataclass(slots=True)
class WaitingFeedback:
    """A feedback event a pending or open label holds until it closes (stored `{"id", "ev"}`)."""

    event_id: str  # "id"
    event: dict[str, Any]  # "ev": the decoded feedback event, as it arrived


@dataclass(slots=True)
class LabelClose:
    """What a closed label keeps for its version metrics (stored beside the label's keys)."""

    bucket_start: float  # "b": start of the metrics bucket the close falls in
    model_version: str  # "v": the generation's model_version
    sums: dict[str, float]  # "m": the rollout's metric sums (app.contracts.rollouts.SUM_FIELDS)
    closed_at: float  # "closed": record time the window closed at (its deadline)


@dataclass(slots=True)
class Label:
    """The join state of one request_id (a value of the `labels` table).

    `status`:
        pending  feedback waiting for its generation
        open     generation seen, window running
        closed   rollout emitted; kept `retention_s` to route late feedback and drop duplicates
        idle     feedback orphaned (or the close failed); kept `retention_s` for dedupe
    Stored as a JSON object with short keys, in this order (the changelogs hold it; `to_stored`
    writes exactly what the dict-based join wrote, `from_stored` reads it back):
        pending/open  {"p", "st", "dl", "seen", "fb", "gen"}
        closed        {"p", "st", "dl", "seen", "gen", "b", "v", "m", "closed"}
        idle          {"p", "st", "dl", "seen", "gen"}
    A value: the join never changes a label in place, it builds the next one (`seeing`,
    `holding`, `opened`, `retained`). Not `frozen` (nor are `WaitingFeedback` and `LabelClose`):
    labels are built and read a few times per event, and a frozen dataclass's __init__ (one
    object.__setattr__ per field) made the join itself 1.7x as slow as on plain dicts (8.5 ->
    14.7 us per event); as it is, 11.5 us (the worker spends 50-80 us of CPU per record).
    """

    partition: int  # "p": the interactions partition the request_id hashes to
    status: LabelStatus  # "st"
    deadline: float  # "dl": close time (pending/open) or forget time (closed/idle), record time
    seen: tuple[str, ...]  # "seen": event_ids already handled (dedupe), in arrival order
    generation_id: str | None  # "gen": event_id of the generation (None: pending/idle)
    feedback: tuple[WaitingFeedback, ...] = ()  # "fb": pending/open only
    close: LabelClose | None = None  # "b", "v", "m", "closed": closed only

    @property
    def waiting(self) -> bool:
        """Pending or open: the label counts in `Aggregator.open_labels`."""
        return self.status in WAITING

    # each change builds the next label (positional: this runs a few times per event)
    def seeing(self, event_id: str) -> Label:
        """This label with `event_id` handled (a duplicate generation, late feedback)."""
        return Label(
            self.partition,
            self.status,
            self.deadline,
            (*self.seen, event_id),
            self.generation_id,
            self.feedback,
            self.close,
        )

    def holding(self, event_id: str, event: dict[str, Any]) -> Label:
        """This pending or open label with feedback `event` waiting for the close."""
        return Label(
            self.partition,
            self.status,
            self.deadline,
            (*self.seen, event_id),
            self.generation_id,
            (*self.feedback, WaitingFeedback(event_id, event)),
        )

    def opened(self, generation_id: str, deadline: float) -> Label:
        """This pending label joined by its generation: open until `deadline`."""
        return Label(
            self.partition,
            "open",
            deadline,
            (*self.seen, generation_id),
            generation_id,
            self.feedback,
        )

    def retained(self, retention_s: float, close: LabelClose | None = None) -> Label:
        """This pending or open label out of its window, kept `retention_s` past its deadline:
        closed (with `close`, the generation kept) or idle (without it, the generation dropped)."""
        return Label(
            self.partition,
            "closed" if close is not None else "idle",
            self.deadline + retention_s,
            self.seen,
            self.generation_id if close is not None else None,
            (),
            close,
        )

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> Label:
        status = stored["st"]
        assert status in _STATUSES, f"unknown label state {status!r}"
        fb = stored.get("fb")
        return cls(
            stored["p"],
            status,
            stored["dl"],
            tuple(stored["seen"]),
            stored.get("gen"),
            tuple([WaitingFeedback(f["id"], f["ev"]) for f in fb]) if fb else (),
            LabelClose(stored["b"], stored["v"], stored["m"], stored["closed"])
            if status == "closed"
            else None,
        )

    def to_stored(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "p": self.partition,
            "st": self.status,
            "dl": self.deadline,
            "seen": list(self.seen),
        }
        if self.status in WAITING:
            out["fb"] = [{"id": f.event_id, "ev": f.event} for f in self.feedback]
        out["gen"] = self.generation_id
        if self.close is not None:
            c = self.close
            out.update(b=c.bucket_start, v=c.model_version, m=c.sums, closed=c.closed_at)
        return out


@dataclass(frozen=True, slots=True)
class BucketMarker:
    """A value of the `buckets` table under '<partition>|<bucket start>': the partition's partial of
    that bucket was emitted; kept until `forget_at` so a replay does not emit it again. Stored
    `{"p", "dl"}`. (The table also holds the worker's input progress, `{"offset"}`, which is not
    a marker: `from_stored` returns None for it.)"""

    partition: int  # "p"
    forget_at: float  # "dl": record time after which the marker is dropped

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any] | None) -> BucketMarker | None:
        if not stored or "p" not in stored:
            return None
        return cls(stored["p"], stored["dl"])

    def to_stored(self) -> dict[str, Any]:
        return {"p": self.partition, "dl": self.forget_at}


def bucket_of(t: float, bucket_s: float) -> float:
    """Start of the version-metrics bucket that time `t` falls in."""
    return math.floor(t / bucket_s) * bucket_s


PartialStage = Literal["labels", "sessions"]


def partial_record(
    version: str,
    bucket_start: float,
    bucket_s: float,
    partition: int,
    reward_spec: str,
    sums: dict[str, float],
    stage: PartialStage = "labels",
) -> dict[str, Any]:
    """A record of `<ns>.streams-metric-partials` (`Partial`): one partition's sums of one bucket
    and version, as the aggregate stage (closed labels, by interactions partition) or the session
    stage (ended sessions, by turns partition: `stage` "sessions") writes it. Each replaces that
    stage's and partition's earlier partial of the bucket in the merger."""
    out: dict[str, Any] = {
        "model_version": version,
        "bucket_start": bucket_start,
        "bucket_seconds": bucket_s,
        "partition": partition,
        "reward_spec": reward_spec,
        "sums": sums,
    }
    if stage != "labels":  # the aggregate stage's partials keep their form
        out["stage"] = stage
    return out


@dataclass(frozen=True, slots=True)
class MergedBucket:
    """A value of the merger's `metric-buckets` table under '<version>|<bucket start>': the latest
    partial sums of each partition (stored `{"parts": {"<partition>": sums}}`; JSON keys are
    strings: `"3"` for interactions partition 3's closed labels, `"s3"` for turns partition 3's
    ended sessions)."""

    sums_by_partition: dict[str, dict[str, float]]  # "parts"

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any] | None) -> MergedBucket:
        return cls(stored["parts"] if stored else {})

    def with_partial(
        self, partition: int, sums: dict[str, float], stage: PartialStage = "labels"
    ) -> MergedBucket:
        """This bucket with `partition`'s sums of `stage` replaced by (or, first from it, added as)
        `sums`."""
        key = str(partition) if stage == "labels" else f"s{partition}"
        return MergedBucket({**self.sums_by_partition, key: sums})

    def partitions(self) -> tuple[list[int], list[int]]:
        """(interactions partitions, turns partitions) whose partials the bucket holds."""
        keys = self.sums_by_partition
        return [int(k) for k in keys if k[0] != "s"], [int(k[1:]) for k in keys if k[0] == "s"]

    def to_stored(self) -> dict[str, Any]:
        return {"parts": self.sums_by_partition}


class Aggregator:
    """Per-partition join and reward labelling. Not thread-safe: one agent (concurrency 1) drives it."""

    def __init__(
        self,
        spec: RewardSpec,
        window_s: float,
        retention_s: float,
        bucket_s: float,
        labels: MutableMapping[str, dict],
        generations: MutableMapping[str, dict],
        buckets: MutableMapping[str, dict],
        empty_max_tokens: int = 1,
        clock: Callable[[], float] = time.time,
    ):
        assert window_s >= 0 and bucket_s > 0, f"bad window {window_s} / bucket {bucket_s}"
        assert retention_s >= bucket_s, (
            f"retention {retention_s}s must cover a metrics bucket ({bucket_s}s)"
        )
        self.spec, self.window_s, self.retention_s, self.bucket_s = (
            spec,
            window_s,
            retention_s,
            bucket_s,
        )
        self.labels, self.generations, self.buckets = labels, generations, buckets
        self.empty_max_tokens, self.clock = empty_max_tokens, clock
        self._heap: dict[int, list[tuple[float, str]]] = {}
        self._wm: dict[int, float] = {}
        self._index: dict[
            int, dict[float, set[str]]
        ] = {}  # partition -> bucket_start -> closed request_ids
        self._markers: dict[
            int, list[tuple[float, str]]
        ] = {}  # partition -> heap of (forget at, bucket key)
        self._dirty: dict[
            int, set[float]
        ] = {}  # partition -> buckets with closes not yet in an emitted partial
        self.duplicates = 0
        self.open_labels = 0  # pending + open in the partitions held (for the gauge)

    # --- state (the stored form is read and written only here) ---------------------------------
    def label(self, rid: str) -> Label | None:
        """The label state of `rid`, or None (never seen, or forgotten after its retention)."""
        stored = self.labels.get(rid)
        return Label.from_stored(stored) if stored else None

    def label_items(self) -> Iterator[tuple[str, Label]]:
        """(request_id, label) of every label in the table."""
        for rid, stored in list(self.labels.items()):
            if stored:
                yield rid, Label.from_stored(stored)

    def _put(self, rid: str, label: Label) -> None:
        self.labels[rid] = label.to_stored()

    # --- partitions -------------------------------------------------------------------------
    def ensure_partition(self, p: int) -> None:
        """Rebuild the derived state of partition `p` from the tables (after an assignment)."""
        if p in self._heap:
            return
        heap: list[tuple[float, str]] = []
        index: dict[float, set[str]] = {}
        for rid, label in self.label_items():
            if label.partition != p:
                continue
            heap.append((label.deadline, rid))
            if label.close is not None:
                index.setdefault(label.close.bucket_start, set()).add(rid)
            elif label.waiting:
                self.open_labels += 1
        heapq.heapify(heap)
        markers = []
        for key, stored in list(self.buckets.items()):
            marker = BucketMarker.from_stored(stored)
            if marker is not None and marker.partition == p:
                markers.append((marker.forget_at, key))
        heapq.heapify(markers)
        self._heap[p], self._index[p], self._markers[p] = heap, index, markers
        self._dirty[p] = {b for b in index if f"{p}|{b!r}" not in self.buckets}
        self._wm.setdefault(p, -math.inf)

    def forget_partition(self, p: int) -> None:
        """Drop derived state of a revoked partition (another worker owns it now)."""
        heap = self._heap.pop(p, None)
        if heap is not None:
            labels = (self.label(rid) for _, rid in heap)
            self.open_labels -= sum(
                1
                for label in labels
                if label is not None and label.waiting and label.partition == p
            )
            self.open_labels = max(self.open_labels, 0)
        self._index.pop(p, None)
        self._markers.pop(p, None)
        self._dirty.pop(p, None)
        self._wm.pop(p, None)

    def watermark(self, p: int) -> float:
        return self._wm.get(p, -math.inf)

    # --- inputs -------------------------------------------------------------------------------
    def on_event(self, p: int, ev: dict[str, Any], rt: float) -> list[Emit]:
        """Apply one valid interaction event (`ev`: the decoded JSON) with record timestamp `rt`."""
        self.ensure_partition(p)
        out = self.advance(p, rt)
        rid, eid = ev["request_id"], ev["event_id"]
        label = self.label(rid)
        if label is not None and eid in label.seen:
            if (
                ev["type"] == "generation"
                and label.status == "open"
                and label.generation_id == eid
                and rid not in self.generations
            ):
                # a crash came between the label's changelog record and the generation's (they are
                # written side by side): the replayed generation restores the payload
                self.generations[rid] = ev
            self.duplicates += 1
            return out
        if ev["type"] == "generation":
            out += self._on_generation(p, rid, eid, ev, rt, label)
        else:
            out += self._on_feedback(p, rid, eid, ev, rt, label)
        return out

    def on_tick(self, p: int, now: float) -> list[Emit]:
        """Advance the watermark of a caught-up partition to `now` (already minus the skew margin)."""
        self.ensure_partition(p)
        return self.advance(p, now)

    def _on_generation(
        self, p: int, rid: str, eid: str, ev: dict, rt: float, label: Label | None
    ) -> list[Emit]:
        if label is not None and label.generation_id is not None:
            self._put(rid, label.seeing(eid))
            return [
                Emit(
                    "dlq",
                    None,
                    {
                        "reason": "conflicting_generation",
                        "errors": [
                            {
                                "field": "request_id",
                                "message": f"request {rid!r} already has generation {label.generation_id!r}",
                            }
                        ],
                        "event": ev,
                    },
                )
            ]
        dl = rt + self.window_s
        if label is None or label.status == "idle":
            seen = (*(label.seen if label else ()), eid)
            label = Label(partition=p, status="open", deadline=dl, seen=seen, generation_id=eid)
            self.open_labels += 1
        else:  # pending: the feedback that waited joins the label
            assert label.status == "pending", f"unexpected state {label.status} for {rid}"
            label = label.opened(eid, dl)
        self.generations[rid] = ev
        self._put(rid, label)
        heapq.heappush(self._heap[p], (dl, rid))
        return []

    def _on_feedback(
        self, p: int, rid: str, eid: str, ev: dict, rt: float, label: Label | None
    ) -> list[Emit]:
        if label is None or label.status == "idle":
            dl = rt + self.window_s
            self._put(
                rid,
                Label(
                    partition=p,
                    status="pending",
                    deadline=dl,
                    seen=(*(label.seen if label else ()), eid),
                    generation_id=None,
                    feedback=(WaitingFeedback(eid, ev),),
                ),
            )
            heapq.heappush(self._heap[p], (dl, rid))
            self.open_labels += 1
            return []
        if label.waiting:
            self._put(rid, label.holding(eid, ev))
            return []
        assert label.status == "closed", f"unexpected state {label.status} for {rid}"
        self._put(rid, label.seeing(eid))
        return [self._late("after_close", rid, ev)]

    # --- time ----------------------------------------------------------------------------------
    def advance(self, p: int, wm: float) -> list[Emit]:
        """Move partition p's watermark to `wm` (never back) and act on every deadline <= wm."""
        self.ensure_partition(p)
        if wm <= self._wm[p]:
            return []
        self._wm[p] = wm
        heap, out, forget = self._heap[p], [], []
        while heap and heap[0][0] <= wm:
            dl, rid = heapq.heappop(heap)
            label = self.label(rid)
            if label is None or label.deadline != dl or label.partition != p:
                continue  # stale heap entry (the label moved on)
            if label.status == "open":
                out += self._close_or_fail(p, rid, label)
            elif label.status == "pending":
                out += self._orphan(p, rid, label)
            else:  # closed / idle past retention
                forget.append((rid, label))
        out += self._emit_buckets(p, wm)
        for rid, label in forget:
            if label.close is not None:
                bucket = self._index[p].get(label.close.bucket_start)
                if bucket is not None:
                    bucket.discard(rid)
                    if not bucket:
                        del self._index[p][label.close.bucket_start]
            del self.labels[rid]
            if label.status == "closed":
                self.generations.pop(
                    rid, None
                )  # normally gone at the close; a crash can leave it behind
        markers = self._markers[p]
        while markers and markers[0][0] <= wm:
            _, key = heapq.heappop(markers)
            self.buckets.pop(key, None)
        return out

    def _close_or_fail(self, p: int, rid: str, label: Label) -> list[Emit]:
        """Close an open label; if closing raises, the label fails instead of the worker.

        A failed label becomes `idle` (kept `retention_s` so replayed events stay deduplicated;
        feedback arriving later is orphaned as for any idle label) and each of its events (the
        generation and every feedback) comes back as a DLQ entry keyed by request_id with reason
        `label_close_failed`. Nothing of the label was written before the failure: `_close`
        changes state only after the rollout and its sums are built."""
        try:
            return [self._close(p, rid, label)]
        except Exception as exc:
            log.exception("label %s failed to close; its events are dead-lettered", rid)
            gen = self.generations.pop(rid, None)
            idle = label.retained(self.retention_s)
            self._put(rid, idle)
            heapq.heappush(self._heap[p], (idle.deadline, rid))
            self.open_labels -= 1
            errors = [
                {
                    "field": "(label)",
                    "message": f"closing the label of {rid!r} failed: {type(exc).__name__}: {exc}"[
                        :2000
                    ],
                }
            ]
            events = ([gen] if gen is not None else []) + [f.event for f in label.feedback]
            return [
                Emit("dlq", rid, {"reason": "label_close_failed", "errors": errors, "event": ev})
                for ev in events
            ]

    def _close(self, p: int, rid: str, label: Label) -> Emit:
        gen = self.generations[rid]
        res = compute_reward(self.spec, [f.event for f in label.feedback])
        rollout = {
            "request_id": rid,
            "session_id": gen["session_id"],
            "group_id": gen.get("group_id"),
            "model_version": gen["model_version"],
            "prompt_tokens": gen["prompt_tokens"],
            "completion_tokens": gen["completion_tokens"],
            "logprobs": gen["logprobs"],
            "routes": gen.get("routes"),
            "route_shape": gen.get("route_shape"),
            "reward": res.reward,
            "components": res.components,
            "tool_errors": res.tool_errors,
            "reward_spec": self.spec.version,
            "generated_at": gen["ts"],
            "labelled_at": iso_now(self.clock),
            "closed_by": "window",
            "tokenizer": gen.get("tokenizer"),
            "temperature": gen.get("temperature"),
            "finish_reason": gen.get("finish_reason"),
            "constrained": gen.get("constrained"),
        }
        for key in ("turn", "tools_digest"):  # chat turns: what the session ledger segments by
            if gen.get(key) is not None:
                rollout[key] = gen[key]
        if self.spec.weights.protected_paths is not None and gen.get("turn") is not None:
            # what the session ledger sums to judge the session's outcome (streams/reward.py)
            rollout["protected_writes"] = protected_writes(self.spec.weights, gen.get("tool_calls"))
        bucket = bucket_of(label.deadline, self.bucket_s)
        sums = rollout_sums(rollout, res.raw, self.empty_max_tokens)
        del self.generations[rid]  # from here on nothing raises: the label is closed
        closed = label.retained(
            self.retention_s, LabelClose(bucket, gen["model_version"], sums, label.deadline)
        )
        self._put(rid, closed)
        self._index[p].setdefault(bucket, set()).add(rid)
        self._dirty[p].add(bucket)
        heapq.heappush(self._heap[p], (closed.deadline, rid))
        self.open_labels -= 1
        return Emit("rollouts", rid, rollout)

    def _orphan(self, p: int, rid: str, label: Label) -> list[Emit]:
        idle = label.retained(self.retention_s)
        self._put(rid, idle)
        heapq.heappush(self._heap[p], (idle.deadline, rid))
        self.open_labels -= 1
        return [self._late("orphan", rid, f.event) for f in label.feedback]

    def _late(self, reason: str, rid: str, ev: dict) -> Emit:
        return Emit(
            "late",
            rid,
            {"reason": reason, "request_id": rid, "event": ev, "detected_at": iso_now(self.clock)},
        )

    def _emit_buckets(self, p: int, wm: float) -> list[Emit]:
        """Per-partition partial metrics of every bucket that ended at or before wm and has new closes.

        Normally once per bucket; a label that closes into an already emitted bucket (a
        record far behind the watermark) re-emits the bucket's whole partial, which the
        merger uses to replace the earlier one.
        """
        dirty = self._dirty[p]
        ready = [k for k in dirty if k + self.bucket_s <= wm]
        if not ready:
            return []  # the common case: called on every watermark move
        out = []
        for b in sorted(ready):
            dirty.discard(b)
            rids = self._index[p].get(b)
            if not rids:
                continue
            per_version: dict[str, dict[str, float]] = {}
            for rid in sorted(rids):
                label = self.label(rid)
                close = label.close if label is not None else None
                assert close is not None, f"{rid} is in bucket {b} but not a closed label"
                add_sums(
                    per_version.setdefault(close.model_version, empty_sums(LABEL_SUM_FIELDS)),
                    close.sums,
                )
            for version, sums in sorted(per_version.items()):
                value = partial_record(version, b, self.bucket_s, p, self.spec.version, sums)
                out.append(Emit("partials", version, value))
            key = f"{p}|{b!r}"
            if key not in self.buckets:
                marker = BucketMarker(p, b + self.bucket_s + self.retention_s)
                self.buckets[key] = marker.to_stored()
                heapq.heappush(self._markers[p], (marker.forget_at, key))
        return out


class MetricsMerger:
    """Second stage: merges per-partition partial sums into one record per (model_version, bucket).

    `state` maps "<version>|<bucket_start>" -> a stored `MergedBucket`; a partial replaces that
    stage's and partition's earlier one (idempotent under redelivery). The partials come from the
    aggregate stage (closed labels) and from the session stage (ended agent sessions,
    streams/session_stage.py); both add up in one record.
    """

    def __init__(self, state: MutableMapping[str, dict]):
        self.state = state

    def on_partial(self, partial: dict[str, Any]) -> Emit:
        """Raises (ValueError, KeyError, TypeError) for a partial that is not one the aggregator writes;
        the state is changed only once the merged record was built."""
        partial = Partial.model_validate(partial)
        key = f"{partial.model_version}|{partial.bucket_start!r}"
        merged = MergedBucket.from_stored(self.state.get(key)).with_partial(
            partial.partition, partial.sums, partial.stage
        )
        total = empty_sums()
        for sums in merged.sums_by_partition.values():
            add_sums(total, sums)
        labels, sessions = merged.partitions()
        rec = version_metrics(
            partial.model_version,
            partial.bucket_start,
            partial.bucket_seconds,
            partial.reward_spec,
            labels,
            total,
            sessions,
        )
        self.state[key] = merged.to_stored()
        return Emit("version-metrics", partial.model_version, rec.model_dump(mode="json"))


class Partial(BaseModel):
    """A record of `<ns>.streams-metric-partials` as `partial_record` builds it (the aggregate
    stage's `Aggregator._emit_buckets`, the session stage's `Ledger._emit_bucket`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_version: str = Field(min_length=1)
    bucket_start: float
    bucket_seconds: float = Field(gt=0)
    partition: int = Field(ge=0)
    reward_spec: str
    sums: dict[Literal[SUM_FIELDS], float]  # type: ignore[valid-type]
    stage: PartialStage = Field(
        "labels",
        description="who wrote it: the aggregate stage (closed labels of interactions partition "
        "`partition`) or the session stage (sessions of turns partition `partition` that ended)",
    )
