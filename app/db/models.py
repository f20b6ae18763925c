"""SQLAlchemy 2.0 models of the app database.

- `ApiKey`: bearer keys, stored as SHA-256 of the key (keys are 256-bit random tokens, so a
  fast hash is enough), with scopes `ingest`, `read`, `admin`.
- `DeploymentEvent`: the append-only projection of `flywheel.deployments` (the topic is the
  source of truth; `flywheel projections rebuild` replays it into these tables).
- `ModelVersion`: one row per registered model version: lineage, gate results, status.
- `Replica`: inference replicas with the versions they serve and their last heartbeat.
- `DeploymentState`: one row per model: champion, candidate, traffic split, phase, step.
- `SessionSegment`, `SessionTurn`: the sessions projection of `<ns>.rollouts` (migrations 0003, 0004):
  one row per rollout record (a session's segment) and one per model call in it.

Schema changes go through Alembic (`migrations/`); `flywheel db upgrade` applies them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    event,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


SCOPES = ("ingest", "read", "admin")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(16), index=True)  # shown in listings; not secret
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    scopes: Mapped[str] = mapped_column(String(64))  # comma-separated subset of SCOPES
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)

    @property
    def scope_set(self) -> frozenset[str]:
        return frozenset(s for s in self.scopes.split(",") if s)


class DeploymentEvent(Base):
    """One deployment decision, as it appeared on `flywheel.deployments` (append-only)."""

    __tablename__ = "deployment_events"
    __table_args__ = (
        Index("ix_deployment_events_model_ts", "model", "ts"),
        UniqueConstraint("kafka_partition", "kafka_offset", name="uq_deployment_events_offset"),
    )

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(64), unique=True)
    type: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(128))
    version: Mapped[str | None] = mapped_column(String(32))
    from_version: Mapped[str | None] = mapped_column(String(32))
    traffic_pct: Mapped[float | None] = mapped_column(Float)
    source: Mapped[str] = mapped_column(
        String(16)
    )  # trainer | controller | api | mlflow-ui | replica | import
    actor: Mapped[str] = mapped_column(String(128), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    ts: Mapped[datetime] = mapped_column()
    kafka_partition: Mapped[int | None] = mapped_column(Integer)
    kafka_offset: Mapped[int | None] = mapped_column(BigInteger)


@event.listens_for(DeploymentEvent, "before_update")
def _deployment_events_are_append_only(mapper, connection, target) -> None:
    raise ValueError(
        f"deployment_events is append-only; refusing to update event {target.event_id}"
    )


@event.listens_for(DeploymentEvent, "before_delete")
def _deployment_events_are_never_deleted(mapper, connection, target) -> None:
    raise ValueError(
        f"deployment_events is append-only; refusing to delete event {target.event_id}"
    )


class ModelVersion(Base):
    __tablename__ = "model_versions"

    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[str] = mapped_column(String(32), primary_key=True)
    parent_version: Mapped[str | None] = mapped_column(String(32))
    run_id: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(32), default="registered")
    rollouts_consumed: Mapped[int | None] = mapped_column(BigInteger)
    reward_spec: Mapped[str | None] = mapped_column(String(16))
    lineage: Mapped[dict[str, Any]] = mapped_column(default=dict)  # offsets, parent chain, hashes
    gate: Mapped[dict[str, Any]] = mapped_column(default=dict)  # gate results
    online: Mapped[dict[str, Any]] = mapped_column(default=dict)  # online metrics summary
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Replica(Base):
    __tablename__ = "replicas"

    replica_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str | None] = mapped_column(
        String(128), index=True
    )  # registered model it serves (0002)
    url: Mapped[str | None] = mapped_column(String(512))
    champion_version: Mapped[str | None] = mapped_column(String(32))
    candidate_version: Mapped[str | None] = mapped_column(String(32))
    traffic_pct: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(32), default="starting")
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    last_heartbeat: Mapped[datetime | None] = mapped_column(default=None)


class DeploymentState(Base):
    """Per-model rollout state, projected from `flywheel.deployments` (migration 0002).

    `traffic_pct` is the candidate's share of sessions (0 when no canary runs); `phase` is
    idle | canary | paused | promoting. Every timestamp comes from an event, never from the
    clock, so a rebuild from the topic reproduces the table exactly.
    """

    __tablename__ = "deployment_state"

    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    champion: Mapped[str | None] = mapped_column(String(32))
    candidate: Mapped[str | None] = mapped_column(String(32))
    traffic_pct: Mapped[float] = mapped_column(Float, default=0.0)
    phase: Mapped[str] = mapped_column(String(16), default="idle")
    step_index: Mapped[int | None] = mapped_column(Integer)
    last_analysis: Mapped[dict[str, Any]] = mapped_column(default=dict)
    last_registered_version: Mapped[str | None] = mapped_column(String(32))
    last_registered_at: Mapped[datetime | None] = mapped_column(default=None)
    last_event_id: Mapped[str | None] = mapped_column(String(64))
    updated_at: Mapped[datetime] = mapped_column()


class SessionSegment(Base):
    """One rollout record of `<ns>.rollouts` (a session's segment, or a one-call record), keyed by
    its Kafka key: `request_id`, or `<request_id>|<spec>` for a relabelled record (migration 0003; `protected_writes` 0004).

    Written once per key by app/projector/sessions.py (a redelivered record changes nothing);
    `kafka_partition`/`kafka_offset` locate the record on `<ns>.rollouts`, which the trainer's
    lineage (`details.kafka_offsets` of `version_registered`) names in ranges.
    """

    __tablename__ = "session_segments"
    __table_args__ = (Index("ix_session_segments_session", "session_id", "generated_at"),)

    record_key: Mapped[str] = mapped_column(String(256), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128))
    request_id: Mapped[str] = mapped_column(String(128))  # the first turn's
    relabel_run: Mapped[str | None] = mapped_column(String(64))
    reward_spec: Mapped[str] = mapped_column(String(64))
    model_version: Mapped[str] = mapped_column(String(32))  # the last turn's
    opened_by: Mapped[str | None] = mapped_column(String(32))
    closed_by: Mapped[str | None] = mapped_column(String(32))
    turn_count: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    sampled_tokens: Mapped[int] = mapped_column(Integer)  # loss_mask ones (all without a mask)
    reward: Mapped[float] = mapped_column(Float)
    components: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    outcome: Mapped[str | None] = mapped_column(String(16))  # success | failure | abandoned
    outcome_reward: Mapped[float | None] = mapped_column(Float)
    # the record's `protected_writes` (migration 0004): calls that wrote a protected path under
    # a spec with protected paths; None when the record does not give it
    protected_writes: Mapped[int | None] = mapped_column(Integer)
    generated_at: Mapped[datetime] = mapped_column()
    labelled_at: Mapped[datetime] = mapped_column()
    kafka_partition: Mapped[int] = mapped_column(Integer)
    kafka_offset: Mapped[int] = mapped_column(BigInteger)


class SessionTurn(Base):
    """One model call of a segment (a `TurnSpan`; the record itself for a one-call record)."""

    __tablename__ = "session_turns"
    __table_args__ = (Index("ix_session_turns_version", "model_version", "session_id"),)

    record_key: Mapped[str] = mapped_column(
        String(256), ForeignKey("session_segments.record_key"), primary_key=True
    )
    position: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0 = the segment's first
    session_id: Mapped[str] = mapped_column(String(128))
    request_id: Mapped[str] = mapped_column(String(128))
    model_version: Mapped[str] = mapped_column(String(32))
    reward: Mapped[float | None] = mapped_column(Float)  # its own reward (None: not given)
    components: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    sampled_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    generated_at: Mapped[datetime | None] = mapped_column(default=None)
