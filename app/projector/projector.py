"""SQL projections of `<ns>.deployments` (and of `<ns>.rollouts`' sessions): apply, follow, rebuild.

The topic is the source of truth; four tables are pure functions of it:
`deployment_events` (append-only copy), `model_versions` (status, lineage, gate, online metrics
per version), `deployment_state` (per model: champion, candidate, traffic, phase, step, last
analysis) and `replicas` (what each replica serves, its last heartbeat). Every value written
comes from an event (timestamps included, never the clock), so replaying the topic into empty
tables yields the same rows (docs/DESIGN.md §Invariants; tests/integration/deployments checks it).

    apply_event(session, logged)      # one event, idempotent (dedupe by event_id and offset)
    apply_replica_status(session, ev) # one heartbeat of `<ns>.replica-status` (newest ts wins)
    follow(settings, stop=...)        # consumer group loop: `flywheel projections follow`
    rebuild(settings)                 # reset + replay to the end: `flywheel projections rebuild`

The rules are the one fold's (app/contracts/deployment_state.py): an event is folded onto the
state loaded from the rows, and the rows are written from the state the fold returns. Replica
heartbeats come from their own compacted topic, `<ns>.replica-status`
(app/contracts/replica_status.py), into `replicas` only; `follow` consumes both topics and
`rebuild` replays both. The sessions projection of `<ns>.rollouts` (app/projector/sessions.py:
`session_segments`, `session_turns`) is followed by the same consumer and rebuilt by the same
rebuild, each record in its own savepoint like an event.

Rebuild and the append-only guard: PostgreSQL's guard is a row trigger on UPDATE/DELETE, which
TRUNCATE does not fire, so the reset is `TRUNCATE ... RESTART IDENTITY`. SQLite has no
TRUNCATE, so the reset drops the guard triggers, deletes, and re-creates them from their own
stored SQL, all inside the rebuild's single transaction: nothing outside it ever sees the guard
missing, and a failed rebuild rolls back to the old projections.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from app.contracts.deployment_state import DeploymentState as State
from app.contracts.deployment_state import (
    ReplicaState,
    VersionState,
    apply_heartbeat,
    fold,
)
from app.contracts.deployments import (
    INVALID_EVENTS,
    REPLICA_TYPES,
    DeploymentEvent,
    DeploymentLog,
    InvalidRecord,
    LoggedEvent,
    decode_event,
)
from app.contracts.replica_status import ReplicaStatusLog
from app.db.models import DeploymentEvent as EventRow
from app.db.models import DeploymentState, ModelVersion, Replica, SessionSegment, SessionTurn
from app.projector.metrics import COMMITS_FAILED, PROJECTED, PROJECTED_OFFSET, SESSION_RECORDS
from app.projector.sessions import (
    SESSION_TABLES,
    LoggedRollout,
    apply_rollout,
    logged_rollout,
    read_rollouts,
    reset_sessions,
)
from app.settings import Settings

log = logging.getLogger(__name__)

PROJECTION_TABLES = (
    "deployment_events",
    "model_versions",
    "deployment_state",
    "replicas",
    *SESSION_TABLES,
)
PROJECTOR_GROUP = "flywheel-projector"


# --- apply ------------------------------------------------------------------------------------
def apply_event(session: Session, logged: LoggedEvent) -> bool:
    """Apply one event to the projections inside `session` (the caller commits).

    Returns False (and changes nothing) when the event was applied before: same event_id, or
    the same Kafka (partition, offset).
    """
    ev = logged.event
    seen = session.scalar(
        sa.select(EventRow.seq).where(
            sa.or_(
                EventRow.event_id == ev.event_id,
                sa.and_(
                    EventRow.kafka_partition == logged.partition,
                    EventRow.kafka_offset == logged.offset,
                ),
            )
        )
    )
    if seen is not None:
        PROJECTED.labels("duplicate").inc()
        return False
    session.add(
        EventRow(
            event_id=ev.event_id,
            type=ev.type,
            model=ev.model,
            version=ev.version,
            from_version=ev.from_version,
            traffic_pct=ev.traffic_pct,
            source=ev.source,
            actor=ev.actor,
            reason=ev.reason,
            details=dict(ev.details),
            ts=ev.ts,
            kafka_partition=logged.partition,
            kafka_offset=logged.offset,
        )
    )
    row = session.get(DeploymentState, ev.model)
    before = _load_state(session, row, ev)
    _store(session, row, before, fold(before, ev))
    session.flush()
    PROJECTED.labels("applied").inc()
    PROJECTED_OFFSET.labels(str(logged.partition)).set(logged.offset)
    return True


# --- fold state <-> rows ------------------------------------------------------------------------
# The rules are the fold's (app/contracts/deployment_state.py); this section only maps its state
# to rows and back. A row holds what the fold needs for the columns it feeds (champion, candidate,
# traffic, phase, step, the versions an event can touch), so an event is folded onto the state
# loaded from the rows and the rows are written from the state it returns.
def _load_state(session: Session, row: DeploymentState | None, ev: DeploymentEvent) -> State:
    """The fold state of `ev.model` as the rows hold it, with the versions and the replica that
    `ev` can touch (its version and from_version, the champion, the candidate, its replica_id)."""
    if row is None:
        state = State(model=ev.model)
    else:
        state = State(
            model=row.model,
            champion=row.champion,
            candidate=row.candidate,
            phase="canary" if row.phase == "promoting" else row.phase,
            step=-1 if row.step_index is None else row.step_index,
            traffic_pct=row.traffic_pct or 0.0,
            last_analysis=dict(row.last_analysis or {}),
            last_event_id=row.last_event_id,
            updated_at=_aware(row.updated_at),
            last_registered_version=row.last_registered_version,
            last_registered_at=_aware(row.last_registered_at),
        )
    touched = {ev.version, ev.from_version, state.champion, state.candidate} - {None}
    versions = {}
    for version in sorted(touched):
        mv = session.get(ModelVersion, (ev.model, version))
        if mv is not None:
            versions[version] = _version_state(mv)
    replicas = {}
    rid = ev.details.get("replica_id") if ev.type in REPLICA_TYPES else None
    if rid is not None and (rep := session.get(Replica, rid)) is not None:
        replicas[rid] = _replica_state(rep)
    return state.model_copy(update={"versions": versions, "replicas": replicas})


def _version_state(mv: ModelVersion) -> VersionState:
    return VersionState(
        version=mv.version,
        status=mv.status,
        parent_version=mv.parent_version,
        run_id=mv.run_id,
        rollouts_consumed=mv.rollouts_consumed,
        reward_spec=mv.reward_spec,
        lineage=dict(mv.lineage or {}),
        gate=dict(mv.gate or {}),
        online=dict(mv.online or {}),
        created_at=_aware(mv.created_at),
        updated_at=_aware(mv.updated_at),
    )


def _replica_state(rep: Replica) -> ReplicaState:
    return ReplicaState(
        replica_id=rep.replica_id,
        model=rep.model,
        url=rep.url,
        champion_version=rep.champion_version,
        candidate_version=rep.candidate_version,
        traffic_pct=rep.traffic_pct,
        status=rep.status,
        details=dict(rep.details or {}),
        last_heartbeat=_aware(rep.last_heartbeat),
    )


def _store(session: Session, row: DeploymentState | None, before: State, after: State) -> None:
    """Write the rows of `after`: the model's state row, and the versions and replicas that
    changed from `before`."""
    if row is None:
        row = DeploymentState(model=after.model)
        session.add(row)
    row.champion, row.candidate = after.champion, after.candidate
    row.traffic_pct, row.phase, row.step_index = (
        after.traffic_pct,
        after.status_phase,
        after.step_index,
    )
    row.last_analysis = dict(after.last_analysis)
    row.last_registered_version = after.last_registered_version
    row.last_registered_at = after.last_registered_at
    row.last_event_id, row.updated_at = after.last_event_id, after.updated_at
    for version, vs in after.versions.items():
        if before.versions.get(version) != vs:
            _store_version(session, after.model, vs)
    for rep in after.replicas.values():
        if before.replicas.get(rep.replica_id) != rep:
            _store_replica(session, rep)


def _store_version(session: Session, model: str, vs: VersionState) -> None:
    mv = session.get(ModelVersion, (model, vs.version))
    if mv is None:
        mv = ModelVersion(model=model, version=vs.version)
        session.add(mv)
    for field in (
        "status",
        "parent_version",
        "run_id",
        "rollouts_consumed",
        "reward_spec",
        "lineage",
        "gate",
        "online",
        "created_at",
        "updated_at",
    ):
        setattr(mv, field, getattr(vs, field))


def _store_replica(session: Session, rep: ReplicaState) -> None:
    row = session.get(Replica, rep.replica_id)
    if row is None:
        row = Replica(replica_id=rep.replica_id)
        session.add(row)
    for field in (
        "model",
        "url",
        "champion_version",
        "candidate_version",
        "traffic_pct",
        "status",
        "details",
        "last_heartbeat",
    ):
        setattr(row, field, getattr(rep, field))


def _aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes (stored as UTC)."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def apply_replica_status(session: Session, ev: DeploymentEvent) -> bool:
    """Apply one `replica_heartbeat` of `<ns>.replica-status` to the `replicas` table (the caller
    commits). The topic is compacted per replica, so only the newest report counts: one older
    than the row's last report changes nothing (returns False)."""
    if ev.type != "replica_heartbeat":
        raise ValueError(
            f"{ev.type} on the replica-status topic; only replica_heartbeat belongs there"
        )
    rid = ev.details["replica_id"]
    rep = session.get(Replica, rid)
    before = {} if rep is None else {rid: _replica_state(rep)}
    last = before[rid].last_heartbeat if before else None
    if last is not None and ev.ts < last:
        PROJECTED.labels("stale_status").inc()
        return False
    _store_replica(session, apply_heartbeat(before, ev)[rid])
    session.flush()
    PROJECTED.labels("status").inc()
    return True


def apply_events(session: Session, events: Iterable[LoggedEvent]) -> int:
    """Apply several events in order; returns how many were new."""
    return sum(apply_event(session, logged) for logged in events)


# Database errors that say the database is away, not that the event is bad: the batch is retried.
TRANSIENT_DB_ERRORS: tuple[type[Exception], ...] = (
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    sa.exc.DisconnectionError,
    sa.exc.TimeoutError,
)


def apply_or_skip(
    session: Session, logged: LoggedEvent, status: bool = False
) -> tuple[bool, Exception | None]:
    """(applied, failure) of one event applied inside a savepoint (`status`: a record of
    `<ns>.replica-status`, applied with `apply_replica_status`). An event the projections cannot
    take (an error that is not the database being away) is rolled back alone and returned as the
    failure, so the others still apply. `follow` and `rebuild` both skip such an event, so a
    rebuild reproduces what `follow` wrote."""
    ev = logged.event
    return _in_savepoint(
        session,
        lambda: apply_replica_status(session, ev) if status else apply_event(session, logged),
        PROJECTED.labels("failed"),
        f"deployments[{logged.partition}]@{logged.offset} ({ev.type} {ev.event_id})",
    )


def apply_rollout_or_skip(session: Session, logged: LoggedRollout) -> tuple[bool, Exception | None]:
    """`apply_or_skip` for a record of `<ns>.rollouts` (the sessions projection)."""
    applied, failure = _in_savepoint(
        session,
        lambda: apply_rollout(session, logged),
        SESSION_RECORDS.labels("failed"),
        f"rollouts[{logged.partition}]@{logged.offset} ({logged.key})",
    )
    if failure is None:
        SESSION_RECORDS.labels("applied" if applied else "duplicate").inc()
    return applied, failure


def _in_savepoint(
    session: Session, apply: Callable[[], bool], failed: Any, what: str
) -> tuple[bool, Exception | None]:
    """(applied, failure) of `apply()` inside a savepoint: an error other than the database
    being away rolls back that record alone, counts in `failed` and is returned."""
    try:
        with session.begin_nested():
            return apply(), None
    except TRANSIENT_DB_ERRORS:
        raise
    except Exception as exc:
        failed.inc()
        log.error("%s cannot be projected, skipped: %s: %s", what, type(exc).__name__, exc)
        return False, exc


# --- rebuild ----------------------------------------------------------------------------------
def reset_projections(session: Session) -> None:
    """Empty every projection table inside the session's transaction (see module docstring)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(sa.text(f"TRUNCATE {', '.join(PROJECTION_TABLES)} RESTART IDENTITY"))
    elif dialect == "sqlite":
        reset_sessions(session)  # the first write opens the transaction
        for table in ("replicas", "deployment_state", "model_versions"):
            session.execute(sa.text(f"DELETE FROM {table}"))
        triggers = session.execute(
            sa.text(
                "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'deployment_events'"
            )
        ).all()
        for name, _ in triggers:
            session.execute(sa.text(f'DROP TRIGGER "{name}"'))
        session.execute(sa.text("DELETE FROM deployment_events"))
        for _, ddl in triggers:
            session.execute(sa.text(ddl))
    else:
        raise NotImplementedError(f"projection reset for dialect {dialect!r} is not implemented")


@dataclass(frozen=True)
class RebuildReport:
    events_read: int
    events_applied: int
    duplicates: int
    seconds: float
    status_read: int = 0  # heartbeats read from `<ns>.replica-status`
    rollouts_read: int = 0  # records read from `<ns>.rollouts`
    rollouts_applied: int = 0  # of them, projected into the sessions tables (new keys)


def rebuild(
    settings: Settings, db_url: str | None = None, progress: Callable[[int], None] | None = None
) -> RebuildReport:
    """Replay `<ns>.deployments` from the beginning into emptied projection tables, atomically.

    One transaction: readers see the old projections until it commits; on any error nothing
    changes. The end offsets are taken after the reset, so events a concurrent `follow` wrote
    before the reset are replayed and later ones are applied by it afterwards (dedupe).
    """
    from app.db.session import get_engine

    url = db_url or settings.db_url
    started = time.monotonic()
    read = applied = 0
    status_read = 0
    with Session(get_engine(url)) as session, session.begin():
        reset_projections(session)
        for logged in DeploymentLog(settings).read(until_end=True):
            read += 1
            applied += apply_or_skip(session, logged)[0]
            if progress is not None:
                progress(read)
        for logged in ReplicaStatusLog(settings).read(until_end=True):
            status_read += 1
            apply_or_skip(session, logged, status=True)
        rollouts_read = rollouts_applied = 0
        for _, got in read_rollouts(settings):
            rollouts_read += 1
            if isinstance(got, LoggedRollout):
                rollouts_applied += apply_rollout_or_skip(session, got)[0]
    report = RebuildReport(
        read,
        applied,
        read - applied,
        time.monotonic() - started,
        status_read=status_read,
        rollouts_read=rollouts_read,
        rollouts_applied=rollouts_applied,
    )
    log.info(
        "rebuilt projections in %s from %s: %d events, %d applied, %d duplicates, %.2fs",
        url,
        settings.topic("deployments"),
        report.events_read,
        report.events_applied,
        report.duplicates,
        report.seconds,
    )
    return report


# --- follow -----------------------------------------------------------------------------------
def follow(
    settings: Settings,
    db_url: str | None = None,
    stop: threading.Event | None = None,
    group_id: str = PROJECTOR_GROUP,
    poll_timeout_s: float = 1.0,
    retry_backoff_s: float = 1.0,
) -> None:
    """Consume the topic with a consumer group and apply each poll batch in one transaction.

    Waits first for the broker and the topic (app/infra/wait.py: backoff, one log line).
    Offsets are committed after the database commit, so a crash re-delivers at most one batch,
    which the event_id / offset dedupe turns into no-ops. A database error that says the database
    is away rewinds to the batch's first offsets and retries after `retry_backoff_s`. A record
    that is not a valid event, or an event the projections cannot take (`apply_or_skip`), is
    skipped and dead-lettered to `<ns>.dlq` once the batch committed (reasons invalid_json,
    invalid_event, apply_failed). Records of `<ns>.rollouts` go to the sessions projection the
    same way (a record that is not a rollout: invalid_json, invalid_rollout). Returns when `stop`
    is set.
    """
    from app.contracts.deadletter import DeadLetters
    from app.db.session import session_scope
    from app.infra.kafka import make_consumer
    from app.infra.wait import Stopped, kafka_ready

    url = db_url or settings.db_url
    stop = stop or threading.Event()
    topics = [settings.topic(t) for t in ("deployments", "replica-status", "rollouts")]
    # subscribe only once the broker answers and the topic's partitions are known: a group member
    # that joins before the metadata exists gets no partitions until its next metadata refresh
    try:
        kafka_ready(settings, topics, stop)
    except Stopped:
        return
    consumer = make_consumer(settings, group_id=group_id, metadata_max_age_ms=30_000)
    for name in topics:  # this consumer's metadata, before it joins the group
        consumer.partitions_for_topic(name)
    consumer.subscribe(topics)
    dead = DeadLetters(settings, consumer="projector")
    log.info("projector following %s into %s (group %s)", ", ".join(topics), url, group_id)
    try:
        while not stop.is_set():
            batch = consumer.poll(timeout_ms=int(poll_timeout_s * 1000))
            if not batch:
                continue
            bad: list[
                tuple[Any, str, list[dict[str, str]]]
            ] = []  # (record, reason, errors), sent after the commit
            try:
                with session_scope(url) as session:
                    for records in batch.values():
                        for rec in records:
                            refused = _apply_record(session, rec, topics)
                            if refused is not None:
                                bad.append((rec, *refused))
            except sa.exc.SQLAlchemyError as exc:
                log.warning(
                    "projector: database error, retrying the batch in %.1fs: %s",
                    retry_backoff_s,
                    exc,
                )
                for tp, records in batch.items():
                    consumer.seek(tp, records[0].offset)
                stop.wait(retry_backoff_s)
                continue
            for rec, reason, errors in bad:
                dead.send(rec, reason, errors)
            _commit(consumer)
    finally:
        consumer.close()
        dead.close()


def _commit(consumer: Any) -> None:
    """Commit the follower's consumed offsets. A commit the group refuses because it rebalanced
    (this member was too slow to heartbeat on a loaded machine, or another member joined), or that
    times out, does not end the follower: the batch is already in the database, the next poll
    rejoins the group, and whoever owns the partitions then re-reads the batch, whose records the
    event_id / offset dedupe turns into no-ops (a bad record is dead-lettered again)."""
    from kafka.errors import CommitFailedError, KafkaTimeoutError, RebalanceInProgressError

    try:
        consumer.commit()
    except (CommitFailedError, RebalanceInProgressError, KafkaTimeoutError) as exc:
        # kafka-python raises RebalanceInProgressError itself, unwrapped, when the member knows
        # its group is rebalancing at the commit, and CommitFailedError when it was left out
        reason = "timeout" if isinstance(exc, KafkaTimeoutError) else "rebalanced"
        COMMITS_FAILED.labels(reason).inc()
        log.warning(
            "projector: offset commit failed (%s), the batch will be re-read: %s", reason, exc
        )


def _apply_record(
    session: Session, rec: Any, topics: list[str]
) -> tuple[str, list[dict[str, str]]] | None:
    """Apply one record `follow` consumed (of `topics`: deployments, replica-status, rollouts);
    (reason, errors) of its dead letter when it cannot be applied, else None."""
    from app.contracts.deadletter import error

    if rec.topic == topics[2]:
        got = logged_rollout(rec)
        if isinstance(got, InvalidRecord):
            SESSION_RECORDS.labels("invalid").inc()
            return got.reason, got.errors
        _, failed = apply_rollout_or_skip(session, got)
    else:
        try:
            logged = LoggedEvent(rec.partition, rec.offset, decode_event(rec.value))
        except InvalidRecord as exc:
            INVALID_EVENTS.inc()
            return exc.reason, exc.errors
        _, failed = apply_or_skip(session, logged, status=rec.topic == topics[1])
    if failed is not None:
        return "apply_failed", error("(apply)", f"{type(failed).__name__}: {failed}")
    return None


def projection_rows(session: Session) -> dict[str, list[dict[str, Any]]]:
    """Every row of every projection table, in primary-key order (used to compare databases)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for model in (EventRow, ModelVersion, DeploymentState, Replica, SessionSegment, SessionTurn):
        table = model.__table__
        rows = (
            session.execute(sa.select(table).order_by(*table.primary_key.columns)).mappings().all()
        )
        out[table.name] = [{k: _normalize(v) for k, v in r.items()} for r in rows]
    return out


def _normalize(value: Any) -> Any:
    """SQLite returns naive datetimes (stored as UTC); compare them as aware UTC."""

    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value
