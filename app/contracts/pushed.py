"""Deltas pushed through Kafka: the trainer writes each small delta to `<ns>.deltas` just before
its `version_registered`, so a replica has the bytes when the deployment log tells it to sync,
instead of downloading them from MLflow (one HTTP round trip through the registry's artifact
proxy, made by every replica at the same moment).

    publish_delta(settings, PushedDelta(model, "8", "7", "delta-from-7.fwd", sha256, blob))  # the trainer
    store = PushedDeltas(max_bytes=64 << 20)                      # the replica (app/replica/pushed_store.py)
    store.offer(PushedDelta.from_record(rec, model))             # while following the topic
    blob = store.get("8", "delta-from-7.fwd")                    # None: download it as before

Record: key = model name; value = the delta file's bytes, exactly the `delta-from-<parent>.fwd`
artifact in MLflow; headers `model`, `version`, `parent_version`, `file`, `sha256`. Only deltas up
to `FLYWHEEL_DELTA_PUSH_MAX_BYTES` are pushed (anchors never); the topic keeps a day of them.

Trust: none is needed. Pushed bytes take the place of the downloaded file and nothing else: their
size and SHA-256 must equal the ones in the deployment log's artifact hint (app/contracts/hints.py),
then the codec checks the held weights against the delta's base hash, hashes every decoded tensor
and the checkpoint, exactly as for a download. A pushed delta that fails is dropped and the file is
downloaded from MLflow; MLflow stays the source of truth, Kafka only carries a copy.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from app.settings import Settings

log = logging.getLogger(__name__)

HEADERS = ("model", "version", "parent_version", "file", "sha256")


@dataclass(frozen=True)
class PushedDelta:
    model: str
    version: str
    parent_version: str
    file: str
    sha256: str  # what the publisher says; checked against the deployment log's hint before use
    data: bytes

    def record(self) -> tuple[str, bytes, list[tuple[str, bytes]]]:
        """(key, value, headers) of the Kafka record."""
        return self.model, self.data, [(h, str(getattr(self, h)).encode()) for h in HEADERS]

    @staticmethod
    def problem(rec: Any) -> str | None:
        """Why a consumed record of `<ns>.deltas` is not a pushed delta (None: it is one)."""
        headers = dict(rec.headers or [])
        missing = [h for h in HEADERS if not headers.get(h)]
        if missing or rec.value is None:
            return f"missing {', '.join(missing or ['value'])}"
        try:
            version, parent = headers["version"].decode(), headers["parent_version"].decode()
            sha = headers["sha256"].decode()
        except (UnicodeDecodeError, AttributeError):
            return "headers are not UTF-8 text"
        if not (version.isdigit() and parent.isdigit()):
            return f"version {version!r} / parent_version {parent!r} are not MLflow version numbers"
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            return f"sha256 {sha[:80]!r} is not 64 lower-case hex digits"
        return None

    @classmethod
    def from_record(cls, rec: Any, model: str | None = None) -> PushedDelta | None:
        """The delta in a consumed record, or None (logged) when it is not one (`problem`), or it is
        another model's when `model` is given."""
        problem = cls.problem(rec)
        if problem is not None:
            log.warning(
                "%s@%s offset %s is not a pushed delta (%s); ignored",
                rec.topic,
                rec.partition,
                rec.offset,
                problem,
            )
            return None
        headers = {k: v.decode() for k, v in (rec.headers or [])}
        if model is not None and headers["model"] != model:
            return None
        return cls(data=bytes(rec.value), **{h: headers[h] for h in HEADERS})


def publish_delta(settings: Settings, delta: PushedDelta, producer: Any = None) -> bool:
    """Write one delta to `<ns>.deltas` and wait for the broker's acknowledgement. Returns False
    (logged) when it is larger than `settings.delta_push_max_bytes`, its bytes do not have its
    `sha256`, or Kafka fails: replicas then download it from MLflow, as without pushing."""
    from kafka.errors import KafkaError

    from app.infra.kafka import make_producer

    version, file = delta.version, delta.file
    if len(delta.data) > settings.delta_push_max_bytes:
        log.info(
            "v%s: delta of %d bytes is over FLYWHEEL_DELTA_PUSH_MAX_BYTES (%d); replicas download it",
            version,
            len(delta.data),
            settings.delta_push_max_bytes,
        )
        return False
    if hashlib.sha256(delta.data).hexdigest() != delta.sha256:
        log.error("v%s: %s does not have its published SHA-256; not pushed", version, file)
        return False
    key, value, headers = delta.record()
    own = producer is None
    producer = producer or make_producer(settings, profile="immediate")
    try:
        producer.send(settings.topic("deltas"), key=key, value=value, headers=headers).get(
            timeout=max(1.0, settings.kafka_produce_timeout * 2)
        )
        return True
    except KafkaError as exc:
        log.warning(
            "v%s: could not push %s to Kafka (%s); replicas download it", version, file, exc
        )
        return False
    finally:
        if own:
            producer.close()
