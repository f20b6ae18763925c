"""The sessions projection of `<ns>.rollouts`: each session's segments and their turns in SQL.

Every rollout record has a `session_id` (app/contracts/rollouts.py `Rollout`). A record is one
segment of its session: a multi-turn record (streams/ledger.py) carries its model calls in
`turns`; a one-call record (turns None: `/v1/complete`, or a one-turn segment) is a segment of
one turn, the record itself. Two tables hold them (migrations 0003 and 0004):

    session_segments  one row per record, keyed by its Kafka key (`request_id`, or
                      `<request_id>|<spec>` for a relabelled record): the first request_id,
                      opened_by/closed_by, turn and token counts, reward, reward_spec, outcome,
                      protected_writes, relabel_run, and its (partition, offset) on the topic
    session_turns     one row per model call: request_id, model_version, its own reward,
                      components, sampled tokens

    decode_rollout(value)           # the Rollout in a record value, or InvalidRecord
    apply_rollout(session, logged)  # one record, idempotent: a key seen before changes nothing
    reset_sessions(session)         # empty both tables (the rebuild's reset)

The projector (app/projector/projector.py) follows and rebuilds this projection with the
deployment log's: the same consumer group, batches, savepoints and dead letters. The topic is
compacted and at-least-once, so a record may come again (a worker's re-delivery after a crash:
same fields, another offset); the first delivery of a key is kept, which is the one the trainer
trains on (it skips later copies as duplicates). Every value comes from the record, never the
clock, so a rebuild reproduces the rows (offsets aside, for keys compaction has collapsed).

`protected_writes` is the record's as it gives it: under a reward spec with protected paths
(streams/reward.py, e.g. `sessions-v2`), the calls that wrote a protected path such as the test
file (a session's segment carries its session's count, when above 0: the ledger's records sent
with the outcome, whose `outcome_reward` it decided); None when the record does not give it. A
segment with a count is a session that weakened its tests (docs/ROLLOUT.md "The agentic hack").

A turn's own reward: `TurnSpan.reward` of a multi-turn record (None when the record does not
give it); for a one-call record, the record's reward less its `outcome_reward` (the session
outcome's share), so the turns of a session are comparable across both shapes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.contracts.deployments import InvalidRecord
from app.contracts.rollouts import Rollout
from app.db.models import SessionSegment, SessionTurn
from app.settings import Settings

log = logging.getLogger(__name__)

SESSION_TABLES = ("session_turns", "session_segments")  # referencing table first


@dataclass(frozen=True)
class LoggedRollout:
    """A rollout record as it sits on `<ns>.rollouts`."""

    partition: int
    offset: int
    rollout: Rollout

    @property
    def key(self) -> str:
        """The record's key on the topic (docs/DESIGN.md §Topics): its identity."""
        r = self.rollout
        return r.request_id if r.relabel_run is None else f"{r.request_id}|{r.reward_spec}"


def decode_rollout(value: bytes | None) -> Rollout:
    """The rollout in a record value; raises InvalidRecord (invalid_json | invalid_rollout)."""
    try:
        return Rollout.model_validate_json(value or b"")
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        errors = [
            {"field": ".".join(map(str, e["loc"])) or "(record)", "message": e["msg"]} for e in errs
        ]
        json_error = any(e["type"] == "json_invalid" for e in errs)
        raise InvalidRecord("invalid_json" if json_error else "invalid_rollout", errors) from None


# --- record -> rows ---------------------------------------------------------------------------
# widths of the columns a record's free-form strings go into (app/db/models.py); checked here
# so that a value too long fails the same way on SQLite (which does not enforce widths) and
# PostgreSQL: the record is refused (apply_failed), not truncated
_WIDTHS = {
    "key": 256,
    "model_version": 32,
    "reward_spec": 64,
    "opened_by": 32,
    "closed_by": 32,
    "finish_reason": 16,
}


def _fit(name: str, value: str | None) -> str | None:
    if value is not None and len(value) > _WIDTHS[name]:
        raise ValueError(f"{name} {value[:40]!r}... is longer than {_WIDTHS[name]} characters")
    return value


def _ts(value: str | None, name: str) -> datetime | None:
    """An RFC 3339 timestamp of the record as an aware datetime (UTC when it names no zone)."""
    if value is None:
        return None
    try:
        ts = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{name} {value[:40]!r} is not an RFC 3339 timestamp") from None
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def _components(value: Any) -> dict[str, Any] | None:
    return None if value is None else value.model_dump()


def record_rows(logged: LoggedRollout) -> tuple[SessionSegment, list[SessionTurn]]:
    """The rows of one record: its segment and its turns (module docstring)."""
    r, key = logged.rollout, _fit("key", logged.key)
    if r.turns:
        turns = [
            SessionTurn(
                record_key=key,
                position=i,
                session_id=r.session_id,
                request_id=t.request_id,
                model_version=_fit("model_version", t.model_version),
                reward=t.reward,
                components=_components(t.components),
                sampled_tokens=t.end - t.start,
                finish_reason=_fit("finish_reason", t.finish_reason),
                generated_at=_ts(t.generated_at, f"turns[{i}].generated_at"),
            )
            for i, t in enumerate(r.turns)
        ]
    else:
        turns = [
            SessionTurn(
                record_key=key,
                position=0,
                session_id=r.session_id,
                request_id=r.request_id,
                model_version=_fit("model_version", r.model_version),
                reward=r.reward - (r.outcome_reward or 0.0),
                components=_components(r.components),
                sampled_tokens=len(r.completion_tokens),
                finish_reason=_fit("finish_reason", r.finish_reason),
                generated_at=_ts(r.generated_at, "generated_at"),
            )
        ]
    segment = SessionSegment(
        record_key=key,
        session_id=r.session_id,
        request_id=r.request_id,
        relabel_run=r.relabel_run,
        reward_spec=_fit("reward_spec", r.reward_spec),
        model_version=_fit("model_version", r.model_version),
        opened_by=_fit("opened_by", r.segment_opened_by),
        closed_by=_fit("closed_by", r.segment_closed_by),
        turn_count=len(turns),
        prompt_tokens=len(r.prompt_tokens),
        completion_tokens=len(r.completion_tokens),
        sampled_tokens=len(r.completion_tokens) if r.loss_mask is None else sum(r.loss_mask),
        reward=r.reward,
        components=_components(r.components),
        outcome=r.outcome,
        outcome_reward=r.outcome_reward,
        protected_writes=r.protected_writes,
        generated_at=_ts(r.generated_at, "generated_at"),
        labelled_at=_ts(r.labelled_at, "labelled_at"),
        kafka_partition=logged.partition,
        kafka_offset=logged.offset,
    )
    return segment, turns


def apply_rollout(session: Session, logged: LoggedRollout) -> bool:
    """Project one record inside `session` (the caller commits). False (and nothing changes)
    when its key was projected before: a re-delivery, or the same record read again."""
    if session.get(SessionSegment, logged.key) is not None:
        return False
    segment, turns = record_rows(logged)
    session.add(segment)
    session.flush()  # the segment before its turns (they reference it)
    session.add_all(turns)
    session.flush()
    return True


# --- reset and reading the topic ----------------------------------------------------------------
def reset_sessions(session: Session) -> None:
    """Delete every row of the sessions projection inside the session's transaction (PostgreSQL
    truncates them with the deployment tables: app/projector/projector.py `reset_projections`)."""
    for table in SESSION_TABLES:
        session.execute(sa.text(f"DELETE FROM {table}"))


def read_rollouts(
    settings: Settings, poll_timeout_s: float = 1.0, stall_timeout_s: float = 60.0
) -> Iterator[tuple[Any, LoggedRollout | InvalidRecord]]:
    """(Kafka record, its rollout or why it is not one) for every record of `<ns>.rollouts`
    from the beginning to the end offsets seen at the start; TimeoutError after
    `stall_timeout_s` without progress."""
    import time

    from kafka import TopicPartition

    from app.infra.kafka import make_consumer

    topic = settings.topic("rollouts")
    consumer = make_consumer(settings, group_id=None)
    try:
        parts = consumer.partitions_for_topic(topic)
        assert parts, f"topic {topic} does not exist; create it with `flywheel kafka topics`"
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        remaining = {tp for tp in tps if end[tp] > 0}
        last_progress = time.monotonic()
        while remaining:
            batch = consumer.poll(timeout_ms=int(poll_timeout_s * 1000))
            if batch:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > stall_timeout_s:
                raise TimeoutError(
                    f"reading {topic}: no progress for {stall_timeout_s:.0f}s before the end "
                    f"offsets { ({tp.partition: o for tp, o in end.items()}) }; is the broker up?"
                )
            for tp, records in batch.items():
                for rec in records:
                    if rec.offset >= end[tp]:
                        break
                    yield rec, logged_rollout(rec)
            remaining = {tp for tp in remaining if consumer.position(tp) < end[tp]}
    finally:
        consumer.close()


def logged_rollout(rec: Any) -> LoggedRollout | InvalidRecord:
    """A kafka-python record of `<ns>.rollouts` as a LoggedRollout, or why it is not one."""
    try:
        return LoggedRollout(rec.partition, rec.offset, decode_rollout(rec.value))
    except InvalidRecord as exc:
        return exc


def session_rows(session: Session) -> dict[str, list[dict[str, Any]]]:
    """Every row of the sessions projection in primary-key order (to compare databases)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for model in (SessionSegment, SessionTurn):
        table = model.__table__
        rows = session.execute(sa.select(table).order_by(*table.primary_key.columns)).mappings()
        out[table.name] = [{k: _plain(v) for k, v in r.items()} for r in rows]
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    if isinstance(value, dict):
        return json.loads(json.dumps(value, sort_keys=True))
    return value
