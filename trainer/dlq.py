"""Dead letters of the trainer: refused rollouts go to `<ns>.dlq`, in streams' `DlqRecord` envelope.

The envelope is app/contracts/rollouts.py `DlqRecord` (the one the streams workers write): `reason`
(trainer/validate.py `REFUSAL_REASONS`), `errors` (`[{"field", "message"}]`; a step failure
adds `"exception"`), the source `topic`/`partition`/`offset`, and the original key and value
as base64. A value larger than `max_value_bytes` is not copied (`value_b64` null, its size and
sha256 in `errors[0]`): it stays on the compacted rollouts topic at that offset, and the
envelope stays under the broker's record limit. The same goes for an envelope the broker
refuses as too large.

Delivery: `send` is asynchronous; `flush` (called before every state save, trainer/loop.py)
waits for the acknowledgements and re-sends failures, and raises if some still fail. The
saved Kafka positions therefore never pass a refused record whose dead letter was not
acknowledged: a trainer that dies re-reads it and dead-letters it again (at least once;
readers of the DLQ dedupe by topic/partition/offset).

Logging is rate-limited (`RateLimitedLog`): a flood of bad records logs one line per reason
per interval, with the number suppressed.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Source:
    """Where a record came from, with its original bytes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def envelope(
    src: Source,
    reason: str,
    errors: list[dict[str, Any]],
    max_value_bytes: int,
    *,
    include_value: bool = True,
) -> bytes:
    """The DLQ record (streams' `DlqRecord`) for `src`, as JSON bytes."""
    from app.contracts.rollouts import DlqRecord
    from app.infra.kafka import dumps

    errors = [dict(e) for e in errors]
    value_b64 = None
    if src.value is not None:
        if include_value and len(src.value) <= max_value_bytes:
            value_b64 = base64.b64encode(src.value).decode()
        else:
            errors[0].update(
                value_omitted=f"value of {len(src.value)} bytes not copied (limit {max_value_bytes}); "
                f"it stays at {src.topic}:{src.partition}:{src.offset}",
                value_bytes=len(src.value),
                value_sha256=hashlib.sha256(src.value).hexdigest(),
            )
    record = DlqRecord(
        reason=reason,
        errors=errors,
        topic=src.topic,
        partition=src.partition,
        offset=src.offset,
        key_b64=base64.b64encode(src.key).decode() if src.key is not None else None,
        value_b64=value_b64,
        detected_at=datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    )
    return dumps(record.model_dump())


@dataclass
class _Letter:
    src: Source
    reason: str
    errors: list[dict[str, Any]]
    future: Any = None
    include_value: bool = True
    attempts: int = 0


class DeadLetters:
    """Sends refused records to the DLQ topic and makes sure they arrived before positions pass them."""

    def __init__(
        self,
        producer: Any,
        topic: str,
        max_value_bytes: int,
        *,
        flush_timeout_s: float = 30.0,
        max_attempts: int = 3,
        reap_at: int = 10_000,
    ):
        self.producer, self.topic = producer, topic
        self.reap_at = (
            reap_at  # unacknowledged letters kept in memory before acknowledged ones are dropped
        )
        self.max_value_bytes = max_value_bytes
        self.flush_timeout_s, self.max_attempts = flush_timeout_s, max_attempts
        self._unacked: list[_Letter] = []

    def send(self, src: Source, reason: str, errors: list[dict[str, Any]]) -> None:
        letter = _Letter(src, reason, errors)
        self._send(letter)
        self._unacked.append(letter)
        if (
            len(self._unacked) >= self.reap_at
        ):  # a flood between two saves: forget the acknowledged ones
            self._unacked = [
                x for x in self._unacked if not (x.future.is_done and x.future.succeeded())
            ]
            if len(self._unacked) >= self.reap_at:
                self.flush()

    def _send(self, letter: _Letter) -> None:
        from kafka.errors import MessageSizeTooLargeError

        letter.attempts += 1
        try:
            letter.future = self.producer.send(
                self.topic,
                value=envelope(
                    letter.src,
                    letter.reason,
                    letter.errors,
                    self.max_value_bytes,
                    include_value=letter.include_value,
                ),
            )
        except (
            MessageSizeTooLargeError
        ):  # over the producer's max_request_size: send it without the value
            letter.include_value = False
            letter.future = self.producer.send(
                self.topic,
                value=envelope(
                    letter.src,
                    letter.reason,
                    letter.errors,
                    self.max_value_bytes,
                    include_value=False,
                ),
            )

    def pending(self) -> int:
        return len(self._unacked)

    def flush(self) -> None:
        """Wait for every dead letter sent so far; re-send failures; raise if some still fail."""
        from kafka.errors import MessageSizeTooLargeError

        while self._unacked:
            self.producer.flush(self.flush_timeout_s)
            failed = []
            for letter in self._unacked:
                if not letter.future.is_done or letter.future.failed():
                    failed.append(letter)
            self._unacked = []
            for letter in failed:
                exc = (
                    letter.future.exception
                    if letter.future.is_done
                    else TimeoutError("not acknowledged")
                )
                if letter.attempts >= self.max_attempts:
                    raise RuntimeError(
                        f"dead letter for {letter.src.topic}:{letter.src.partition}:{letter.src.offset} "
                        f"not delivered to {self.topic} after {letter.attempts} attempts: {exc!r}"
                    )
                if isinstance(exc, MessageSizeTooLargeError):
                    letter.include_value = (
                        False  # the broker's record limit: keep the pointer, drop the copy
                    )
                log.warning(
                    "re-sending dead letter %s:%d:%d (%r)",
                    letter.src.topic,
                    letter.src.partition,
                    letter.src.offset,
                    exc,
                )
                self._send(letter)
                self._unacked.append(letter)


@dataclass
class RateLimitedLog:
    """At most one warning per key every `interval_s`, then how many were suppressed."""

    interval_s: float = 10.0
    _last: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -float("inf")) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        n = self._suppressed.pop(key, 0)
        self._last[key] = now
        log.warning(
            msg + (f" ({n} more {key} suppressed in the last {self.interval_s:g}s)" if n else ""),
            *args,
        )
        return True
