"""The session ledger: a session's labelled turns -> segments -> one rollout per segment (pure).

Agent sessions are many chat calls, each labelled on its own by the join (streams/labels.py).
`Ledger` takes those rollout records (each with the generation's `turn` and `tools_digest`
beside), groups each session's turns into segments of turns that extend one another
(streams/segments.py: the extension rule and the record a segment makes) and emits one rollout
per segment. Like `Aggregator` it is plain logic: no Faust, no Kafka. Time is passed in (`now`
on every call: a record timestamp, or a tick's time) and is the only clock, so a replay gives
the same output, `detected_at` of late records included. The streams worker runs it in its
`assemble` agent (streams/app.py); `flywheel streams relabel` runs it over a replay.

Per session, turns are applied in order of `turn` (then `generated_at`, then request_id):

- a record without `turn` (`/v1/completions`, `/v1/complete`) is a one-turn segment at once
  (`not_a_chat_turn`), its record unchanged; it touches no session state, so a redelivered one
  is emitted again, identically (the rollouts topic is keyed and compacted by request_id);
- a repeated request_id is ignored (`duplicates`);
- a turn after the session ended goes to `late` (`session_ended`); a turn at or below one
  already applied goes to `late` (`after_close` when the segment that holds its place has
  closed, `superseded` when the open one went past it: another choice of the same turn, or a
  turn the idle window gave up waiting for) unless it was generated after every applied turn:
  then it is a later call on a shorter history (a client that compacted or dropped messages
  numbers its turns from what it kept) and is applied, breaking the segment;
- a turn further on than the next one expected (or a session's first turn above 0) waits,
  up to `idle_s` after it arrived, for the turns before it; then the waiting turns are applied
  in order with the gap (a missing turn's tokens end up in a later prompt, so in the context,
  masked out);
- an applied turn extends the open segment or closes it and opens a new one; the reason is
  counted (`opened.<reason>`, `closed.<reason>`) and given on the emitted record (`Emit`).

A segment closes when a turn breaks it (`history_rewritten`, `tools_changed`,
`version_tokenizer_changed`), after `idle_s` without a turn of its session (`idle`), on
`end_session` (`end`), at `max_turns` turns (`max_turns`), when the next turn would take it past
`max_tokens` tokens or it reached them (`max_tokens`), when the next turn would take its record
past `max_bytes` (`max_bytes`: `segments.record_bytes`, an upper bound), or when its session is the least
recently active of more than `max_open_sessions` open ones (`open_sessions`). The segment after
a close by idle or a bound opens with that reason; nothing is lost across a close.

Outcomes. A `session_outcome` event (`on_outcome`) names the session's last generation; the
session ends (its segment closes with `end`) once that turn is applied, or `idle_s` after the
event if the turn never comes (an ending session does not close idle meanwhile). A segment a
break closed (`BREAKS`: a rewrite, other tools or tokenizer, a bound) is held in the session,
not emitted, while the outcome is unknown (at most `max_turns` such records; past that the
oldest goes out without it): when the session ends every held segment goes out with the
outcome, so the pieces of a compacted trajectory share it; when it goes idle without one they
go out without it. After the end, the session's turns go to late (`session_ended`); a second
outcome goes to late (`outcome_repeated`); an outcome after every segment of its session went
out goes to late (`after_close`). The outcome's reward is taken from the ledger's reward spec
(streams/reward.py "Sessions"), and every segment of the session gets the same one.

Protected writes. Under a spec with `protected_paths` each labelled chat turn carries its
`protected_writes` (streams/reward.py "Protected paths"); the session keeps their sum over its
applied turns (stored `pw`; a ledger whose spec protects nothing counts nothing), and the
outcome's reward is the spec's `protected_write` when that sum is above 0, whatever the outcome.
Since it depends on turns that may still come, a segment a break closes while the session is
ending is held too (under such a spec only; without one the outcome's reward is known when it
arrives and such a segment goes out with it at once). The records sent with the outcome carry
the session's count (`protected_writes`) when above 0.

Two clients sharing one session id interleave two histories: each one's turn breaks the
other's segment (`history_rewritten`), and turns of the same number supersede each other, so
the collision shows as many one-turn segments and `superseded` late records.

Version metrics (with `LedgerMetrics`; the streams worker's session stage passes them, `flywheel
streams relabel` does not). Each applied turn adds to its session's tallies (turns, completion
tokens, turns with a tool error) and sets the session's version to its own. A session that ends
(`_end`, `end_session`) with an outcome and at least one applied turn is counted once, in the
bucket of the time it ended (the record that ended it, or the due time when time did: a replay
counts it in the same bucket), and the bucket is stored in the session (`mb`). When the ledger's
time passes a bucket's end, the bucket's sums per version (`session_sums` over the sessions that
hold it) go out as partials of stage "sessions" (`Emit` topic `partials`, key the version), and a
marker (`LedgerMetrics.markers`) records that they did and how many sessions they counted: a
partial sent again is the same sums (the merger replaces it), a session that ends into a sent
bucket sends it again. docs/STREAMS.md "Version metrics".

State, per session id, one JSON value in `sessions` (a changelogged table in a worker), read
and written through `Session.from_stored`/`to_stored` on every change; the heaps and the set of
open sessions are derived from it (rebuilt at construction), so a ledger built on a restored
table continues exactly where the last write left it. Counters (`counts`) are not state.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.contracts.rollouts import SESSION_SUM_FIELDS, add_sums, empty_sums, session_sums
from app.contracts.topics import KAFKA_DERIVED_MAX_MESSAGE_BYTES
from streams.labels import BucketMarker, bucket_of, partial_record
from streams.reward import RewardSpec, outcome_value
from streams.segments import Segment, as_rollout, extension, record_size, segment_record

CloseReason = Literal[
    "history_rewritten",
    "tools_changed",
    "version_tokenizer_changed",
    "idle",
    "end",
    "max_turns",
    "max_tokens",
    "max_bytes",
    "open_sessions",
    "not_a_chat_turn",
]
OpenReason = Literal["session_start"] | CloseReason
LateReason = Literal["after_close", "superseded", "session_ended", "outcome_repeated"]


class LedgerConfig(BaseModel):
    """Settings of the ledger."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idle_s: float = Field(
        300.0,
        gt=0,
        description="A segment closes this long after its session's last turn; "
        "a turn that came early waits this long for the turns before it.",
    )
    retention_s: float = Field(
        3600.0,
        gt=0,
        description="How long a session without an open segment is remembered "
        "after its last turn or its end (duplicates dropped, late turns routed).",
    )
    max_turns: int = Field(64, ge=1, description="Turns per segment.")
    max_tokens: int = Field(
        32768, ge=1, description="Prompt and completion tokens per segment (the model's context)."
    )
    max_bytes: int = Field(
        3 << 20,
        ge=64 << 10,
        le=KAFKA_DERIVED_MAX_MESSAGE_BYTES - (64 << 10),
        description="An upper bound of a segment's record (and stored state) in bytes: a turn "
        "that would take it past this closes it (max_bytes); below the rollouts topic's and the "
        "sessions changelog's record limit.",
    )
    max_open_sessions: int = Field(
        10_000, ge=1, description="Sessions with an open segment or waiting turns, per ledger."
    )
    eos_ids: dict[str, list[int]] = Field(
        default_factory=lambda: {"byte-v1": [257]},
        description="End-of-sequence ids per tokenizer name: a completion's final one of these "
        "may be missing from the next turn's prompt (the streams role loads no tokenizer).",
    )

    @model_validator(mode="after")
    def _retention_covers_idle(self) -> LedgerConfig:
        if self.retention_s < self.idle_s:
            raise ValueError(
                f"retention_s {self.retention_s} is shorter than idle_s {self.idle_s}: a closed "
                "segment's session must be remembered at least as long as a segment waits"
            )
        return self


@dataclass(frozen=True)
class Emit:
    """One output: `topic` rollouts | late | partials. A rollout says why its segment opened and
    closed; a partial (keyed by model_version) is a bucket's session sums (`LedgerMetrics`)."""

    topic: str
    key: str
    value: dict[str, Any]
    opened_by: str | None = None  # OpenReason
    closed_by: str | None = None  # CloseReason


@dataclass(frozen=True)
class LedgerMetrics:
    """Where a ledger counts its sessions' ends for the canary (docs/STREAMS.md "Version metrics"):
    version-metrics buckets of `bucket_s` seconds (the aggregate stage's grid), sent as partials of
    turns partition `partition` under `reward_spec`; `markers` is a mapping the ledger owns (keys
    `repr(bucket start)`, values a `BucketMarker`'s stored form plus `"n"`: the sessions the
    partial counted) that records which buckets' partials went out."""

    bucket_s: float
    partition: int
    reward_spec: str
    markers: MutableMapping[str, dict]


@dataclass(slots=True)
class Waiting:
    """A turn waiting for the turns before it (stored `{"at", "rec"}`)."""

    arrived_at: float  # "at"
    record: dict[str, Any]  # "rec": the input record

    @property
    def order(self) -> tuple[int, str, str]:
        r = self.record
        return r["turn"], r["generated_at"], r["request_id"]


@dataclass(slots=True, frozen=True)
class Outcome:
    """A session's `session_outcome` event (stored `{"o", "rid", "eid", "at"}`)."""

    outcome: str  # "o": success | failure | abandoned
    request_id: str  # "rid": the session's last generation, named by the event
    event_id: str  # "eid"
    at: float  # "at": when it arrived

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> Outcome:
        return cls(stored["o"], stored["rid"], stored["eid"], stored["at"])

    def to_stored(self) -> dict[str, Any]:
        return {"o": self.outcome, "rid": self.request_id, "eid": self.event_id, "at": self.at}


@dataclass(slots=True)
class Session:
    """The ledger state of one session id (stored with the short keys named beside each field).

    A value: each change builds the next one with `dataclasses.replace`."""

    seen: tuple[str, ...]  # "seen": request_ids of its chat turns (dedupe), in arrival order
    applied: int | None  # "ap": the highest turn applied (None: none yet)
    last_at: float  # "at": when its last accepted turn arrived (or it was created)
    segment: Segment | None = None  # "seg": the open segment
    waiting: tuple[Waiting, ...] = ()  # "w": turns waiting for earlier ones, in order
    last_close: CloseReason | None = None  # "lc": why its last segment closed
    ended_at: float | None = None  # "end": when its outcome (or `end_session`) ended it
    outcome: Outcome | None = None  # "oc": its session_outcome event, once one arrived
    held: tuple[dict[str, Any], ...] = ()  # "h": segments' records held for the outcome
    last_generated: str | None = None  # "ag": the latest generated_at of its applied turns
    version: str | None = None  # "sv": the model_version that served its last applied turn
    # "sn": its applied turns, the completion tokens they sampled, the turns with a tool error
    tally: tuple[int, int, int] = (0, 0, 0)
    bucket: float | None = None  # "mb": the version-metrics bucket its end was counted in
    # "pw": the calls of its applied turns that wrote a protected path (each turn's
    # `protected_writes`, labelled under a spec with protected paths); stored only above 0
    protected_writes: int = 0

    @property
    def ending(self) -> bool:
        """Its outcome arrived and it waits for the turn the outcome names."""
        return self.outcome is not None and self.ended_at is None

    @property
    def open(self) -> bool:
        """Counts against `max_open_sessions`: an open segment, waiting turns or a pending end."""
        return self.segment is not None or bool(self.waiting) or self.ending or bool(self.held)

    def due(self, cfg: LedgerConfig) -> float:
        """When time next acts on it: flush waiting turns, close idle, end it, or forget it."""
        due = []
        if self.waiting:
            due.append(self.waiting[0].arrived_at + cfg.idle_s)
        if (self.segment is not None or self.held) and not self.ending:  # ending: waits for its end
            due.append(self.last_at + cfg.idle_s)
        if self.ending:
            due.append(self.outcome.at + cfg.idle_s)  # type: ignore[union-attr]
        if due:
            return min(due)
        return (self.ended_at if self.ended_at is not None else self.last_at) + cfg.retention_s

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> Session:
        seg = stored.get("seg")
        return cls(
            tuple(stored["seen"]),
            stored["ap"],
            stored["at"],
            Segment.from_stored(seg) if seg is not None else None,
            tuple(Waiting(w["at"], w["rec"]) for w in stored.get("w", ())),
            stored.get("lc"),
            stored.get("end"),
            Outcome.from_stored(stored["oc"]) if "oc" in stored else None,
            tuple(stored.get("h", ())),
            stored.get("ag"),
            stored.get("sv"),
            tuple(stored["sn"]) if "sn" in stored else (0, 0, 0),  # type: ignore[arg-type]
            stored.get("mb"),
            stored.get("pw", 0),
        )

    def to_stored(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seen": list(self.seen), "ap": self.applied, "at": self.last_at}
        if self.segment is not None:
            out["seg"] = self.segment.to_stored()
        if self.waiting:
            out["w"] = [{"at": w.arrived_at, "rec": w.record} for w in self.waiting]
        if self.last_close is not None:
            out["lc"] = self.last_close
        if self.ended_at is not None:
            out["end"] = self.ended_at
        if self.outcome is not None:
            out["oc"] = self.outcome.to_stored()
        if self.held:
            out["h"] = list(self.held)
        if self.last_generated is not None:
            out["ag"] = self.last_generated
        if self.version is not None:
            out["sv"] = self.version
        if self.tally != (0, 0, 0):
            out["sn"] = list(self.tally)
        if self.bucket is not None:
            out["mb"] = self.bucket
        if self.protected_writes:
            out["pw"] = self.protected_writes
        return out


BREAKS = frozenset(
    (
        "history_rewritten",
        "tools_changed",
        "version_tokenizer_changed",
        "max_turns",
        "max_tokens",
        "max_bytes",
    )
)  # closes after which the session goes on: their segments wait for its outcome


def state_bytes(sess: Session) -> int:
    """An upper bound of `sess`'s stored JSON (streams/segments.py `record_size`)."""
    n = 512 + len(sess.version or "") + sum(len(rid) + 4 for rid in sess.seen)
    n += sum(record_size(w.record) for w in sess.waiting) + sum(map(record_size, sess.held))
    return n + (sess.segment.size if sess.segment is not None else 0)


def with_outcome(
    record: dict[str, Any], outcome: str | None, value: float | None, protected_writes: int = 0
) -> dict[str, Any]:
    """A held segment's record with the session's outcome and, when above 0, the session's count
    of protected writes (which decided `value`); unchanged without an outcome."""
    if outcome is None or "outcome" in record:
        return record
    reward = record["reward"] + value if value is not None else record["reward"]
    out = {k: v for k, v in record.items() if k != "protected_writes"}  # re-added last below
    out.update(reward=reward, outcome=outcome, outcome_reward=value)
    if protected_writes > 0:
        out["protected_writes"] = protected_writes
    return out


def _emit(record: dict[str, Any]) -> Emit:
    return Emit(
        "rollouts",
        record["request_id"],
        record,
        record["segment_opened_by"],
        record["segment_closed_by"],
    )


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat().replace("+00:00", "Z")


class Ledger:
    """Session segmentation over the `sessions` mapping. Not thread-safe: one agent drives it."""

    def __init__(
        self,
        cfg: LedgerConfig,
        sessions: MutableMapping[str, dict],
        spec: RewardSpec | None = None,
        metrics: LedgerMetrics | None = None,
    ):
        self.cfg, self.sessions, self.spec, self.metrics = cfg, sessions, spec, metrics
        self.counts: Counter[str] = Counter()
        self._wm = -math.inf
        self._due: list[tuple[float, str]] = []  # (due, session id); stale entries skipped
        self._lru: list[tuple[float, str]] = []  # (last_at, session id) of open sessions
        self._open: set[str] = set()
        self._counted: dict[float, set[str]] = {}  # bucket start -> sessions counted in it
        self._dirty: set[float] = set()  # buckets counted into since their partial went out
        self._markers: list[tuple[float, str]] = []  # (forget at, marker key); stale skipped
        for sid, stored in list(sessions.items()):
            sess = Session.from_stored(stored)
            self._index(sid, sess)
            if sess.bucket is not None:
                self._counted.setdefault(sess.bucket, set()).add(sid)
        if metrics is not None:
            assert cfg.retention_s >= metrics.bucket_s, (
                f"retention_s {cfg.retention_s} must cover a metrics bucket ({metrics.bucket_s}s): "
                "a counted session is remembered until its bucket's partial went out"
            )
            for key, stored in list(metrics.markers.items()):
                marker = BucketMarker.from_stored(stored)
                if marker is not None:
                    heapq.heappush(self._markers, (marker.forget_at, key))
            # a bucket is due again when it holds more sessions than its partial counted: never
            # sent, or a session ended into it after it went out (forgetting only removes sessions)
            self._dirty = {
                b
                for b, sids in self._counted.items()
                if len(sids) > (metrics.markers.get(repr(b)) or {}).get("n", -1)
            }

    # --- state ---------------------------------------------------------------------------------
    def session(self, sid: str) -> Session | None:
        stored = self.sessions.get(sid)
        return Session.from_stored(stored) if stored else None

    def _index(self, sid: str, sess: Session) -> None:
        heapq.heappush(self._due, (sess.due(self.cfg), sid))
        if sess.open:
            self._open.add(sid)
            heapq.heappush(self._lru, (sess.last_at, sid))
        else:
            self._open.discard(sid)

    def _put(self, sid: str, sess: Session) -> None:
        self.sessions[sid] = sess.to_stored()
        self._index(sid, sess)

    @property
    def open_sessions(self) -> int:
        return len(self._open)

    # --- inputs --------------------------------------------------------------------------------
    def on_rollout(self, rec: dict[str, Any], now: float) -> list[Emit]:
        """Apply one labelled turn (a rollout record with `turn` and `tools_digest` beside)."""
        out = self.advance(now)
        if rec.get("turn") is None:
            self.counts["opened.not_a_chat_turn"] += 1
            self.counts["closed.not_a_chat_turn"] += 1
            rollout = as_rollout(rec)
            out.append(
                Emit(
                    "rollouts", rollout["request_id"], rollout, "not_a_chat_turn", "not_a_chat_turn"
                )
            )
            return out
        sid, rid = rec["session_id"], rec["request_id"]
        sess = self.session(sid) or Session((), None, now)
        if rid in sess.seen:
            self.counts["duplicates"] += 1
            return out
        # the most recent request_ids only: an older one again is judged by its turn (late)
        sess = replace(sess, seen=(*sess.seen, rid)[-4 * self.cfg.max_turns :])
        late = self._late_reason(sess, rec)
        if late is not None:
            out.append(self._late(late, rec, now))
        else:
            sess = self._accept(sess, rec, now, out)
        if sess.ending and self._has_applied(sess, sess.outcome.request_id):  # type: ignore[union-attr]
            sess = self._end(sid, sess, now, out)
        self._put(sid, self._shed(sess, now, out))
        out += self._evict(keep=sid, now=now)
        return out

    def _shed(self, sess: Session, now: float, out: list[Emit]) -> Session:
        """`sess` within `max_bytes` of stored state: past it, its waiting turns are applied (gaps
        and all), then its held records go out without the outcome, oldest first
        (`held_released`), then its open segment closes (`max_bytes`) and held records go out
        again until it fits."""
        cap = self.cfg.max_bytes
        if state_bytes(sess) <= cap:
            return sess
        if sess.waiting:
            self.counts["shed.waiting"] += 1
            sess = self._flush(sess, now, out)
        sess = self._release_held(sess, cap, out)
        if sess.segment is not None and state_bytes(sess) > cap:
            sess = self._release_held(self._close(sess, "max_bytes", out), cap, out)
        return sess

    def _release_held(self, sess: Session, cap: int, out: list[Emit]) -> Session:
        """`sess` less its oldest held records, sent without the outcome, until it is within `cap`."""
        while sess.held and state_bytes(sess) > cap:
            self.counts["held_released"] += 1
            out.append(_emit(sess.held[0]))
            sess = replace(sess, held=sess.held[1:])
        return sess

    def on_outcome(self, ev: dict[str, Any], now: float) -> list[Emit]:
        """Apply a session's `session_outcome` event: the session ends (its segment closes with
        `end` and carries the outcome) once the turn the event names is applied, or `idle_s` after
        the event if that turn never comes. A second outcome of a session goes to late
        (`outcome_repeated`); the same event again is a duplicate."""
        out = self.advance(now)
        sid = ev["session_id"]
        sess = self.session(sid) or Session((), None, now)
        if sess.outcome is not None:
            if sess.outcome.event_id == ev["event_id"]:
                self.counts["duplicates"] += 1
            else:
                out.append(self._late("outcome_repeated", ev, now))
            return out
        if sess.ended_at is not None:
            out.append(self._late("session_ended", ev, now))
            return out
        self.counts["outcomes"] += 1
        sess = replace(sess, outcome=Outcome(ev["outcome"], ev["request_id"], ev["event_id"], now))
        if self._has_applied(sess, ev["request_id"]):
            sess = self._end(sid, sess, now, out)
        self._put(sid, sess)
        out += self._evict(keep=sid, now=now)
        return out

    def _has_applied(self, sess: Session, rid: str) -> bool:
        return rid in sess.seen and all(w.record["request_id"] != rid for w in sess.waiting)

    def _end(
        self, sid: str, sess: Session, now: float, out: list[Emit], at: float | None = None
    ) -> Session:
        """Flush, close (`end`) and end `sess`, and count it (`_count`) in the bucket of `at` (the
        time it ended by: `now`, or the due time that ended it in `advance`). An outcome that
        reaches no open segment (the session's segments closed before it came) goes to late
        (`after_close`); the session is still counted: its outcome is known, and so is the version
        that served its last turn."""
        sess = self._flush(sess, now, out)
        if sess.segment is not None or sess.held:
            sess = self._close(sess, "end", out)
        elif sess.outcome is not None:
            o = sess.outcome
            ev = {"type": "session_outcome", "outcome": o.outcome, "request_id": o.request_id}
            out.append(self._late("after_close", {**ev, "event_id": o.event_id}, now))
        return self._count(sid, replace(sess, ended_at=now), now if at is None else at)

    def end_session(self, sid: str, now: float) -> list[Emit]:
        """The client ended session `sid`: its waiting turns are applied, its segment closes
        (`end`), and later turns of it go to late (`session_ended`) until `retention_s` passes.
        Counted (`_count`) when its outcome had arrived."""
        out = self.advance(now)
        sess = self.session(sid) or Session((), None, now)
        if sess.ended_at is None:
            sess = self._close(self._flush(sess, now, out), "end", out)
            self._put(sid, self._count(sid, replace(sess, ended_at=now), now))
        return out

    def advance(self, now: float) -> list[Emit]:
        """Move time to `now` (never back) and act on every session due by then."""
        if now <= self._wm:
            return []
        self._wm = now
        out: list[Emit] = []
        while self._due and self._due[0][0] <= now:
            due, sid = heapq.heappop(self._due)
            sess = self.session(sid)
            if sess is None or sess.due(self.cfg) != due:
                continue  # stale entry: the session moved on
            if sess.ending and sess.outcome.at + self.cfg.idle_s <= now:  # type: ignore[union-attr]
                self._put(sid, self._end(sid, sess, now, out, due))  # the named turn never came
            elif sess.open:
                sess = self._flush(sess, now, out)
                if sess.ending and self._has_applied(sess, sess.outcome.request_id):  # type: ignore[union-attr]
                    sess = self._end(sid, sess, now, out, due)
                elif (
                    (sess.segment is not None or sess.held)
                    and not sess.ending
                    and sess.last_at + self.cfg.idle_s <= now
                ):
                    sess = self._close(sess, "idle", out)
                self._put(sid, sess)
            else:
                out += self._uncount(sid, sess)
                del self.sessions[sid]
                self._open.discard(sid)
        return out + self._emit_buckets(now)

    # --- turns ---------------------------------------------------------------------------------
    def _late_reason(self, sess: Session, rec: dict[str, Any]) -> LateReason | None:
        turn = rec["turn"]
        if sess.ended_at is not None:
            return "session_ended"
        if sess.applied is None or turn > sess.applied:
            return None
        if sess.last_generated is not None and rec["generated_at"] > sess.last_generated:
            return None  # a later call on a shorter history (compacted): it breaks the segment
        seg = sess.segment
        return "superseded" if seg is not None and turn >= seg.parts[0].turn else "after_close"

    def _accept(self, sess: Session, rec: dict[str, Any], now: float, out: list[Emit]) -> Session:
        """Apply `rec` (and the waiting turns it lets through) or make it wait."""
        turn = rec["turn"]
        sess = replace(sess, last_at=now)
        expected = 0 if sess.applied is None else sess.applied + 1
        if turn > expected:
            waiting = tuple(sorted((*sess.waiting, Waiting(now, rec)), key=lambda w: w.order))
            sess = replace(sess, waiting=waiting)
            return self._flush(sess, now, out) if len(waiting) > self.cfg.max_turns else sess
        sess = self._apply(sess, rec, out)
        while sess.waiting and sess.waiting[0].record["turn"] <= sess.applied + 1:
            sess = self._apply_waiting(sess, now, out)
        return sess

    def _flush(self, sess: Session, now: float, out: list[Emit]) -> Session:
        """Apply every waiting turn in order, gaps and all."""
        while sess.waiting:
            sess = self._apply_waiting(sess, now, out)
        return sess

    def _apply_waiting(self, sess: Session, now: float, out: list[Emit]) -> Session:
        first, rest = sess.waiting[0], sess.waiting[1:]
        sess = replace(sess, waiting=rest)
        late = self._late_reason(sess, first.record)
        if late is not None:  # a second turn of the number just applied
            out.append(self._late(late, first.record, now))
            return sess
        return self._apply(sess, first.record, out)

    def _apply(self, sess: Session, rec: dict[str, Any], out: list[Emit]) -> Session:
        """Extend the open segment with `rec`, or close it and open one with `rec`."""
        cfg, seg = self.cfg, sess.segment
        if seg is None:
            seg = Segment.start(rec, sess.last_close or "session_start")
            self.counts[f"opened.{seg.opened_by}"] += 1
        else:
            eos = cfg.eos_ids.get(rec.get("tokenizer") or "", [])
            broken, drop_eos = extension(seg, rec, eos, cfg.max_tokens, cfg.max_bytes)
            if broken is not None:
                sess = self._close(sess, broken, out)
                seg = Segment.start(rec, broken)
                self.counts[f"opened.{broken}"] += 1
            else:
                self.counts["eos_dropped"] += int(drop_eos)
                seg = seg.extended(rec, drop_eos)
        last = max(sess.last_generated or "", rec["generated_at"])
        turns, tokens, errors = sess.tally
        tally = (
            turns + 1,
            tokens + len(rec["completion_tokens"]),
            errors + (1 if rec.get("tool_errors") else 0),
        )
        sess = replace(
            sess,
            applied=rec["turn"],
            segment=seg,
            last_generated=last,
            version=rec["model_version"],
            tally=tally,
            protected_writes=sess.protected_writes + self._writes(rec),
        )
        if len(seg.parts) >= cfg.max_turns:
            return self._close(sess, "max_turns", out)
        if seg.length >= cfg.max_tokens:
            return self._close(sess, "max_tokens", out)
        return sess

    def _close(self, sess: Session, reason: CloseReason, out: list[Emit]) -> Session:
        """`sess` with its open segment (if any) closed for `reason`. A segment a break closes
        (`BREAKS`) before the session's outcome is known is held in the session (at most
        `max_turns` of them; past that the oldest goes out without the outcome); under a spec
        with protected paths also while the session is ending (its outcome is in, the turn it
        names is not): the outcome's value depends on every turn the session applies, so each
        segment gets it at the end. Any other close sends the held records, with the outcome when
        it is known, then its own."""
        seg = sess.segment
        held = sess.held
        if seg is not None:
            self.counts[f"closed.{reason}"] += 1
            hold = reason in BREAKS and (sess.outcome is None or (sess.ending and self._protects))
            outcome, value = (None, None) if hold else self._outcome(sess)
            record = segment_record(seg, reason, outcome, value, sess.protected_writes)
            sess = replace(sess, segment=None, last_close=reason)
            if hold:
                held = (*held, record)
                if len(held) > self.cfg.max_turns:
                    self.counts["held_released"] += 1
                    out.append(_emit(held[0]))
                    held = held[1:]
                return replace(sess, held=held)
            held = (*held, record)
        elif reason in BREAKS:
            return sess
        outcome, value = self._outcome(sess)
        out += [_emit(with_outcome(r, outcome, value, sess.protected_writes)) for r in held]
        return replace(sess, held=())

    @property
    def _protects(self) -> bool:
        """The ledger's spec protects paths (its outcome values depend on the turns' writes)."""
        return self.spec is not None and self.spec.weights.protected_paths is not None

    def _writes(self, rec: dict[str, Any]) -> int:
        """A turn's protected writes as labelled, counted only under a spec that protects paths
        (a turn labelled under another spec, in flight across a change of spec, counts nothing)."""
        return int(rec.get("protected_writes") or 0) if self._protects else 0

    def _outcome(self, sess: Session) -> tuple[str | None, float | None]:
        """The session's outcome, if known, and its reward under the ledger's spec: the spec's
        `protected_write` when the session's applied turns wrote a protected path, else the
        outcome's weight (`streams.reward.outcome_value`)."""
        if sess.outcome is None:
            return None, None
        value = (
            outcome_value(self.spec, sess.outcome.outcome, sess.protected_writes)
            if self.spec is not None
            else None
        )
        return sess.outcome.outcome, value

    def _evict(self, keep: str, now: float) -> list[Emit]:
        """Close the least recently active sessions while more than `max_open_sessions` are open."""
        out: list[Emit] = []
        kept: list[tuple[float, str]] = []
        while len(self._open) > self.cfg.max_open_sessions and self._lru:
            last_at, sid = heapq.heappop(self._lru)
            sess = self.session(sid)
            if sess is None or not sess.open or sess.last_at != last_at:
                continue  # stale entry: the session moved on
            if sid == keep:
                kept.append((last_at, sid))
                continue
            if sess.ending:  # its outcome is in: it ends now, without the turn it names
                sess = self._end(sid, sess, now, out)
            else:
                sess = self._close(self._flush(sess, now, out), "open_sessions", out)
            self._put(sid, sess)
        for entry in kept:
            heapq.heappush(self._lru, entry)
        return out

    # --- version metrics ---------------------------------------------------------------------------
    def _count(self, sid: str, sess: Session, at: float) -> Session:
        """`sess`, which just ended, counted in the version-metrics bucket of `at` when it ended
        with an outcome and served at least one turn; once per session (its stored `bucket` says
        it was). Its sums (`session_sums`: outcome, turns, tokens, tool-error turns) go out in the
        bucket's partial once the ledger's time passes the bucket's end (`_emit_buckets`)."""
        m = self.metrics
        if m is None or sess.outcome is None or sess.version is None or sess.bucket is not None:
            return sess
        b = bucket_of(at, m.bucket_s)
        self._counted.setdefault(b, set()).add(sid)
        self._dirty.add(b)
        self.counts["sessions_counted"] += 1
        return replace(sess, bucket=b)

    def _uncount(self, sid: str, sess: Session) -> list[Emit]:
        """`sess` is forgotten: its bucket's partial goes out first if it has not yet (it is due:
        a session is kept `retention_s` >= one bucket after its end), then the session leaves the
        bucket's index. (A session that ends later into a bucket whose sessions are all forgotten
        would send a partial without them: it would have to arrive `retention_s` behind the ledger's
        time.)"""
        b = sess.bucket
        if b is None or self.metrics is None:
            return []
        out = self._emit_bucket(b) if b in self._dirty else []
        sids = self._counted.get(b)
        if sids is not None:
            sids.discard(sid)
            if not sids:
                del self._counted[b]
        return out

    def _emit_buckets(self, now: float) -> list[Emit]:
        """The partials of every bucket counted into that ended at or before `now`, then the
        markers past their time forgotten. Normally once per bucket; a session counted into a
        bucket whose partial already went out (its end time behind the ledger's) sends the
        bucket's whole partial again, which replaces the earlier one in the merger."""
        m = self.metrics
        if m is None:
            return []
        out: list[Emit] = []
        for b in sorted(b for b in self._dirty if b + m.bucket_s <= now):
            out += self._emit_bucket(b)
        while self._markers and self._markers[0][0] <= now:
            dl, key = heapq.heappop(self._markers)
            marker = BucketMarker.from_stored(m.markers.get(key))
            if marker is not None and marker.forget_at == dl:  # else rewritten later: stale entry
                del m.markers[key]
        return out

    def _emit_bucket(self, b: float) -> list[Emit]:
        """Bucket `b`'s partials (one per version: the sums of every session counted in it that the
        ledger still holds) and its marker, kept until every one of those sessions is forgotten."""
        m = self.metrics
        assert m is not None
        self._dirty.discard(b)
        per_version: dict[str, dict[str, float]] = {}
        forget, counted = b + m.bucket_s, 0
        for sid in sorted(self._counted.get(b, ())):
            sess = self.session(sid)
            if sess is None or sess.bucket != b or sess.outcome is None or sess.version is None:
                continue  # a stale index entry (a failed apply): the stored session rules
            sums = session_sums(sess.outcome.outcome, *sess.tally)
            add_sums(per_version.setdefault(sess.version, empty_sums(SESSION_SUM_FIELDS)), sums)
            forget = max(forget, sess.ended_at if sess.ended_at is not None else b)
            counted += 1
        if not per_version:
            return []
        marker = BucketMarker(m.partition, forget + self.cfg.retention_s)
        m.markers[repr(b)] = {**marker.to_stored(), "n": counted}
        heapq.heappush(self._markers, (marker.forget_at, repr(b)))
        return [
            Emit(
                "partials",
                version,
                partial_record(
                    version, b, m.bucket_s, m.partition, m.reward_spec, sums, "sessions"
                ),
            )
            for version, sums in sorted(per_version.items())
        ]

    def _late(self, reason: LateReason, rec: dict[str, Any], now: float) -> Emit:
        self.counts[f"late.{reason}"] += 1
        rid = rec["request_id"]
        return Emit(
            "late",
            rid,
            {"reason": reason, "request_id": rid, "event": rec, "detected_at": iso(now)},
        )
