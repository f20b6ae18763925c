"""The worker's second stage: the session ledger over `<ns>.streams-turns` (streams/ledger.py).

    <ns>.interactions ─▶ aggregate ──(chat turns, labelled; session_outcome events)──▶ <ns>.streams-turns
                                                                          (internal, N, key session_id)
    <ns>.streams-turns ───────┐                                ┌─▶ <ns>.rollouts (a segment's record)
                              ├─▶ assemble (concurrency 1) ────┼─▶ <ns>.late     (ledger late reasons)
    <ns>.streams-ledger-ticks ┘   tables: sessions,            └─▶ <ns>.streams-metric-partials
      (internal, N)               session-progress (changelogs)     (ended sessions' sums, stage
                                                                     "sessions"; merged into
                                                                     <ns>.version-metrics)

Why a second topic. Interactions are keyed by request_id, so a session's turns land on many
partitions; the ledger needs all of them in one place, in one order. The aggregate agent
sends each labelled chat turn (a rollout with `turn`) and each `session_outcome` event to
`<ns>.streams-turns` keyed by session_id, with the same at-least-once order as its other
outputs (sent and delivered before the state that reflects them). One-call generations
(no `turn`) go straight to `<ns>.rollouts` as before.

The stage is the aggregate stage's machinery (streams/runtime.py `Runtime`) on another input:
batches (`take_events`), ticks through its own internal topic (only for caught-up
partitions), the state's own input progress (a `session-progress` key per partition, written
after every other state change of a batch), `resume_from_state` on every assignment, the
in-order check that seeks back over gaps, and the same order per batch: (1) outputs sent and
delivered, (2) the `sessions` changelog, then the progress, (3) then Faust acks. A crash in
between replays records the state does not reflect; the ledger ignores a turn it has seen
(request_id) and an outcome it has (event_id), so the replay re-emits identical records
(the rollouts topic is keyed by the segment's first request_id; the trainer dedupes by it).

One `Ledger` per turns partition, over that partition's sessions (table keys
`<partition>|<session id>`, so a partition's sessions are found without a partitioner and
every write lands on the changelog partition of the record that caused it). Time is the
turns records' timestamps and the ticks' wall time minus `skew_margin`; it never goes back.

Version metrics for the canary. A session that ends with an outcome is counted once, in the
version that served its last turn, in the metrics bucket of the time it ended (`Ledger._count`):
the count lives in the session's own stored value (`mb`), written in the same changelog record
as the end, so a replay never counts it again and a crash cannot keep the end and lose the
count. When the ledger's time passes a bucket's end, the bucket's session sums per version go to
`<ns>.streams-metric-partials` as a partial of stage "sessions" and of this turns partition,
recomputed from the sessions that hold the bucket; the aggregate stage's merger
(`MetricsMerger`) replaces that stage's and partition's earlier partial, so a re-sent partial
never double counts, and adds it to the bucket's closed labels in one `<ns>.version-metrics`
record. A marker per emitted bucket (`<p>|<bucket>` in `session-progress`, written with the
progress after the `sessions` changelog) keeps a restarted stage from sending it again; one lost
in a crash only re-sends the same sums.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import faust
import orjson
from prometheus_client import Counter, Gauge

from app.contracts.topics import STREAMS_LEDGER_TICKS, STREAMS_TURNS
from app.settings import Settings
from streams.config import StreamsConfig
from streams.ledger import Emit, Ledger, LedgerConfig, LedgerMetrics
from streams.outbox import Outbox
from streams.reward import RewardSpec
from streams.runtime import OUT, RAW, Runtime, _failure, table_options
from streams.state import BatchedTable

SEGMENTS = Counter(
    "flywheel_streams_segments_total",
    "Session segments sent to <ns>.rollouts, by why they opened and closed",
    ["opened_by", "closed_by"],
)
LEDGER = Counter(
    "flywheel_streams_ledger_events_total",
    "What the session ledger did: duplicates, outcomes, eos_dropped, held_released, "
    "opened.<reason>, closed.<reason>, late.<reason>",
    ["event"],
)
OPEN_SESSIONS = Gauge(
    "flywheel_streams_open_sessions",
    "Sessions with an open segment, waiting turns, held segments or a pending end",
)
TURNS_IN = Counter(
    "flywheel_streams_turn_records_total", "Records the session stage consumed", ["kind"]
)


class PartitionSessions(MutableMapping[str, Any]):
    """One turns partition's keys of a table (keys `<p>|<key>`): its sessions in `sessions`
    (`<p>|<session id>`), its version-metrics bucket markers in `session-progress`
    (`<p>|<bucket start>`, beside the progress keys `offset|<p>`)."""

    def __init__(self, view: BatchedTable, partition: int):
        self.view, self.partition, self.prefix = view, partition, f"{partition}|"

    def __getitem__(self, sid: str) -> Any:
        return self.view[self.prefix + sid]

    def __setitem__(self, sid: str, value: Any) -> None:
        self.view.partition = self.partition
        self.view[self.prefix + sid] = value

    def __delitem__(self, sid: str) -> None:
        self.view.partition = self.partition
        del self.view[self.prefix + sid]

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return (key[n:] for key in self.view if key.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class SessionStage(Runtime):
    """`Runtime` on `<ns>.streams-turns`: the session ledger of each partition the worker owns."""

    ledger_cfg: LedgerConfig = field(default_factory=LedgerConfig)
    spec: RewardSpec | None = None
    ledgers: dict[int, Ledger] = field(default_factory=dict)
    source: Any = None  # the agent's Faust topic (turns + ticks)

    @classmethod
    def build(
        cls,
        app: faust.App,
        settings: Settings,
        cfg: StreamsConfig,
        spec: RewardSpec,
        outbox: Outbox,
        outputs: dict[str, Any],
    ) -> SessionStage:
        """The stage on `app`, writing to the aggregate stage's `outputs` topics (rollouts, late,
        dlq, and the metric partials its merger turns into version-metrics) through the same
        `outbox`."""
        n, ns = settings.interactions_partitions, settings.topic_namespace
        turns, ticks = f"{ns}.{STREAMS_TURNS}", f"{ns}.{STREAMS_LEDGER_TICKS}"
        table = table_options(n)
        sessions = app.Table("sessions", help="'<partition>|<session id>' -> ledger state", **table)
        progress = app.Table(
            "session-progress", help="'offset|<partition>' -> last turns offset reflected", **table
        )
        topics = {name: outputs[name] for name in ("rollouts", "late", "dlq", "partials")}
        topics["ticks"] = app.topic(ticks, partitions=n, **RAW)
        stage = cls(
            settings,
            cfg,
            app,
            None,  # type: ignore[arg-type]  # no aggregator: the ledgers are the state
            None,  # type: ignore[arg-type]
            topics,
            turns,
            ticks,
            {"sessions": BatchedTable(sessions), "buckets": BatchedTable(progress)},
            outbox=outbox,
            ledger_cfg=cfg.ledger(),
            spec=spec,
        )
        stage.source = app.topic(turns, ticks, partitions=n, **RAW)
        return stage

    def ledger(self, p: int) -> Ledger:
        """Partition `p`'s ledger, built from the (recovered) table on first use."""
        led = self.ledgers.get(p)
        if led is None:
            metrics = LedgerMetrics(
                self.cfg.metrics_bucket,
                p,
                self.spec.version if self.spec is not None else "",
                PartitionSessions(self.views["buckets"], p),  # markers beside the progress
            )
            led = self.ledgers[p] = Ledger(
                self.ledger_cfg, PartitionSessions(self.views["sessions"], p), self.spec, metrics
            )
        return led

    def forget_partition(self, p: int) -> None:
        self.ledgers.pop(p, None)

    # --- records -----------------------------------------------------------------------------
    def on_record(self, msg: Any, key: bytes | None, value: bytes | None) -> list[Emit]:
        """Apply one turns record (a labelled chat turn, or a session_outcome event). One the
        ledger cannot apply is dead-lettered (`processing_failed`); it never raises."""
        p = msg.partition
        self.last_processed[p] = msg.offset
        rt = msg.timestamp if msg.timestamp else time.time()
        try:
            obj = orjson.loads(value if value is not None else b"")
            if obj.get("type") == "session_outcome":
                TURNS_IN.labels("outcome").inc()
                return self.ledger(p).on_outcome(obj, rt)
            TURNS_IN.labels("turn").inc()
            return self.ledger(p).on_rollout(obj, rt)
        except Exception as exc:
            TURNS_IN.labels("dlq").inc()
            return [self._dlq(msg, key, value, "processing_failed", [_failure("(ledger)", exc)])]

    def advance(self, p: int, now: float) -> list[Emit]:
        return self.ledger(p).advance(now)

    # --- state and metrics ---------------------------------------------------------------------
    async def persist(self) -> None:
        drained = {name: view.drain() for name, view in self.views.items()}
        await self._send_changelogs(drained, ("sessions",))
        await self._send_changelogs(drained, ("buckets",))  # the progress, last

    def gauges(self) -> None:
        OPEN_SESSIONS.set(sum(led.open_sessions for led in self.ledgers.values()))
        for led in self.ledgers.values():
            for event, k in led.counts.items():
                LEDGER.labels(event).inc(k)
            led.counts.clear()

    def gauge_assigned(self) -> None:
        return None  # the aggregate stage's gauge counts the interactions partitions

    def count(self, e: Emit, now: float) -> None:
        if e.topic == "rollouts":  # the base counts a label's latency, which segments have not
            SEGMENTS.labels(e.opened_by or "", e.closed_by or "").inc()
            OUT.labels("rollouts").inc()
        else:
            super().count(e, now)
