"""MLflow webhooks: registration on the server (by the controller), and verification of
deliveries (by the API's receiver, POST /v1/hooks/mlflow, app/api/routes/hooks.py).

MLflow 3.x signs each delivery Standard-Webhooks style (mlflow/webhooks/delivery.py):

    X-MLflow-Delivery-Id: <uuid4>
    X-MLflow-Timestamp:   <unix seconds>
    X-MLflow-Signature:   v1,<base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}"))>

`check_headers` validates the three headers before the body is read (present, a delivery id of
at most 128 safe characters, a timestamp that is finite unix seconds and inside the replay
window); `check_signature` then checks the signature over the raw body bytes in constant time;
`verify` does both. Every refusal is `WebhookRejected` (401) with the reason.

`DeliveryDedupe` remembers delivery ids for as long as a replay of them could pass `verify`
(MLflow retries a delivery with the same id, timestamp and body on 429/5xx; the signature binds
id and timestamp, so a replay can only carry the original timestamp). It is bounded: when full it
refuses new deliveries (the receiver answers 503 + Retry-After) instead of forgetting ids.

`ensure_webhook` registers (or updates) one webhook named `flywheel-<model>` for the alias
events (`model_version_alias.created`, `model_version_alias.deleted`, the two alias events
MLflow 3.17 emits; webhooks are server-wide, so the receiver filters on the model name).
The MLflow server must allow the receiver's URL: `MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https`
and `MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true` for a loopback receiver, and it caches the
webhook list for `MLFLOW_WEBHOOK_CACHE_TTL` seconds (default 60).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
ALIAS_EVENTS = ("model_version_alias.created", "model_version_alias.deleted")


class WebhookRejected(ValueError):
    def __init__(self, message: str, status: int = 401):
        super().__init__(message)
        self.status = status


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The `X-MLflow-Signature` value MLflow sends for this delivery."""
    content = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


_DELIVERY_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_UNIX_SECONDS = re.compile(r"\d{1,15}(\.\d{1,9})?")


@dataclass(frozen=True)
class DeliveryHeaders:
    delivery_id: str
    timestamp: str  # as sent (it is part of the signed content)
    ts: float  # the same, as unix seconds
    signature: str


def parse_timestamp(value: str) -> float:
    """`X-MLflow-Timestamp` as finite unix seconds; WebhookRejected with the reason otherwise."""
    text = value.strip()
    if not text:
        raise WebhookRejected(f"{TIMESTAMP_HEADER} is empty; MLflow sends unix seconds")
    try:
        ts = float(text)
    except ValueError:
        raise WebhookRejected(
            f"{TIMESTAMP_HEADER} {value[:40]!r} is not a number; MLflow sends unix seconds"
        ) from None
    if not math.isfinite(ts):
        raise WebhookRejected(
            f"{TIMESTAMP_HEADER} {value[:40]!r} is not a finite number; MLflow sends unix seconds"
        )
    if not _UNIX_SECONDS.fullmatch(text):
        raise WebhookRejected(
            f"{TIMESTAMP_HEADER} {value[:40]!r} is not plain unix seconds (digits, optional fraction)"
        )
    return ts


def check_headers(
    headers: dict[str, str], window_s: float, now: float | None = None
) -> DeliveryHeaders:
    """The delivery headers, checked before the body is read; WebhookRejected (401) with the reason."""
    h = {k.lower(): v for k, v in headers.items()}
    missing = [
        x for x in (DELIVERY_ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER) if x.lower() not in h
    ]
    if missing:
        raise WebhookRejected(
            f"missing {', '.join(missing)}; register the webhook with the shared secret "
            "(FLYWHEEL_WEBHOOK_SECRET)"
        )
    delivery_id, timestamp, signature = (
        h[x.lower()] for x in (DELIVERY_ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)
    )
    if not _DELIVERY_ID.fullmatch(delivery_id):
        raise WebhookRejected(
            f"{DELIVERY_ID_HEADER} must be 1-128 characters of letters, digits and ._:- "
            "(MLflow sends a uuid)"
        )
    if not signature.strip():
        raise WebhookRejected(f"{SIGNATURE_HEADER} is empty")
    ts = parse_timestamp(timestamp)
    age = (time.time() if now is None else now) - ts
    if abs(age) > window_s:
        raise WebhookRejected(
            f"timestamp {timestamp} is {age:.0f}s away from now, outside the {window_s:g}s "
            "replay window"
        )
    return DeliveryHeaders(delivery_id, timestamp, ts, signature)


def check_signature(secret: str, delivery: DeliveryHeaders, body: bytes) -> None:
    expected = sign(secret, delivery.delivery_id, delivery.timestamp, body)
    if not any(
        hmac.compare_digest(expected, part.strip()) for part in _signatures(delivery.signature)
    ):
        raise WebhookRejected("signature does not match (wrong secret or modified body)")


def verify(
    secret: str, headers: dict[str, str], body: bytes, window_s: float, now: float | None = None
) -> str:
    """Return the delivery id of a genuine, fresh delivery; raise WebhookRejected otherwise."""
    delivery = check_headers(headers, window_s, now)
    check_signature(secret, delivery, body)
    return delivery.delivery_id


def _signatures(header: str) -> list[str]:
    """Standard Webhooks allows several space-separated signatures (key rotation); at most 8 are tried."""
    return [s for s in header.split(" ") if s][:8]


class Seen(Enum):
    NEW = "new"  # not seen: process it, then `done` (or `forget` if that failed)
    DUPLICATE = "duplicate"  # processed before: answer 200 and do nothing
    IN_PROGRESS = "in_progress"  # being processed now: answer 503, MLflow retries
    FULL = "full"  # no room: answer 503 + Retry-After (`retry_after_s`)


class DeliveryDedupe:
    """Delivery ids, kept while a replay of them could still pass `verify`, in bounded memory.

    A delivery with timestamp `ts` passes the window check while |now - ts| <= window, and a
    replay carries the same `ts` (it is signed), so an id is kept until now > ts + window + skew
    on the wall clock, and at least 2 x window + skew after it arrived on the monotonic clock
    (the same bound whatever `ts` was, and safe against wall-clock steps up to `skew`). Ids are
    evicted only when both have passed. At most `max_ids` are kept (measured: ~210 bytes per id
    plus the id string, at most ~400 bytes with a 128-character id); when
    that many are live, `begin` answers FULL rather than forgetting one that could be replayed.
    """

    def __init__(self, window_s: float, skew_s: float = 60.0, max_ids: int = 20_000):
        self.window_s, self.skew_s, self.max_ids = window_s, skew_s, max_ids
        self.retention_s = 2 * window_s + skew_s
        # id -> (monotonic expiry, wall expiry, done); insertion order = monotonic expiry order
        self._seen: OrderedDict[str, tuple[float, float, bool]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def begin(
        self, delivery_id: str, ts: float, now: float | None = None, wall: float | None = None
    ) -> Seen:
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        with self._lock:
            self._expire(now, wall)
            hit = self._seen.get(delivery_id)
            if hit is not None:
                return Seen.DUPLICATE if hit[2] else Seen.IN_PROGRESS
            if len(self._seen) >= self.max_ids:
                return Seen.FULL
            self._seen[delivery_id] = (
                now + self.retention_s,
                ts + self.window_s + self.skew_s,
                False,
            )
            return Seen.NEW

    def done(self, delivery_id: str) -> None:
        """The delivery was carried out: repeats of it are duplicates from now on."""
        with self._lock:
            hit = self._seen.get(delivery_id)
            if hit is not None:
                self._seen[delivery_id] = (hit[0], hit[1], True)

    def forget(self, delivery_id: str) -> None:
        """Un-see an id whose processing failed, so MLflow's retry is processed."""
        with self._lock:
            self._seen.pop(delivery_id, None)

    def retry_after_s(self, now: float | None = None) -> float:
        """Seconds until the oldest id may expire (when FULL), at least 1."""
        now = time.monotonic() if now is None else now
        with self._lock:
            oldest = next(iter(self._seen.values()), None)
        return max(1.0, math.ceil(oldest[0] - now)) if oldest else 1.0

    def _expire(self, now: float, wall: float) -> None:
        while self._seen:
            mono_expiry, wall_expiry, _ = next(iter(self._seen.values()))
            if mono_expiry >= now or wall_expiry >= wall:
                return
            self._seen.popitem(last=False)


def ensure_webhook(client, model: str, url: str, secret: str) -> str:
    """Create or update the `flywheel-<model>` webhook; returns its id."""
    name = f"flywheel-{model}"
    existing = None
    token = None
    while True:
        page = client.list_webhooks(max_results=100, page_token=token)
        existing = next((w for w in page if w.name == name), existing)
        token = page.token
        if existing is not None or not token:
            break
    if existing is None:
        wh = client.create_webhook(
            name=name,
            url=url,
            events=list(ALIAS_EVENTS),
            secret=secret,
            status="ACTIVE",
            description=f"Flywheel controller: alias moves of {model}",
        )
        log.info("registered MLflow webhook %s -> %s", wh.webhook_id, url)
        return wh.webhook_id
    client.update_webhook(
        existing.webhook_id, url=url, events=list(ALIAS_EVENTS), secret=secret, status="ACTIVE"
    )
    log.info("updated MLflow webhook %s -> %s", existing.webhook_id, url)
    return existing.webhook_id


def disable_webhook(client, model: str) -> None:
    for w in client.list_webhooks(max_results=100):
        if w.name == f"flywheel-{model}":
            client.update_webhook(w.webhook_id, status="DISABLED")
