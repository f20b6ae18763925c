"""The Faust app of `flywheel streams`: one agent joins interactions into reward-labelled rollouts;
a second (`assemble`, streams/session_stage.py) assembles agent sessions' chat turns into one
rollout per segment.

Topology (N = partitions of `<ns>.interactions`):

    <ns>.interactions ─┐                                  ┌─▶ <ns>.rollouts      (key request_id)
                       ├─▶ aggregate (concurrency 1) ──────┼─▶ <ns>.late          (key request_id)
    <ns>.streams-ticks ┘    tables: labels, generations,   ├─▶ <ns>.dlq           (no key)
      (internal, N)         buckets (changelogs)           └─▶ <ns>.streams-metric-partials (key model_version)
                                                                   │
    <ns>.streams-metric-partials ─▶ merge_metrics (table: metric_buckets) ─▶ <ns>.version-metrics

A labelled chat turn (a rollout with `turn`) and a `session_outcome` event go to
`<ns>.streams-turns` (key session_id) instead, for the session stage (its docstring), which
sends the sums of the sessions that ended with an outcome to `<ns>.streams-metric-partials`
too: `merge_metrics` adds them to the same version-metrics records.

Why ticks go through a topic: Faust tables may only be changed inside a stream event (the
changelog partition is the event's partition), and a single consumer of both topics keeps
event handling and expiry strictly serial. A timer on each worker sends one tick per
assigned interactions partition to the same partition of the ticks topic, carrying the
wall time and the partition's end offset. The agent advances that partition's watermark
to `now - skew_margin` only when its state reflects every record below that end offset
(its progress, see below), so labels close on record time even after a restart
with a backlog (see streams/labels.py). No windowed tables, no on_window_close. (The
write-back views below name the changelog partition explicitly, so a timer could write
the tables directly; the tick record is kept because Faust delivers it only after table
recovery on a rebalance and in order with the records, which a timer would have to
re-create.) A partition whose last fetch already showed unprocessed records gets no
tick: it would be refused.

Batches. The agent takes up to `batch_max_events` records at a time
(`stream.take_events`, `batch_within` seconds at most) and runs the join over them in
plain Python; the tables are read and written through `BatchedTable` views
(streams/state.py), so each touched key costs one changelog record per batch instead of
one per event. Outputs and changelog records go out as whole record batches through
streams/outbox.py (its own idempotent aiokafka producer, `send_batch`), not Faust's
per-message producer path.

At-least-once, in this order per batch: (1) the batch's outputs (rollouts, late, DLQ,
metric partials) are sent and their delivery awaited; (2a) then the changelog records of
`labels` and `generations` (a closed label's generation is deleted one batch later, once
the closed label is on the changelog); (2b) then `buckets`, whose last record per input
partition is the batch's **progress**: the offset of the last interactions record the
state now reflects; (3) only then does Faust ack the batch's records.

The state carries its own input position. After table recovery and before Faust seeks to
the group's committed offsets, `resume_from_state` commits progress + 1 for every assigned
partition, so a restarted (or reassigned) worker resumes exactly where its recovered state
ends, whatever Faust's periodic commit had reached: never past a record the state has not
seen, and without replaying records it already holds. A crash inside a batch leaves the
progress of the batch before it; the records are replayed, re-emitting identical outputs
(consumers dedupe by request_id), the join dedupes replayed events by event_id, a
replayed generation restores a payload whose changelog record did not make it, and
re-closing a label yields the same rollout. Never a label marked closed whose rollout was
lost. `flywheel_streams_resume_corrections_total{direction}` counts resumes where the group
disagreed with the state (`group_ahead` would have skipped records).

    from streams.app import build_app
    app, runtime = build_app(settings, StreamsConfig())
"""

from __future__ import annotations

import logging
import time
from typing import Any

import faust
from faust.sensors import Monitor
from mode.supervisors import CrashingSupervisor

from app.contracts.topics import (
    KAFKA_DERIVED_MAX_MESSAGE_BYTES,
    STREAMS_INTERNAL_SPECS,
    STREAMS_METRIC_PARTIALS,
    STREAMS_TICKS,
    STREAMS_TURNS,
    topic_partitions,
)
from app.infra.kafka import FAUST_PRODUCER_OPTIONS
from app.settings import Settings
from streams.config import StreamsConfig
from streams.consumer import install as install_eager_drain
from streams.labels import Aggregator, MetricsMerger
from streams.outbox import KafkaOutbox
from streams.runtime import RAW, Runtime, table_options
from streams.session_stage import SessionStage
from streams.state import BatchedTable

log = logging.getLogger(__name__)

TABLES = (
    "labels",
    "generations",
    "buckets",
    "metric-buckets",
    "sessions",
    "session-progress",
)  # the Faust tables build_app declares (the last two: streams/session_stage.py)


def app_id(settings: Settings, cfg: StreamsConfig | None = None) -> str:
    return (cfg.app_id if cfg is not None else None) or f"{settings.topic_namespace}-streams"


def internal_topics(
    settings: Settings, cfg: StreamsConfig | None = None
) -> dict[str, tuple[int, dict[str, str]]]:
    """Internal topics the worker needs: name -> (partitions, configs), the tables' changelogs included.

    Faust would declare the changelogs itself on start, but on a fresh cluster its metadata
    refresh can race the creation ("changelog topic has 0 partitions"), which crashes an agent
    and leaves the worker half-alive; creating them up front and waiting for them avoids that.
    """
    ns, n = settings.topic_namespace, settings.interactions_partitions
    topics = {
        f"{ns}.{t.name}": (topic_partitions(settings, t.name), dict(t.config))
        for t in STREAMS_INTERNAL_SPECS
    }
    # a table value can be as large as a record it derives from (a generation, a session's segment)
    changelog = {
        "cleanup.policy": "compact",
        "max.message.bytes": str(KAFKA_DERIVED_MAX_MESSAGE_BYTES),
    }
    for table in TABLES:
        topics[f"{app_id(settings, cfg)}-{table}-changelog"] = (n, dict(changelog))
    return topics


def ensure_internal_topics(
    settings: Settings, cfg: StreamsConfig | None = None, timeout_s: float = 120.0
) -> None:
    """Create the contract topics and the internal ones (idempotent), and wait until the broker
    reports every one of them with its partitions."""

    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    from app.infra.broker import ensure_topics

    ensure_topics(settings)  # also installs the bounded kafka-python wait (app/infra/kafka_net.py)
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap.split(","))
    try:
        wanted = internal_topics(settings, cfg)
        existing = set(admin.list_topics())
        new = [
            NewTopic(
                name,
                num_partitions=n,
                replication_factor=settings.replication_factor,
                topic_configs=conf,
            )
            for name, (n, conf) in wanted.items()
            if name not in existing
        ]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
        created = {t.name for t in new}
        deadline = time.monotonic() + timeout_s
        while True:
            described = {
                t["name"]: len(t.get("partitions") or [])
                for t in admin.describe_topics(list(wanted))
                if not t.get("error_code")
            }
            _refuse_misshapen(wanted, described, created)
            missing = {name: n for name, (n, _) in wanted.items() if described.get(name, 0) < n}
            if not missing:
                return
            assert time.monotonic() < deadline, (
                f"internal topics not ready after {timeout_s:.0f}s: {missing}"
            )
            time.sleep(0.5)
    finally:
        admin.close()


class MisshapenTopic(RuntimeError):
    """An internal topic the worker did not create exists with other partitions than it needs."""


def _refuse_misshapen(
    wanted: dict[str, tuple[int, dict[str, str]]], described: dict[str, int], created: set[str]
) -> None:
    """A topic that already existed with a partition count other than the one the worker needs
    never gets it (Kafka does not repartition): fail at once, naming it, instead of waiting.
    A producer or consumer that asks a broker with `auto.create.topics.enable` for a topic that
    does not exist yet creates it with the broker's `num.partitions`."""
    wrong = {
        name: (described[name], n)
        for name, (n, _) in wanted.items()
        if name not in created and described.get(name, n) != n
    }
    if wrong:
        raise MisshapenTopic(
            "; ".join(
                f"topic {name} has {have} partition(s), the streams worker needs {need}"
                for name, (have, need) in sorted(wrong.items())
            )
            + ": it was created by something else (a client asking a broker that auto-creates "
            "topics for it, with the broker's num.partitions); delete it, or create it with "
            "that many partitions, and start the worker again"
        )


class LeanMonitor(Monitor):
    """Faust's monitor without its per-record bookkeeping (counters by stream and task, timestamps
    on every message and event, kept for Faust's web views, which this worker disables): four
    calls per record on the hot path. The worker's own Prometheus metrics cover what they would
    show; commits, rebalances and table calls are still tracked by the base Monitor."""

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        self.messages_received_total += 1

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        return None

    def on_stream_event_out(
        self, tp: Any, offset: int, stream: Any, event: Any, state: Any = None
    ) -> None:
        return None

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        return None


def build_app(settings: Settings, cfg: StreamsConfig) -> tuple[faust.App, Runtime]:
    """A Faust app for `settings` (one per process; tests build their own)."""
    n = settings.interactions_partitions
    ns = settings.topic_namespace
    app = faust.App(
        app_id(settings, cfg),
        broker=[f"kafka://{h.strip()}" for h in settings.kafka_bootstrap.split(",")],
        store=cfg.store,
        # Faust's default is `<app id>-data` in the working directory; keep it in the data dir
        datadir=settings.data_dir / f"{app_id(settings, cfg)}-data",
        topic_partitions=n,
        topic_replication_factor=settings.replication_factor,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=cfg.commit_interval,
        broker_session_timeout=cfg.session_timeout,
        broker_heartbeat_interval=min(3.0, cfg.session_timeout / 3),
        broker_rebalance_timeout=max(cfg.session_timeout, 10.0),
        stream_buffer_maxsize=cfg.stream_buffer_maxsize,
        **FAUST_PRODUCER_OPTIONS,
        Monitor=LeanMonitor,
    )
    if cfg.eager_drain:
        install_eager_drain(app)  # before app.topic(): that creates the transport
    interactions, ticks = settings.topic("interactions"), f"{ns}.{STREAMS_TICKS}"
    partials_name = f"{ns}.{STREAMS_METRIC_PARTIALS}"
    source = app.topic(interactions, ticks, partitions=n, **RAW)
    topics = {
        "rollouts": app.topic(settings.topic("rollouts"), **RAW),
        "late": app.topic(settings.topic("late"), **RAW),
        "dlq": app.topic(settings.topic("dlq"), **RAW),
        "version-metrics": app.topic(settings.topic("version-metrics"), **RAW),
        "partials": app.topic(partials_name, partitions=n, **RAW),
        "ticks": app.topic(ticks, partitions=n, **RAW),
        "turns": app.topic(f"{ns}.{STREAMS_TURNS}", partitions=n, **RAW),
    }
    table = table_options(n)
    labels = app.Table("labels", help="request_id -> label state", **table)
    generations = app.Table(
        "generations", help="request_id -> generation event until its label closes", **table
    )
    buckets = app.Table(
        "buckets", help="'<partition>|<bucket>' -> emitted marker of a metrics partial", **table
    )
    metric_buckets = app.Table(
        "metric-buckets", help="'<version>|<bucket>' -> partial sums per partition", **table
    )
    spec = cfg.spec()
    views = {t.name: BatchedTable(t) for t in (labels, generations, buckets)}
    agg = Aggregator(
        spec,
        settings.wait_window,
        cfg.retention(settings.wait_window),
        cfg.metrics_bucket,
        views["labels"],
        views["generations"],
        views["buckets"],
        empty_max_tokens=cfg.empty_completion_max_tokens,
    )
    rt = Runtime(
        settings,
        cfg,
        app,
        agg,
        MetricsMerger(metric_buckets),
        topics,
        interactions,
        ticks,
        views,
        outbox=KafkaOutbox(settings.kafka_bootstrap),
    )

    @app.agent(source, concurrency=1, supervisor_strategy=CrashingSupervisor)
    async def aggregate(stream):
        async for events in stream.take_events(cfg.batch_max_events, within=cfg.batch_within):
            await rt.on_batch(events)

    @app.agent(topics["partials"], concurrency=1, supervisor_strategy=CrashingSupervisor)
    async def merge_metrics(stream):
        async for event in stream.events():
            await rt.send(rt.on_partial(event.message, event.value))

    sessions = SessionStage.build(app, settings, cfg, spec, rt.outbox, topics)

    @app.agent(
        sessions.source, name="assemble", concurrency=1, supervisor_strategy=CrashingSupervisor
    )
    async def assemble(stream):
        async for events in stream.take_events(cfg.batch_max_events, within=cfg.batch_within):
            await sessions.on_batch(events)

    @app.timer(cfg.tick_interval)
    async def tick() -> None:
        for stage in (rt, sessions):
            await stage.retry_refetches()
            await stage.send_ticks()

    @app.on_partitions_revoked.connect
    async def on_revoked(sender: Any, revoked: Any, **kwargs: Any) -> None:
        for stage in (rt, sessions):
            stage.revoked(revoked)

    @app.on_rebalance_complete.connect
    async def on_rebalance_complete(sender: Any, **kwargs: Any) -> None:
        for stage in (rt, sessions):
            await stage.assigned()

    app.flywheel_agents = {  # type: ignore[attr-defined]
        "aggregate": aggregate,
        "merge_metrics": merge_metrics,
        "assemble": assemble,
    }
    app.flywheel_sessions = sessions  # type: ignore[attr-defined]
    log.info(
        "streams app %s: %d partitions, window %.3gs, spec %s",
        app.conf.id,
        n,
        settings.wait_window,
        spec.version,
    )
    return app, rt
