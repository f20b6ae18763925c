"""The dead-letter topic `<ns>.dlq`: where a consumer puts a record it cannot use, and goes on.

Every consumer that reads a Flywheel topic (streams, trainer, projector, replica sync agent,
controller) treats a record it cannot decode or apply the same way: the record goes to the
DLQ with its reason and its original bytes, a Prometheus counter counts it, and the consumer
continues with the next record. No record can stop or crash-loop a role.

Envelope (JSON, no key; the same fields as the streams worker's `app.contracts.rollouts.DlqRecord`):

    {"reason": "invalid_json", "errors": [{"field": "(record)", "message": "..."}],
     "consumer": "projector", "topic": "flywheel.deployments", "partition": 0, "offset": 17,
     "key_b64": "...", "value_b64": "...", "detected_at": "2026-11-21T10:00:00.000000Z"}

`value_b64` is the record value exactly as it was on its topic (base64), so it can be
inspected or re-published after a fix.

    dead = DeadLetters(settings, consumer="projector")
    dead.send(rec, "invalid_event", [{"field": "type", "message": "..."}])   # rec: a consumed record
    dead.close()

`send` waits for the broker's acknowledgement; when the broker does not take it (it is the
same broker the record came from, so this is an outage, not a bad record) the record is
logged in full instead and counted with `delivered="false"`: the consumer still goes on.

Delivery is at least once: one `DeadLetters` sends a record (topic, partition, offset) once,
but a consumer that replays its topic from the beginning after a restart (the controller, a
replica) dead-letters its bad records again. `(consumer, topic, partition, offset)`
identifies a dead letter; readers of the DLQ dedupe on it.
"""

from __future__ import annotations

import base64
import logging
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter

from app.contracts.events import format_ts
from app.settings import Settings

log = logging.getLogger(__name__)

DEAD_LETTERS = Counter(
    "flywheel_dead_letters_total",
    "Records a consumer could not use, by consumer and reason (delivered=false: the DLQ "
    "itself was unavailable and the record was logged instead)",
    ["consumer", "reason", "delivered"],
)


def envelope(
    consumer: str,
    reason: str,
    errors: list[dict[str, Any]],
    topic: str,
    partition: int | None,
    offset: int | None,
    key: bytes | None,
    value: bytes | None,
) -> dict[str, Any]:
    """The DLQ record of one unusable record (see the module docstring)."""
    return {
        "reason": reason,
        "errors": errors,
        "consumer": consumer,
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key_b64": base64.b64encode(key).decode() if key is not None else None,
        "value_b64": base64.b64encode(value).decode() if value is not None else None,
        "detected_at": format_ts(datetime.now(UTC)),
    }


def error(field: str, message: str) -> list[dict[str, Any]]:
    """The `errors` list of a single problem."""
    return [{"field": field, "message": message[:2000]}]


class DeadLetters:
    """A kafka-python producer for `<ns>.dlq`, created on first use. Thread-safe (the producer is)."""

    def __init__(self, settings: Settings, consumer: str):
        self.settings, self.consumer = settings, consumer
        self.topic = settings.topic("dlq")
        self._producer = None
        self._sent: set[tuple[str, int | None, int | None]] = (
            set()
        )  # (topic, partition, offset) delivered

    def send(self, rec: Any, reason: str, errors: list[dict[str, Any]]) -> bool:
        """Dead-letter the consumed record `rec` (its topic, partition, offset, key, value); True once the
        broker acknowledged it, False when it was logged instead."""
        where = (rec.topic, rec.partition, rec.offset)
        if where in self._sent:  # read again (a consumer re-reading its topic): already on the DLQ
            return True
        key = rec.key.encode() if isinstance(rec.key, str) else rec.key
        delivered = self.send_envelope(
            envelope(
                self.consumer, reason, errors, rec.topic, rec.partition, rec.offset, key, rec.value
            )
        )
        if delivered:
            self._sent.add(where)
        return delivered

    def send_envelope(self, env: dict[str, Any]) -> bool:
        from kafka.errors import KafkaError

        from app.infra.kafka import dumps, make_producer

        log.error(
            "%s: dead-lettering %s[%s]@%s (%s): %s",
            self.consumer,
            env["topic"],
            env["partition"],
            env["offset"],
            env["reason"],
            "; ".join(f"{e['field']}: {e['message']}" for e in env["errors"])[:1000],
        )
        try:
            if self._producer is None:
                self._producer = make_producer(self.settings, profile="immediate")
            self._producer.send(self.topic, value=dumps(env)).get(
                timeout=max(1.0, self.settings.kafka_produce_timeout * 2)
            )
        except KafkaError as exc:
            DEAD_LETTERS.labels(self.consumer, env["reason"], "false").inc()
            log.error(
                "%s: the dead-letter topic %s is unavailable (%s); the record is skipped, here in full: %s",
                self.consumer,
                self.topic,
                exc,
                env,
            )
            return False
        DEAD_LETTERS.labels(self.consumer, env["reason"], "true").inc()
        return True

    def close(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            producer.close(timeout=self.settings.kafka_produce_timeout)
