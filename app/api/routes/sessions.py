"""Read-only sessions (docs/DESIGN.md §HTTP APIs, scope `read`), served from the sessions
projection of `<ns>.rollouts` (app/projector/sessions.py):

- `GET /v1/sessions/{session_id}`: the session's segments in order (first turn's generation
  time, then request_id; a relabelled copy right after its live segment), each with its turns
  (request_id, model_version, own reward, components), the versions that served it, its
  reward, outcome, `protected_writes` (the calls that wrote a protected path such as the test
  file, under a reward spec that counts them), and `trained_by`: the version whose training took it, when that is known.
  404 naming the session when no record of it has been projected.

Which version trained on a record. The trainer's lineage names what each version read in
ranges of `<ns>.rollouts` offsets (`details.kafka_offsets` of its `version_registered`:
`{"topic", "partitions": {"<p>": [first, end)}}`, in `model_versions.lineage`), and the projection
keeps each record's (partition, offset). A version read every record of its ranges and either
trained on it or skipped it (duplicate, stale, invalid, failed), so the range gives
`consumed_by`, and `trained_by` is set when the version cannot have skipped this one: it trained
on as many rollouts as its ranges hold (`rollouts_consumed` = the ranges' size: it skipped
none), or its lineage lists the offsets it skipped (`details.skipped_offsets`:
`{"<p>": [offset, ...]}`) and this one is not among them. Otherwise `trained_by` is null, never
a guess. No MLflow artifact is read (the trainer's `request_ids.json` would need a download).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Depends, HTTPException, Path, Query, status
from pydantic import BaseModel, Field

from app.api.deps import SessionDep, SettingsDep, require_scope
from app.db.models import ApiKey, ModelVersion, SessionSegment, SessionTurn

router = APIRouter(tags=["sessions"])
ReadKey = Annotated[ApiKey, Depends(require_scope("read"))]
_PRINTABLE = r"^[^\x00-\x1f\x7f]*$"


# --- which version trained on a record ----------------------------------------------------------
@dataclass(frozen=True)
class ReadRange:
    """Offsets [start, end) of one partition of `<ns>.rollouts` that `version` read."""

    version: str
    partition: int
    start: int
    end: int
    exact: bool  # the version is known to have trained on every offset of it not in `skipped`
    skipped: frozenset[int] = frozenset()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_ranges(versions: Iterable[ModelVersion], topic: str) -> list[ReadRange]:
    """The ranges of `topic` each version's lineage says it read (malformed lineage: none)."""
    out: list[ReadRange] = []
    for mv in versions:
        lineage = mv.lineage or {}
        offsets = lineage.get("kafka_offsets")
        if not isinstance(offsets, dict) or offsets.get("topic") != topic:
            continue
        parts: dict[int, tuple[int, int]] = {}
        for p, span in (offsets.get("partitions") or {}).items():
            if (
                isinstance(span, list)
                and len(span) == 2
                and all(_int(x) is not None for x in span)
                and str(p).isdigit()
            ):
                parts[int(p)] = (span[0], span[1])
        skipped_raw = lineage.get("skipped_offsets")
        skipped: dict[int, frozenset[int]] | None = None
        if isinstance(skipped_raw, dict):
            skipped = {
                int(p): frozenset(o for o in offs if _int(o) is not None)
                for p, offs in skipped_raw.items()
                if str(p).isdigit() and isinstance(offs, list)
            }
        size = sum(max(0, e - s) for s, e in parts.values())
        consumed = _int(mv.rollouts_consumed)
        for p, (s, e) in parts.items():
            if skipped is not None:
                out.append(ReadRange(mv.version, p, s, e, True, skipped.get(p, frozenset())))
            else:
                out.append(
                    ReadRange(mv.version, p, s, e, consumed is not None and consumed == size)
                )
    return out


def trained_by(
    ranges: Iterable[ReadRange], partition: int, offset: int
) -> tuple[str | None, str | None]:
    """(consumed_by, trained_by) of the record at (partition, offset) of the ranges' topic."""
    for r in ranges:
        if r.partition == partition and r.start <= offset < r.end:
            trained = r.exact and offset not in r.skipped
            return r.version, r.version if trained else None
    return None, None


# --- response models ----------------------------------------------------------------------------
class TurnPublic(BaseModel):
    request_id: str = Field(description="The generation of this model call.")
    model_version: str = Field(description="The version that sampled it.")
    reward: float | None = Field(
        description="Its own reward under the segment's reward_spec (its feedback only); null "
        "when the record does not give it."
    )
    components: dict[str, Any] | None = Field(description="Its reward components, if any.")
    sampled_tokens: int
    finish_reason: str | None
    generated_at: datetime | None


class SegmentPublic(BaseModel):
    request_id: str = Field(description="The segment's first request_id (the record's key).")
    relabel_run: str | None = Field(
        description="The `flywheel streams relabel` run of a relabelled copy; null when live."
    )
    reward_spec: str
    opened_by: str | None = Field(description="Why the segment opened (docs/AGENTS.md).")
    closed_by: str | None = Field(description="Why it closed.")
    turn_count: int
    prompt_tokens: int
    completion_tokens: int
    sampled_tokens: int = Field(description="Completion tokens the model sampled (loss mask 1).")
    reward: float
    components: dict[str, Any] | None
    outcome: str | None = Field(description="success | failure | abandoned, when it reached it.")
    outcome_reward: float | None
    protected_writes: int | None = Field(
        description="Under a reward spec with protected paths (sessions-v2): the session's calls "
        "that wrote a protected path such as the test file, as the record gives it (a segment "
        "carries it when above 0; then outcome_reward is the spec's protected_write). Null when "
        "the record does not give it."
    )
    versions: list[str] = Field(description="The versions that served its turns, in order.")
    turns: list[TurnPublic]
    trained_by: str | None = Field(
        description="The version that trained on this record, when known (module docstring)."
    )
    consumed_by: str | None = Field(
        description="The version whose training read this record (it trained on it unless it "
        "skipped it: then trained_by is null)."
    )
    generated_at: datetime
    labelled_at: datetime
    kafka_partition: int
    kafka_offset: int


class SessionPublic(BaseModel):
    session_id: str
    turns: int = Field(description="Model calls of its live segments (relabelled copies aside).")
    outcome: str | None = Field(description="The session's outcome, once a segment carries it.")
    versions: list[str] = Field(description="Every version that served it, in order of use.")
    segments: list[SegmentPublic]


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _distinct(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _segment_public(
    seg: SessionSegment, turns: list[SessionTurn], ranges: list[ReadRange]
) -> SegmentPublic:
    consumed, trained = trained_by(ranges, seg.kafka_partition, seg.kafka_offset)
    return SegmentPublic(
        request_id=seg.request_id,
        relabel_run=seg.relabel_run,
        reward_spec=seg.reward_spec,
        opened_by=seg.opened_by,
        closed_by=seg.closed_by,
        turn_count=seg.turn_count,
        prompt_tokens=seg.prompt_tokens,
        completion_tokens=seg.completion_tokens,
        sampled_tokens=seg.sampled_tokens,
        reward=seg.reward,
        components=seg.components,
        outcome=seg.outcome,
        outcome_reward=seg.outcome_reward,
        protected_writes=seg.protected_writes,
        versions=_distinct(t.model_version for t in turns),
        turns=[
            TurnPublic(
                request_id=t.request_id,
                model_version=t.model_version,
                reward=t.reward,
                components=t.components,
                sampled_tokens=t.sampled_tokens,
                finish_reason=t.finish_reason,
                generated_at=_utc(t.generated_at),
            )
            for t in turns
        ],
        trained_by=trained,
        consumed_by=consumed,
        generated_at=_utc(seg.generated_at),
        labelled_at=_utc(seg.labelled_at),
        kafka_partition=seg.kafka_partition,
        kafka_offset=seg.kafka_offset,
    )


# --- endpoint -----------------------------------------------------------------------------------
@router.get("/v1/sessions/{session_id}", response_model=SessionPublic)
def session_detail(
    session_id: Annotated[
        str,
        Path(min_length=1, max_length=128, pattern=_PRINTABLE, description="The session id."),
    ],
    _key: ReadKey,
    session: SessionDep,
    settings: SettingsDep,
    model: Annotated[
        str | None,
        Query(
            max_length=256,
            pattern=_PRINTABLE,
            description="Registered model whose versions trained on it (default: FLYWHEEL_MODEL_NAME).",
        ),
    ] = None,
) -> SessionPublic:
    """The session's segments in order, each with its turns, versions, rewards, outcome and trained_by."""
    segments = session.scalars(
        sa.select(SessionSegment)
        .where(SessionSegment.session_id == session_id)
        .order_by(
            SessionSegment.generated_at,
            SessionSegment.request_id,
            SessionSegment.relabel_run.is_not(None),
            SessionSegment.relabel_run,
        )
    ).all()
    if not segments:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"session {session_id!r} is unknown: no rollout record of it has been projected "
            f"(a segment appears once its label closes and `flywheel projections follow` reads it "
            f"from {settings.topic('rollouts')})",
        )
    turns: dict[str, list[SessionTurn]] = {}
    for t in session.scalars(
        sa.select(SessionTurn)
        .where(SessionTurn.session_id == session_id)
        .order_by(SessionTurn.record_key, SessionTurn.position)
    ):
        turns.setdefault(t.record_key, []).append(t)
    versions = session.scalars(
        sa.select(ModelVersion).where(ModelVersion.model == (model or settings.model_name))
    ).all()
    ranges = read_ranges(versions, settings.topic("rollouts"))
    out = [_segment_public(s, turns.get(s.record_key, []), ranges) for s in segments]
    live = [s for s in out if s.relabel_run is None]
    outcomes = [s.outcome for s in live if s.outcome is not None]
    return SessionPublic(
        session_id=session_id,
        turns=sum(s.turn_count for s in live),
        outcome=outcomes[-1] if outcomes else None,
        versions=_distinct(v for s in live for v in s.versions),
        segments=out,
    )
