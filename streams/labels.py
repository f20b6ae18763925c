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

Label state per request_id (a JSON-able dict in `labels`):
    st    "pending" (feedback waiting for its generation), "open" (generation seen, window
          running), "closed" (rollout emitted; kept `retention_s` to route late feedback
          and drop duplicates), "idle" (feedback orphaned; kept `retention_s` for dedupe)
    dl    deadline: close time (pending/open) or forget time (closed/idle)
    p     partition;  seen: event_ids already handled (dedupe);  gen: generation event_id
    fb    feedback entries [{"id", "ev"}] while pending/open
    b, m  bucket start and metric sums of a closed label (for version metrics)
The generation payload lives in `generations` until the close (written once, not per feedback).
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from app.contracts.events import EventValidationError, parse_event
from app.contracts.rollouts import SUM_FIELDS, add_sums, empty_sums, rollout_sums, version_metrics
from streams.reward import RewardSpec, compute_reward

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

    # --- partitions -------------------------------------------------------------------------
    def ensure_partition(self, p: int) -> None:
        """Rebuild the derived state of partition `p` from the tables (after an assignment)."""
        if p in self._heap:
            return
        heap: list[tuple[float, str]] = []
        index: dict[float, set[str]] = {}
        for rid, st in list(self.labels.items()):
            if not st or st.get("p") != p:
                continue
            heap.append((st["dl"], rid))
            if st["st"] == "closed":
                index.setdefault(st["b"], set()).add(rid)
            elif st["st"] in ("open", "pending"):
                self.open_labels += 1
        heapq.heapify(heap)
        markers = [(v["dl"], k) for k, v in list(self.buckets.items()) if v and v.get("p") == p]
        heapq.heapify(markers)
        self._heap[p], self._index[p], self._markers[p] = heap, index, markers
        self._dirty[p] = {b for b in index if f"{p}|{b!r}" not in self.buckets}
        self._wm.setdefault(p, -math.inf)

    def forget_partition(self, p: int) -> None:
        """Drop derived state of a revoked partition (another worker owns it now)."""
        heap = self._heap.pop(p, None)
        if heap is not None:
            self.open_labels -= sum(
                1
                for _, rid in heap
                if (self.labels.get(rid) or {}).get("st") in ("open", "pending")
                and self.labels[rid].get("p") == p
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
        st = self.labels.get(rid)
        if st is not None and eid in st["seen"]:
            if (
                ev["type"] == "generation"
                and st["st"] == "open"
                and st.get("gen") == eid
                and rid not in self.generations
            ):
                # a crash came between the label's changelog record and the generation's (they are
                # written side by side): the replayed generation restores the payload
                self.generations[rid] = ev
            self.duplicates += 1
            return out
        if ev["type"] == "generation":
            out += self._on_generation(p, rid, eid, ev, rt, st)
        else:
            out += self._on_feedback(p, rid, eid, ev, rt, st)
        return out

    def on_tick(self, p: int, now: float) -> list[Emit]:
        """Advance the watermark of a caught-up partition to `now` (already minus the skew margin)."""
        self.ensure_partition(p)
        return self.advance(p, now)

    def _on_generation(
        self, p: int, rid: str, eid: str, ev: dict, rt: float, st: dict | None
    ) -> list[Emit]:
        if st is not None and st.get("gen") is not None:
            st = dict(st, seen=st["seen"] + [eid])
            self.labels[rid] = st
            return [
                Emit(
                    "dlq",
                    None,
                    {
                        "reason": "conflicting_generation",
                        "errors": [
                            {
                                "field": "request_id",
                                "message": f"request {rid!r} already has generation {st['gen']!r}",
                            }
                        ],
                        "event": ev,
                    },
                )
            ]
        dl = rt + self.window_s
        if st is None or st["st"] == "idle":
            seen = (st["seen"] if st else []) + [eid]
            st = {"p": p, "st": "open", "dl": dl, "seen": seen, "fb": [], "gen": eid}
            self.open_labels += 1
        else:  # pending: the feedback that waited joins the label
            assert st["st"] == "pending", f"unexpected state {st['st']} for {rid}"
            st = dict(st, st="open", dl=dl, seen=st["seen"] + [eid], gen=eid)
        self.generations[rid] = ev
        self.labels[rid] = st
        heapq.heappush(self._heap[p], (dl, rid))
        return []

    def _on_feedback(
        self, p: int, rid: str, eid: str, ev: dict, rt: float, st: dict | None
    ) -> list[Emit]:
        if st is None or st["st"] == "idle":
            dl = rt + self.window_s
            seen = (st["seen"] if st else []) + [eid]
            self.labels[rid] = {
                "p": p,
                "st": "pending",
                "dl": dl,
                "seen": seen,
                "fb": [{"id": eid, "ev": ev}],
                "gen": None,
            }
            heapq.heappush(self._heap[p], (dl, rid))
            self.open_labels += 1
            return []
        if st["st"] in ("pending", "open"):
            self.labels[rid] = dict(
                st, seen=st["seen"] + [eid], fb=st["fb"] + [{"id": eid, "ev": ev}]
            )
            return []
        assert st["st"] == "closed", f"unexpected state {st['st']} for {rid}"
        self.labels[rid] = dict(st, seen=st["seen"] + [eid])
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
            st = self.labels.get(rid)
            if st is None or st.get("dl") != dl or st.get("p") != p:
                continue  # stale heap entry (the label moved on)
            if st["st"] == "open":
                out += self._close_or_fail(p, rid, st)
            elif st["st"] == "pending":
                out += self._orphan(p, rid, st)
            else:  # closed / idle past retention
                forget.append((rid, st))
        out += self._emit_buckets(p, wm)
        for rid, st in forget:
            if st["st"] == "closed":
                bucket = self._index[p].get(st["b"])
                if bucket is not None:
                    bucket.discard(rid)
                    if not bucket:
                        del self._index[p][st["b"]]
            del self.labels[rid]
            if st["st"] == "closed":
                self.generations.pop(
                    rid, None
                )  # normally gone at the close; a crash can leave it behind
        markers = self._markers[p]
        while markers and markers[0][0] <= wm:
            _, key = heapq.heappop(markers)
            self.buckets.pop(key, None)
        return out

    def _close_or_fail(self, p: int, rid: str, st: dict) -> list[Emit]:
        """Close an open label; if closing raises, the label fails instead of the worker.

        A failed label becomes `idle` (kept `retention_s` so replayed events stay deduplicated;
        feedback arriving later is orphaned as for any idle label) and each of its events (the
        generation and every feedback) comes back as a DLQ entry keyed by request_id with reason
        `label_close_failed`. Nothing of the label was written before the failure: `_close`
        changes state only after the rollout and its sums are built."""
        try:
            return [self._close(p, rid, st)]
        except Exception as exc:
            log.exception("label %s failed to close; its events are dead-lettered", rid)
            gen = self.generations.pop(rid, None)
            self.labels[rid] = {
                "p": p,
                "st": "idle",
                "dl": st["dl"] + self.retention_s,
                "seen": st["seen"],
                "gen": None,
            }
            heapq.heappush(self._heap[p], (st["dl"] + self.retention_s, rid))
            self.open_labels -= 1
            errors = [
                {
                    "field": "(label)",
                    "message": f"closing the label of {rid!r} failed: {type(exc).__name__}: {exc}"[
                        :2000
                    ],
                }
            ]
            events = ([gen] if gen is not None else []) + [f["ev"] for f in st["fb"]]
            return [
                Emit("dlq", rid, {"reason": "label_close_failed", "errors": errors, "event": ev})
                for ev in events
            ]

    def _close(self, p: int, rid: str, st: dict) -> Emit:
        gen = self.generations[rid]
        res = compute_reward(self.spec, [f["ev"] for f in st["fb"]])
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
        }
        bucket = math.floor(st["dl"] / self.bucket_s) * self.bucket_s
        sums = rollout_sums(rollout, res.raw, self.empty_max_tokens)
        del self.generations[rid]  # from here on nothing raises: the label is closed
        self.labels[rid] = {
            "p": p,
            "st": "closed",
            "dl": st["dl"] + self.retention_s,
            "seen": st["seen"],
            "gen": st["gen"],
            "b": bucket,
            "v": gen["model_version"],
            "m": sums,
            "closed": st["dl"],
        }
        self._index[p].setdefault(bucket, set()).add(rid)
        self._dirty[p].add(bucket)
        heapq.heappush(self._heap[p], (st["dl"] + self.retention_s, rid))
        self.open_labels -= 1
        return Emit("rollouts", rid, rollout)

    def _orphan(self, p: int, rid: str, st: dict) -> list[Emit]:
        self.labels[rid] = {
            "p": p,
            "st": "idle",
            "dl": st["dl"] + self.retention_s,
            "seen": st["seen"],
            "gen": None,
        }
        heapq.heappush(self._heap[p], (st["dl"] + self.retention_s, rid))
        self.open_labels -= 1
        return [self._late("orphan", rid, f["ev"]) for f in st["fb"]]

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
                st = self.labels[rid]
                add_sums(per_version.setdefault(st["v"], empty_sums()), st["m"])
            for version, sums in sorted(per_version.items()):
                out.append(
                    Emit(
                        "partials",
                        version,
                        {
                            "model_version": version,
                            "bucket_start": b,
                            "bucket_seconds": self.bucket_s,
                            "partition": p,
                            "reward_spec": self.spec.version,
                            "sums": sums,
                        },
                    )
                )
            key = f"{p}|{b!r}"
            if key not in self.buckets:
                forget_at = b + self.bucket_s + self.retention_s
                self.buckets[key] = {"p": p, "dl": forget_at}
                heapq.heappush(self._markers[p], (forget_at, key))
        return out


class MetricsMerger:
    """Second stage: merges per-partition partial sums into one record per (model_version, bucket).

    `state` maps "<version>|<bucket_start>" -> {"parts": {partition: sums}, ...}; a partial
    replaces that partition's earlier one (idempotent under redelivery).
    """

    def __init__(self, state: MutableMapping[str, dict]):
        self.state = state

    def on_partial(self, partial: dict[str, Any]) -> Emit:
        """Raises (ValueError, KeyError, TypeError) for a partial that is not one the aggregator writes;
        the state is changed only once the merged record was built."""
        partial = Partial.model_validate(partial)
        key = f"{partial.model_version}|{partial.bucket_start!r}"
        cur = self.state.get(key) or {"parts": {}}
        parts = dict(cur["parts"], **{str(partial.partition): partial.sums})
        total = empty_sums()
        for sums in parts.values():
            add_sums(total, sums)
        rec = version_metrics(
            partial.model_version,
            partial.bucket_start,
            partial.bucket_seconds,
            partial.reward_spec,
            [int(k) for k in parts],
            total,
        )
        self.state[key] = {"parts": parts}
        return Emit("version-metrics", partial.model_version, rec.model_dump(mode="json"))


class Partial(BaseModel):
    """A record of `<ns>.streams-metric-partials` as `Aggregator._emit_buckets` writes it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_version: str = Field(min_length=1)
    bucket_start: float
    bucket_seconds: float = Field(gt=0)
    partition: int = Field(ge=0)
    reward_spec: str
    sums: dict[Literal[SUM_FIELDS], float]  # type: ignore[valid-type]
