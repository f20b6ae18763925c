"""Read-only deployment status (docs/DESIGN.md §HTTP APIs, scope `read`), served from the SQL
projections of `flywheel.deployments` (app/projector/projector.py):

- `GET /v1/deployments`: per model the champion, candidate, traffic split, phase, canary step,
  last analysis, replicas with the versions they serve and their heartbeat age, and the next
  checkpoint ETA (last `version_registered` ts + `ship_interval`).
- `GET /v1/deployments/history`: deployment events newest first, `limit` <= 500, keyset
  pagination with `cursor` (pass back `next_cursor`); filters `model`, `type`, `version`.
  `replica_heartbeat` events are left out unless asked for by `type`.
- `GET /v1/models/{version}`: lineage (parent chain), gate results, online metrics, rollout
  status and the version's own events; 404 with the known versions when it is unknown.

These endpoints only read SQL; the projector keeps the tables current. Every parameter is
bounded before it reaches SQL: `cursor` is 0..2^31-1 (a garbage or out-of-range cursor is 422,
not a database error), names and versions are at most 256 / 64 characters without control
characters (a NUL byte is refused by PostgreSQL).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Depends, HTTPException, Path, Query, status
from pydantic import BaseModel, Field

from app.api.deps import SessionDep, SettingsDep, require_scope
from app.contracts.deployments import EventType, Source
from app.db.models import ApiKey, DeploymentState, ModelVersion, Replica
from app.db.models import DeploymentEvent as EventRow

router = APIRouter(tags=["status"])
ReadKey = Annotated[ApiKey, Depends(require_scope("read"))]

MAX_HISTORY = 500
MAX_ANCESTORS = 100
MAX_CURSOR = (
    2**31 - 1
)  # `seq` is an INTEGER column (32-bit on PostgreSQL); larger cursors overflow the query
_PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
ModelName = Annotated[
    str | None, Query(max_length=256, pattern=_PRINTABLE, description="Only this registered model.")
]
VersionQuery = Annotated[
    str | None,
    Query(
        max_length=64,
        pattern=_PRINTABLE,
        description="Only events whose version or from_version is this.",
    ),
]


def _utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes (stored as UTC); answer with aware UTC everywhere."""
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# --- response models ----------------------------------------------------------------------------
class ReplicaPublic(BaseModel):
    replica_id: str
    url: str | None = Field(description="Where the replica serves, as it reported it.")
    status: str = Field(
        description="starting | serving | sync_failed (or what its heartbeat reported)."
    )
    champion_version: str | None = Field(description="Version it serves outside the canary.")
    candidate_version: str | None = Field(
        description="Version it serves to canary sessions, if any."
    )
    traffic_pct: float | None = Field(description="Candidate share it last reported applying.")
    last_heartbeat: datetime | None = Field(
        description="Timestamp of its last event (sync or heartbeat)."
    )
    heartbeat_age_s: float | None = Field(
        description="Seconds since `last_heartbeat`, at answer time."
    )
    details: dict[str, Any]


class TrafficSplit(BaseModel):
    champion_pct: float = Field(description="Share of sessions served by the champion, percent.")
    candidate_pct: float = Field(description="Share of sessions in the canary, percent.")


class DeploymentStatusPublic(BaseModel):
    model: str
    champion: str | None
    candidate: str | None
    traffic: TrafficSplit
    phase: str = Field(description="idle | canary | paused | promoting.")
    step: int | None = Field(
        description="Index of the current canary step (0 = first), null when idle."
    )
    last_analysis: dict[str, Any] = Field(description="The controller's last canary analysis.")
    updated_at: datetime = Field(description="Timestamp of the last event applied to this model.")
    last_event_id: str | None
    replicas: list[ReplicaPublic]
    last_registered_version: str | None
    last_registered_at: datetime | None
    next_checkpoint_eta: datetime | None = Field(
        description="last_registered_at + ship_interval; null before the first version."
    )
    next_checkpoint_in_s: float | None = Field(
        description="Seconds until the ETA (negative: overdue)."
    )


class DeploymentsPublic(BaseModel):
    models: list[DeploymentStatusPublic]
    generated_at: datetime


class DeploymentEventBase(BaseModel):
    """The contract fields of a deployment event (app/contracts/deployments.py)."""

    event_id: str
    type: str
    model: str
    version: str | None
    from_version: str | None
    traffic_pct: float | None
    source: str
    actor: str
    reason: str
    details: dict[str, Any]
    ts: datetime


class DeploymentEventPublic(DeploymentEventBase):
    seq: int = Field(description="Position in the projection (the history cursor).")
    kafka_partition: int | None
    kafka_offset: int | None


class HistoryPublic(BaseModel):
    events: list[DeploymentEventPublic]
    next_cursor: int | None = Field(
        description="Pass as `cursor` for the next (older) page; null on the last page."
    )


class LineagePublic(BaseModel):
    parent_version: str | None
    ancestors: list[str] = Field(
        description="Parent, grandparent, ... as far as the projections know."
    )
    run_id: str | None
    rollouts_consumed: int | None
    reward_spec: str | None = Field(
        description="The reward spec versions of the rollouts trained on, comma-joined "
        "(null when they do not fit 16 characters: see reward_specs)."
    )
    reward_specs: dict[str, int] = Field(
        description="Rollouts trained on per reward spec version (relabelled rollouts "
        "under their new spec); empty for versions registered without counts."
    )
    rollouts_relabelled: int | None = Field(
        description="How many of them came from `flywheel streams relabel`."
    )
    sessions_trained: int | None = Field(
        description="Agent sessions among the rollouts trained on (the trainer's "
        "`sessions_trained`); null for versions registered without the count."
    )
    turns_trained: int | None = Field(
        description="Model calls (turns) in the rollouts trained on (`turns_trained`); null "
        "for versions registered without the count."
    )
    details: dict[str, Any] = Field(
        description="Everything else the trainer recorded (Kafka offset ranges, hashes, ...)."
    )


class RolloutPublic(BaseModel):
    status: str = Field(
        description="registered | gate_passed | gate_failed | canary | champion | retired | rolled_back | aborted."
    )
    is_champion: bool
    is_candidate: bool
    traffic_pct: float = Field(description="Share of sessions this version serves now, percent.")
    phase: str | None = Field(description="The model's phase when this version is the candidate.")
    step: int | None
    replicas: list[str] = Field(description="Replicas serving this version (either slot).")


class ModelVersionPublic(BaseModel):
    model: str
    version: str
    lineage: LineagePublic
    gate: dict[str, Any]
    online: dict[str, Any]
    rollout: RolloutPublic
    created_at: datetime
    updated_at: datetime
    events: list[DeploymentEventPublic] = Field(
        description="Events about this version, newest first (at most 100)."
    )


def _spec_counts(value: Any) -> dict[str, int]:
    """`details.reward_specs` of a version_registered event as {spec: count}; anything else is {}
    (the event log is shared: a malformed entry must not make the version unreadable)."""
    if not isinstance(value, dict):
        return {}
    return {
        str(k): int(v) for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)
    }


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _event_public(row: EventRow) -> DeploymentEventPublic:
    return DeploymentEventPublic(
        seq=row.seq,
        event_id=row.event_id,
        type=row.type,
        model=row.model,
        version=row.version,
        from_version=row.from_version,
        traffic_pct=row.traffic_pct,
        source=row.source,
        actor=row.actor,
        reason=row.reason,
        details=row.details or {},
        ts=_utc(row.ts),
        kafka_partition=row.kafka_partition,
        kafka_offset=row.kafka_offset,
    )


def _replica_public(rep: Replica, now: datetime) -> ReplicaPublic:
    hb = _utc(rep.last_heartbeat)
    return ReplicaPublic(
        replica_id=rep.replica_id,
        url=rep.url,
        status=rep.status,
        champion_version=rep.champion_version,
        candidate_version=rep.candidate_version,
        traffic_pct=rep.traffic_pct,
        last_heartbeat=hb,
        heartbeat_age_s=None if hb is None else (now - hb).total_seconds(),
        details=rep.details or {},
    )


# --- endpoints ----------------------------------------------------------------------------------
@router.get("/v1/deployments", response_model=DeploymentsPublic)
def deployments(
    _key: ReadKey, session: SessionDep, settings: SettingsDep, model: ModelName = None
) -> DeploymentsPublic:
    """Champion, candidate, traffic split, phase, step, last analysis, replicas and next checkpoint ETA per model."""
    now = datetime.now(UTC)
    q = sa.select(DeploymentState).order_by(DeploymentState.model)
    if model is not None:
        q = q.where(DeploymentState.model == model)
    states = session.scalars(q).all()
    replicas: dict[str | None, list[Replica]] = {}
    for rep in session.scalars(sa.select(Replica).order_by(Replica.replica_id)):
        replicas.setdefault(rep.model, []).append(rep)
    out = []
    for st in states:
        registered_at = _utc(st.last_registered_at)
        eta = (
            None
            if registered_at is None
            else registered_at + timedelta(seconds=settings.ship_interval)
        )
        candidate_pct = float(st.traffic_pct or 0.0) if st.candidate else 0.0
        out.append(
            DeploymentStatusPublic(
                model=st.model,
                champion=st.champion,
                candidate=st.candidate,
                traffic=TrafficSplit(
                    champion_pct=100.0 - candidate_pct, candidate_pct=candidate_pct
                ),
                phase=st.phase,
                step=st.step_index,
                last_analysis=st.last_analysis or {},
                updated_at=_utc(st.updated_at),
                last_event_id=st.last_event_id,
                replicas=[_replica_public(r, now) for r in replicas.get(st.model, [])],
                last_registered_version=st.last_registered_version,
                last_registered_at=registered_at,
                next_checkpoint_eta=eta,
                next_checkpoint_in_s=None if eta is None else (eta - now).total_seconds(),
            )
        )
    return DeploymentsPublic(models=out, generated_at=now)


@router.get("/v1/deployments/history", response_model=HistoryPublic)
def history(
    _key: ReadKey,
    session: SessionDep,
    limit: Annotated[
        int, Query(ge=1, le=MAX_HISTORY, description=f"Page size, 1..{MAX_HISTORY}.")
    ] = 50,
    cursor: Annotated[
        int | None, Query(ge=0, le=MAX_CURSOR, description="`next_cursor` of the previous page.")
    ] = None,
    model: ModelName = None,
    type: Annotated[
        list[EventType] | None,
        Query(max_length=32, description="Only these event types (repeatable)."),
    ] = None,
    version: VersionQuery = None,
    source: Annotated[Source | None, Query(description="Only events from this source.")] = None,
) -> HistoryPublic:
    """Deployment events, newest first, keyset-paginated."""
    q = sa.select(EventRow).order_by(EventRow.seq.desc()).limit(limit + 1)
    if cursor is not None:
        q = q.where(EventRow.seq < cursor)
    if model is not None:
        q = q.where(EventRow.model == model)
    if type:
        q = q.where(EventRow.type.in_(type))
    else:
        q = q.where(EventRow.type != "replica_heartbeat")
    if version is not None:
        q = q.where(sa.or_(EventRow.version == version, EventRow.from_version == version))
    if source is not None:
        q = q.where(EventRow.source == source)
    rows = session.scalars(q).all()
    page = rows[:limit]
    return HistoryPublic(
        events=[_event_public(r) for r in page],
        next_cursor=page[-1].seq if len(rows) > limit else None,
    )


@router.get("/v1/models/{version}", response_model=ModelVersionPublic)
def model_version(
    version: Annotated[
        str, Path(max_length=64, pattern=_PRINTABLE, description="The model version.")
    ],
    _key: ReadKey,
    session: SessionDep,
    settings: SettingsDep,
    model: Annotated[
        str | None,
        Query(
            max_length=256,
            pattern=_PRINTABLE,
            description="Registered model (default: FLYWHEEL_MODEL_NAME).",
        ),
    ] = None,
) -> ModelVersionPublic:
    """Lineage, gate results, online metrics and rollout status of one model version."""
    model = model or settings.model_name
    versions = {
        mv.version: mv
        for mv in session.scalars(sa.select(ModelVersion).where(ModelVersion.model == model))
    }
    mv = versions.get(version)
    if mv is None:
        known = sorted(versions, key=lambda v: (len(v), v))[-20:]
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"model version {version!r} of {model!r} is unknown; "
            + (
                f"known versions: {', '.join(known)}"
                if known
                else f"no versions of {model!r} are known yet"
            )
            + " (pass ?model=NAME for another registered model)",
        )
    ancestors, parent = [], mv.parent_version
    while parent is not None and parent not in ancestors and len(ancestors) < MAX_ANCESTORS:
        ancestors.append(parent)
        parent = versions[parent].parent_version if parent in versions else None
    state = session.get(DeploymentState, model)
    is_champion = state is not None and state.champion == version
    is_candidate = state is not None and state.candidate == version
    canary_pct = float(state.traffic_pct or 0.0) if state is not None and state.candidate else 0.0
    share = canary_pct if is_candidate else (100.0 - canary_pct if is_champion else 0.0)
    serving = session.scalars(
        sa.select(Replica.replica_id)
        .where(
            Replica.model == model,
            sa.or_(Replica.champion_version == version, Replica.candidate_version == version),
        )
        .order_by(Replica.replica_id)
    ).all()
    events = session.scalars(
        sa.select(EventRow)
        .where(
            EventRow.model == model,
            EventRow.type != "replica_heartbeat",
            sa.or_(EventRow.version == version, EventRow.from_version == version),
        )
        .order_by(EventRow.seq.desc())
        .limit(100)
    ).all()
    return ModelVersionPublic(
        model=model,
        version=version,
        lineage=LineagePublic(
            parent_version=mv.parent_version,
            ancestors=ancestors,
            run_id=mv.run_id,
            rollouts_consumed=mv.rollouts_consumed,
            reward_spec=mv.reward_spec,
            reward_specs=_spec_counts((mv.lineage or {}).get("reward_specs")),
            rollouts_relabelled=_int_or_none((mv.lineage or {}).get("rollouts_relabelled")),
            sessions_trained=_int_or_none((mv.lineage or {}).get("sessions_trained")),
            turns_trained=_int_or_none((mv.lineage or {}).get("turns_trained")),
            details=mv.lineage or {},
        ),
        gate=mv.gate or {},
        online=mv.online or {},
        rollout=RolloutPublic(
            status=mv.status,
            is_champion=is_champion,
            is_candidate=is_candidate,
            traffic_pct=share,
            phase=state.phase if is_candidate else None,
            step=state.step_index if is_candidate else None,
            replicas=list(serving),
        ),
        created_at=_utc(mv.created_at),
        updated_at=_utc(mv.updated_at),
        events=[_event_public(e) for e in events],
    )
