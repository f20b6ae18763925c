"""Deployment events (contract, docs/DESIGN.md §Deployment events) and the log that carries them.

Every deployment decision (a version registered, a gate verdict, a canary step, a promotion, a
rollback, an alias moved in the MLflow UI, a replica synced) is one `DeploymentEvent` on
`<ns>.deployments`, keyed by model name, so all events of one model stay in order on one
partition. The topic is the source of truth; the SQL tables are projections of it
(app/projector/projector.py).

    from app.contracts.deployments import DeploymentEvent, DeploymentLog

    with DeploymentLog(settings) as log:
        partition, offset = log.publish(DeploymentEvent(
            type="promoted", model=settings.model_name, version="7", from_version="6",
            source="controller", actor="controller", reason="canary passed all steps"))
        for logged in log.read():           # from the beginning to the current end
            print(logged.offset, logged.event.type)

`publish` returns only after the broker acknowledged the event (acks=all, idempotent producer).
`replica_heartbeat` is a replica's report of what it serves (docs/DESIGN.md §Replica status).
A `Decision` is an event before its id and time (`Decision.to_event(model)` -> the event as a dict).
"""

from __future__ import annotations

import logging
import math
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.contracts.events import Timestamp
from app.infra.kafka import dumps, make_consumer, make_producer
from app.settings import Settings

log = logging.getLogger(__name__)

PUBLISHED = Counter(
    "flywheel_deployment_events_published_total",
    "Deployment events acknowledged by Kafka.",
    ["type"],
)
INVALID_EVENTS = Counter(
    "flywheel_deployment_events_invalid_total",
    "Records on the deployments topic that are not valid events (skipped).",
)

EventType = Literal[
    "version_registered",
    "gate_passed",
    "gate_failed",
    "canary_started",
    "traffic_shifted",
    "canary_paused",
    "canary_resumed",
    "promoted",
    "rolled_back",
    "aborted",
    "alias_changed",
    "replica_synced",
    "replica_sync_failed",
    "replica_heartbeat",  # a replica's periodic report of what it serves
]
Source = Literal["trainer", "controller", "api", "mlflow-ui", "replica", "import"]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)
SOURCES: tuple[str, ...] = get_args(Source)

VERSION_PATTERN = r"^[0-9]{1,32}$"  # MLflow model versions are decimal numbers (the controller orders them as ints)
# `details` keys the projections and folds read: (kind, limit), checked when present and not null, so a
# record every consumer decodes is one every consumer can apply (the SQL columns' types and sizes)
_DETAIL_FIELDS: dict[str, tuple[str, int]] = {
    "step": ("int", 2**31),
    "rollouts_consumed": ("int", 2**63),
    "run_id": ("str", 64),
    "reward_spec": ("str", 16),
    "url": ("str", 512),
    "status": ("str", 32),
    "alias": ("str", 16),
    "in_response_to": ("str", 64),
    "champion_version": ("version", 32),
    "candidate_version": ("version", 32),
}

REPLICA_TYPES = frozenset({"replica_synced", "replica_sync_failed", "replica_heartbeat"})
# types whose `version` may be absent: an alias can be deleted; a fresh replica serves nothing yet
_VERSION_OPTIONAL = frozenset({"alias_changed", "replica_heartbeat"})
_NEEDS_TRAFFIC = frozenset({"canary_started", "traffic_shifted"})


def _new_event_id() -> str:
    return uuid.uuid4().hex


def _utcnow() -> datetime:
    return datetime.now(UTC)


class DeploymentEvent(BaseModel):
    """One deployment decision. Unknown fields are rejected; `details` carries the rest.

    Conventions for `details` that the projections read (docs/DEPLOYMENTS.md has the table):
    version_registered: run_id, rollouts_consumed, reward_spec, plus any lineage (offsets, hashes);
    gate_passed/failed: the gate results; traffic_shifted/canary_*: `step` (int) and `analysis`
    (dict; its `candidate`/`champion` sub-dicts become the versions' online metrics);
    alias_changed: `alias` (champion|candidate); replica_*: `replica_id` (required), `url`,
    `slot` (champion|candidate), `champion_version`, `candidate_version`, `error`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: str = Field(
        default_factory=_new_event_id,
        min_length=1,
        max_length=64,
        description="Unique id; the projections dedupe on it. Reuse it when re-publishing the same decision.",
    )
    type: EventType = Field(description="What happened.")
    model: str = Field(
        min_length=1, max_length=128, description="Registered model name (the Kafka key)."
    )
    version: str | None = Field(
        None,
        pattern=VERSION_PATTERN,
        max_length=32,
        description="The version the event is about (the target of a move); an MLflow version number.",
    )
    from_version: str | None = Field(
        None,
        pattern=VERSION_PATTERN,
        max_length=32,
        description="The version it moves away from (parent, old champion, old alias target).",
    )
    traffic_pct: float | None = Field(
        None,
        ge=0.0,
        le=100.0,
        description="Candidate's share of sessions in percent, for canary events.",
    )
    source: Source = Field(
        description="Who decided: trainer, controller, api (operator verb), mlflow-ui (alias move), replica, "
        "import (`flywheel model import`)."
    )
    actor: str = Field("", max_length=128, description="Person or process behind the decision.")
    reason: str = Field("", max_length=4096, description="Why, in words an operator understands.")
    details: dict[str, Any] = Field(
        default_factory=dict,
        description="Type-specific payload (gate results, analysis, lineage, replica report).",
    )
    ts: Timestamp = Field(
        default_factory=_utcnow,
        description="When the decision was made (RFC 3339 with timezone; "
        "the interaction events' parser, held in UTC).",
    )

    @model_validator(mode="after")
    def _type_specific_fields(self) -> DeploymentEvent:
        if self.version is None and self.type not in _VERSION_OPTIONAL:
            raise ValueError(f"a {self.type} event needs `version`")
        if self.type in _NEEDS_TRAFFIC and self.traffic_pct is None:
            raise ValueError(
                f"a {self.type} event needs `traffic_pct` (the candidate's share, 0-100)"
            )
        if self.type == "alias_changed" and self.details.get("alias") not in (
            "champion",
            "candidate",
        ):
            raise ValueError(
                "an alias_changed event needs details.alias = 'champion' or 'candidate'"
            )
        if self.type in REPLICA_TYPES:
            rid = self.details.get("replica_id")
            if not isinstance(rid, str) or not 1 <= len(rid) <= 128:
                raise ValueError(f"a {self.type} event needs details.replica_id (1-128 chars)")
            if self.details.get("slot", "champion") not in ("champion", "candidate"):
                raise ValueError("details.slot must be 'champion' or 'candidate'")
        for key, (kind, limit) in _DETAIL_FIELDS.items():
            if self.details.get(key) is not None:
                problem = _detail_problem(self.details[key], kind, limit)
                if problem:
                    raise ValueError(f"details.{key} {problem}, got {self.details[key]!r:.100}")
        if "analysis" in self.details and not isinstance(self.details["analysis"], dict):
            raise ValueError("details.analysis must be an object")
        bad = _non_finite(self.details, "details")
        if bad:
            raise ValueError(
                f"{bad} is NaN or infinite; JSON cannot carry it (send null or a string)"
            )
        bad = _nul(self.model_dump(include={"actor", "reason", "details"}), "")
        if bad:
            raise ValueError(
                f"{bad.lstrip('.')} contains a NUL character, which PostgreSQL text and JSON cannot store"
            )
        return self

    def to_bytes(self) -> bytes:
        """The Kafka value: compact JSON (NaN/Infinity rejected)."""
        return dumps(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls, raw: bytes) -> DeploymentEvent:
        return cls.model_validate_json(raw)


def _detail_problem(value: Any, kind: str, limit: int) -> str | None:
    """What is wrong with one conventional `details` value (None: fine)."""
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be an integer"
        return None if 0 <= value < limit else f"must be in [0, {limit})"
    if not isinstance(value, str):
        return "must be a string"
    if kind == "version" and not re.fullmatch(VERSION_PATTERN, value):
        return "must be an MLflow version number (decimal digits)"
    return None if len(value) <= limit else f"must be at most {limit} characters"


def _non_finite(value: Any, path: str) -> str | None:
    """The path of the first NaN/Infinity inside `value`, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        items = ((f"{path}.{k}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((bad for p, v in items if (bad := _non_finite(v, p))), None)


def _nul(value: Any, path: str) -> str | None:
    """The path of the first string (or key) holding U+0000 inside `value`, or None."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        items = ((f"{path}.{k}", v) for k, v in value.items())
        bad_key = next((f"{path}.{k!r}" for k in value if isinstance(k, str) and "\x00" in k), None)
        if bad_key:
            return bad_key
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((bad for p, v in items if (bad := _nul(v, p))), None)


class Decision(BaseModel):
    """A deployment event before it has an id and a timestamp: what the controller, an operator
    verb (app/registry/operator.py) or the alias reconciliation wants to become an event.
    `to_event` adds `event_id`, `model` and `ts` and returns the event as a dict."""

    type: str = Field(description="A deployment event type (docs/DESIGN.md §Deployment events).")
    version: str | None = Field(None, description="The version the event is about (the new state).")
    from_version: str | None = Field(None, description="The version it moves away from, if any.")
    traffic_pct: float | None = Field(
        None, description="Candidate's share of sessions after the event, in %."
    )
    source: str = Field(
        "controller", description="trainer | controller | api | mlflow-ui | replica | import."
    )
    actor: str = Field(
        "controller", description="Who decided: 'controller', an API key name, 'mlflow-ui'."
    )
    reason: str = Field("", description="Human-readable why.")
    details: dict[str, Any] = Field(
        default_factory=dict, description="Structured extra data (analysis, step...)."
    )

    def to_event(
        self, model: str, ts: datetime | None = None, event_id: str | None = None
    ) -> dict[str, Any]:
        assert self.type in EVENT_TYPES, f"unknown deployment event type {self.type!r}"
        ts = ts or datetime.now(UTC)
        return {
            "event_id": event_id or uuid.uuid4().hex,
            "type": self.type,
            "model": model,
            "version": self.version,
            "from_version": self.from_version,
            "traffic_pct": self.traffic_pct,
            "source": self.source,
            "actor": self.actor,
            "reason": self.reason,
            "details": self.details,
            "ts": ts.isoformat().replace("+00:00", "Z"),
        }


@dataclass(frozen=True)
class LoggedEvent:
    """An event as it sits on the topic: its partition and offset make it addressable."""

    partition: int
    offset: int
    event: DeploymentEvent


class DeploymentLog:
    """Publish to and read from `<ns>.deployments`. Thread-safe for `publish`; close when done."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.topic = settings.topic("deployments")
        self._producer = None

    def publish(self, event: DeploymentEvent) -> tuple[int, int]:
        """Append `event` (keyed by its model); returns (partition, offset) once acknowledged.

        Raises kafka.errors.KafkaError (e.g. KafkaTimeoutError) when the broker does not ack
        within `kafka_produce_timeout`; the caller decides whether to retry with the same event.
        """
        if self._producer is None:
            # one event per call, awaited: a linger only delays it (replicas and the controller act on it)
            self._producer = make_producer(self.settings, profile="immediate")
        future = self._producer.send(self.topic, key=event.model, value=event.to_bytes())
        meta = future.get(timeout=max(1.0, self.settings.kafka_produce_timeout * 2))
        PUBLISHED.labels(event.type).inc()
        log.info(
            "deployment event %s %s v%s -> %s[%d]@%d",
            event.type,
            event.model,
            event.version,
            self.topic,
            meta.partition,
            meta.offset,
        )
        return meta.partition, meta.offset

    def read(
        self, until_end: bool = True, poll_timeout_s: float = 1.0, stall_timeout_s: float = 60.0
    ) -> Iterator[LoggedEvent]:
        """Every event from the beginning of the topic, in offset order per partition.

        `until_end=True` stops at the end offsets seen when the read starts (for rebuilds) and
        raises TimeoutError when it makes no progress for `stall_timeout_s`; `False` keeps
        following. Records that are not valid events are logged and skipped (counted on
        `flywheel_deployment_events_invalid_total`), identically on every read.
        """
        import time

        from kafka import TopicPartition

        consumer = make_consumer(
            self.settings, group_id=None, consumer_timeout_ms=int(poll_timeout_s * 1000)
        )
        try:
            parts = consumer.partitions_for_topic(self.topic)
            assert parts, (
                f"topic {self.topic} does not exist; create it with `flywheel kafka start` (ensure_topics)"
            )
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            end = consumer.end_offsets(tps) if until_end else {}
            remaining = {tp for tp in tps if end.get(tp, 1) > 0} if until_end else set(tps)
            last_progress = time.monotonic()
            while remaining:
                batch = consumer.poll(timeout_ms=int(poll_timeout_s * 1000))
                if batch:
                    last_progress = time.monotonic()
                elif until_end and time.monotonic() - last_progress > stall_timeout_s:
                    raise TimeoutError(
                        f"reading {self.topic}: no progress for {stall_timeout_s:.0f}s before the end "
                        f"offsets { ({tp.partition: o for tp, o in end.items()}) }; is the broker up?"
                    )
                for tp, records in batch.items():
                    for rec in records:
                        if until_end and rec.offset >= end[tp]:
                            break
                        logged = decode_record(rec.partition, rec.offset, rec.value)
                        if logged is not None:
                            yield logged
                if until_end:
                    remaining = {tp for tp in remaining if consumer.position(tp) < end[tp]}
        finally:
            consumer.close()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(timeout=self.settings.kafka_produce_timeout)
            self._producer.close(timeout=self.settings.kafka_produce_timeout)
            self._producer = None

    def __enter__(self) -> DeploymentLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InvalidRecord(ValueError):
    """A record of the deployment log that is not a valid event: `reason` (invalid_json | invalid_event)
    and `errors` ([{"field", "message"}]) as they go into a DLQ envelope (app/contracts/deadletter.py)."""

    def __init__(self, reason: str, errors: list[dict[str, str]]):
        self.reason, self.errors = reason, errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


def decode_event(value: bytes | None) -> DeploymentEvent:
    """The event in a record value; raises InvalidRecord saying why it is not one."""
    try:
        return DeploymentEvent.from_bytes(value or b"")
    except ValidationError as exc:
        errors = [
            {"field": ".".join(map(str, e["loc"])) or "(event)", "message": e["msg"]}
            for e in exc.errors(include_url=False)
        ]
        json_error = any(e["type"] == "json_invalid" for e in exc.errors(include_url=False))
        raise InvalidRecord("invalid_json" if json_error else "invalid_event", errors) from None


def decode_record(partition: int, offset: int, value: bytes | None) -> LoggedEvent | None:
    """A LoggedEvent, or None (logged and counted) when the record is not a valid event.

    Every reader of the log decodes with this (or `decode_event`), so they all skip the same records;
    the consumers that follow the log also dead-letter them (docs/DEPLOYMENTS.md, "Bad records")."""
    try:
        return LoggedEvent(partition, offset, decode_event(value))
    except InvalidRecord as exc:
        INVALID_EVENTS.inc()
        log.error("skipping invalid record at deployments[%d]@%d: %s", partition, offset, exc)
        return None
