"""SQL projections of `<ns>.deployments`: apply, follow, rebuild.

The topic is the source of truth; four tables are pure functions of it (PROJECTION_TABLES):
`deployment_events` (append-only copy), `model_versions` (status, lineage, gate, online metrics
per version), `deployment_state` (per model: champion, candidate, traffic, phase, step, last
analysis) and `replicas` (what each replica serves, its last heartbeat). Every value written
comes from an event (timestamps included, never the clock), so replaying the topic into empty
tables yields the same rows (DESIGN.md invariant; tests/integration/deployments checks it).

    apply_event(session, logged)      # one event, idempotent (dedupe by event_id and offset)
    follow(settings, stop=...)        # consumer group loop: `flywheel projections follow`
    rebuild(settings)                 # reset + replay to the end: `flywheel projections rebuild`

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

from app.contracts.deployments import (
    INVALID_EVENTS,
    DeploymentEvent,
    DeploymentLog,
    InvalidRecord,
    LoggedEvent,
    decode_event,
)
from app.db.models import DeploymentEvent as EventRow
from app.db.models import DeploymentState, ModelVersion, Replica
from app.deployments.metrics import PROJECTED, PROJECTED_OFFSET
from app.settings import Settings

log = logging.getLogger(__name__)

PROJECTION_TABLES = ("deployment_events", "model_versions", "deployment_state", "replicas")
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
    state = session.get(DeploymentState, ev.model)
    if state is None:
        state = DeploymentState(
            model=ev.model,
            champion=None,
            candidate=None,
            traffic_pct=0.0,
            phase="idle",
            step_index=None,
            last_analysis={},
            updated_at=ev.ts,
        )
        session.add(state)
    _HANDLERS[ev.type](session, ev, state)
    state.last_event_id, state.updated_at = ev.event_id, ev.ts
    session.flush()
    PROJECTED.labels("applied").inc()
    PROJECTED_OFFSET.labels(str(logged.partition)).set(logged.offset)
    return True


def _version(session: Session, ev: DeploymentEvent, version: str) -> ModelVersion:
    """The model_versions row of `version` (created as `registered` when first seen)."""
    mv = session.get(ModelVersion, (ev.model, version))
    if mv is None:
        mv = ModelVersion(
            model=ev.model,
            version=version,
            status="registered",
            lineage={},
            gate={},
            online={},
            created_at=ev.ts,
            updated_at=ev.ts,
        )
        session.add(mv)
    return mv


def _set_status(session: Session, ev: DeploymentEvent, version: str | None, status: str) -> None:
    if version is not None:
        mv = _version(session, ev, version)
        mv.status, mv.updated_at = status, ev.ts


def _end_canary(state: DeploymentState) -> None:
    state.candidate, state.traffic_pct, state.phase, state.step_index = None, 0.0, "idle", None


def _take_analysis(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    """details.analysis -> last_analysis; its candidate/champion sub-dicts -> online metrics."""
    analysis = ev.details.get("analysis")
    if not isinstance(analysis, dict):
        return
    state.last_analysis = dict(analysis)
    for role, version in (("candidate", state.candidate), ("champion", state.champion)):
        if version is not None and isinstance(analysis.get(role), dict):
            mv = _version(session, ev, version)
            mv.online, mv.updated_at = dict(analysis[role]), ev.ts


def _on_registered(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    mv = _version(session, ev, ev.version)
    d = ev.details
    mv.parent_version = ev.from_version
    mv.run_id = d.get("run_id")
    mv.rollouts_consumed = d.get("rollouts_consumed")
    mv.reward_spec = d.get("reward_spec")
    mv.lineage = {
        k: v for k, v in d.items() if k not in ("run_id", "rollouts_consumed", "reward_spec")
    }
    mv.created_at = mv.updated_at = ev.ts
    state.last_registered_version, state.last_registered_at = ev.version, ev.ts


def _on_gate(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    """The verdict; a version already serving as champion (recorded before its gate finished)
    keeps the status `champion`."""
    mv = _version(session, ev, ev.version)
    mv.gate, mv.updated_at = dict(ev.details), ev.ts
    if state.champion != ev.version:
        mv.status = ev.type


def _on_canary_started(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    state.candidate = ev.version
    state.champion = ev.from_version or state.champion
    state.traffic_pct, state.phase = float(ev.traffic_pct), "canary"
    state.step_index = ev.details.get("step", 0)
    state.last_analysis = {}
    _set_status(session, ev, ev.version, "canary")
    _take_analysis(session, ev, state)


def _on_traffic_shifted(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    if state.candidate is None or ev.version != state.candidate:
        return  # a stale shift for a canary that already ended (the controller's fold ignores it too)
    state.traffic_pct = float(ev.traffic_pct)
    state.step_index = ev.details.get("step", (state.step_index or 0) + 1)
    state.phase = "promoting" if state.traffic_pct >= 100.0 else "canary"
    _take_analysis(session, ev, state)


def _on_paused(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    if state.phase in ("canary", "promoting"):
        state.phase = "paused"
    _take_analysis(session, ev, state)


def _on_resumed(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    if state.phase == "paused":
        state.phase = "promoting" if state.traffic_pct >= 100.0 else "canary"
    _take_analysis(session, ev, state)


def _on_promoted(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    _take_analysis(session, ev, state)
    old = state.champion
    if old is not None and old != ev.version:
        _set_status(session, ev, old, "retired")
    _set_status(session, ev, ev.version, "champion")
    state.champion = ev.version
    if state.candidate == ev.version:
        _end_canary(state)


def _on_rolled_back(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    """`from_version` (default: the candidate, else the champion) is rolled back; `version` serves.

    Any canary ends (as in the controller's fold, app/controller/state.py)."""
    _take_analysis(session, ev, state)
    bad = ev.from_version or state.candidate or state.champion
    if bad is not None and bad != ev.version:
        _set_status(session, ev, bad, "rolled_back")
    _end_canary(state)
    _set_status(session, ev, ev.version, "champion")
    state.champion = ev.version


def _on_aborted(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    _set_status(session, ev, ev.version, "aborted")
    if state.candidate == ev.version:
        _end_canary(state)


def _on_alias_changed(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    """A champion move is carried out as it is (replicas follow the alias); removing the
    champion alias changes nothing (the controller restores it). A candidate move is an
    instruction: the state changes with the controller's answer (canary_started / aborted)."""
    if ev.details["alias"] == "champion" and ev.version is not None:
        if state.champion is not None and state.champion != ev.version:
            _set_status(session, ev, state.champion, "retired")
        _set_status(session, ev, ev.version, "champion")
        state.champion = ev.version


def _replica(session: Session, ev: DeploymentEvent) -> Replica:
    rid = ev.details["replica_id"]
    rep = session.get(Replica, rid)
    if rep is None:
        rep = Replica(replica_id=rid, status="starting", details={})
        session.add(rep)
    rep.model = ev.model
    if ev.details.get("url"):
        rep.url = ev.details["url"]
    rep.last_heartbeat = ev.ts
    extra = {k: v for k, v in ev.details.items() if k not in ("replica_id", "url", "slot")}
    rep.details = {**(rep.details or {}), **extra}
    return rep


def _on_replica_synced(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    rep = _replica(session, ev)
    if ev.details.get("slot", "champion") == "candidate":
        rep.candidate_version = ev.version
    else:
        rep.champion_version = ev.version
    rep.status = "serving"
    rep.details = {**rep.details, "last_synced_version": ev.version}


def _on_replica_sync_failed(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    rep = _replica(session, ev)
    rep.status = "sync_failed"
    rep.details = {**rep.details, "failed_version": ev.version}


def _on_replica_heartbeat(session: Session, ev: DeploymentEvent, state: DeploymentState) -> None:
    rep = _replica(session, ev)
    d = ev.details
    rep.champion_version = d.get(
        "champion_version", ev.version if ev.version is not None else rep.champion_version
    )
    if "candidate_version" in d:
        rep.candidate_version = d["candidate_version"]
    if ev.traffic_pct is not None:
        rep.traffic_pct = ev.traffic_pct
    rep.status = d.get("status") or ("serving" if rep.champion_version else "starting")


_HANDLERS: dict[str, Callable[[Session, DeploymentEvent, DeploymentState], None]] = {
    "version_registered": _on_registered,
    "gate_passed": _on_gate,
    "gate_failed": _on_gate,
    "canary_started": _on_canary_started,
    "traffic_shifted": _on_traffic_shifted,
    "canary_paused": _on_paused,
    "canary_resumed": _on_resumed,
    "promoted": _on_promoted,
    "rolled_back": _on_rolled_back,
    "aborted": _on_aborted,
    "alias_changed": _on_alias_changed,
    "replica_synced": _on_replica_synced,
    "replica_sync_failed": _on_replica_sync_failed,
    "replica_heartbeat": _on_replica_heartbeat,
}


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


def apply_or_skip(session: Session, logged: LoggedEvent) -> tuple[bool, Exception | None]:
    """(applied, failure) of one event applied inside a savepoint. An event the projections cannot
    take (an error that is not the database being away) is rolled back alone and returned as the
    failure, so the others still apply. `follow` and `rebuild` both skip such an event, so a
    rebuild reproduces what `follow` wrote."""
    try:
        with session.begin_nested():
            return apply_event(session, logged), None
    except TRANSIENT_DB_ERRORS:
        raise
    except Exception as exc:
        PROJECTED.labels("failed").inc()
        log.error(
            "deployments[%d]@%d (%s %s) cannot be projected, skipped: %s: %s",
            logged.partition,
            logged.offset,
            logged.event.type,
            logged.event.event_id,
            type(exc).__name__,
            exc,
        )
        return False, exc


# --- rebuild ----------------------------------------------------------------------------------
def reset_projections(session: Session) -> None:
    """Empty every projection table inside the session's transaction (see module docstring)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(sa.text(f"TRUNCATE {', '.join(PROJECTION_TABLES)} RESTART IDENTITY"))
    elif dialect == "sqlite":
        for table in (
            "replicas",
            "deployment_state",
            "model_versions",
        ):  # the first write opens the transaction
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
    with Session(get_engine(url)) as session, session.begin():
        reset_projections(session)
        for logged in DeploymentLog(settings).read(until_end=True):
            read += 1
            applied += apply_or_skip(session, logged)[0]
            if progress is not None:
                progress(read)
    report = RebuildReport(read, applied, read - applied, time.monotonic() - started)
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
    invalid_event, apply_failed). Returns when `stop` is set.
    """
    from app.contracts.deadletter import DeadLetters, error
    from app.contracts.kafka import make_consumer
    from app.db.session import session_scope
    from app.infra.wait import Stopped, kafka_ready

    url = db_url or settings.db_url
    stop = stop or threading.Event()
    topic = settings.topic("deployments")
    # subscribe only once the broker answers and the topic's partitions are known: a group member
    # that joins before the metadata exists gets no partitions until its next metadata refresh
    try:
        kafka_ready(settings, [topic], stop)
    except Stopped:
        return
    consumer = make_consumer(settings, group_id=group_id, metadata_max_age_ms=30_000)
    consumer.partitions_for_topic(topic)  # load this consumer's metadata before it joins the group
    consumer.subscribe([topic])
    dead = DeadLetters(settings, consumer="projector")
    log.info(
        "projector following %s into %s (group %s)", settings.topic("deployments"), url, group_id
    )
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
                            try:
                                logged = LoggedEvent(
                                    rec.partition, rec.offset, decode_event(rec.value)
                                )
                            except InvalidRecord as exc:
                                INVALID_EVENTS.inc()
                                bad.append((rec, exc.reason, exc.errors))
                                continue
                            _, failed = apply_or_skip(session, logged)
                            if failed is not None:
                                bad.append(
                                    (
                                        rec,
                                        "apply_failed",
                                        error("(apply)", f"{type(failed).__name__}: {failed}"),
                                    )
                                )
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
            consumer.commit()
    finally:
        consumer.close()
        dead.close()


def projection_rows(session: Session) -> dict[str, list[dict[str, Any]]]:
    """Every row of every projection table, in primary-key order (used to compare databases)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for model in (EventRow, ModelVersion, DeploymentState, Replica):
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
