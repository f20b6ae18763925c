"""MLflow webhooks: registration on the server, and verification of deliveries.

MLflow 3.x signs each delivery Standard-Webhooks style (mlflow/webhooks/delivery.py):

    X-MLflow-Delivery-Id: <uuid4>
    X-MLflow-Timestamp:   <unix seconds>
    X-MLflow-Signature:   v1,<base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}"))>

`verify` checks the signature in constant time, rejects timestamps outside a replay window,
and `DeliveryDedupe` drops a delivery id seen before within that window (MLflow retries a
delivery with the same id on 429/5xx). Verification is on the raw body bytes as sent.

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
import threading
import time
from collections import OrderedDict

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


def verify(secret: str, headers: dict[str, str], body: bytes, window_s: float, now: float | None = None) -> str:
    """Return the delivery id of a genuine, fresh delivery; raise WebhookRejected otherwise."""
    h = {k.lower(): v for k, v in headers.items()}
    delivery_id, ts, sig = (h.get(x.lower()) for x in (DELIVERY_ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER))
    if not delivery_id or not ts or not sig:
        raise WebhookRejected(f"missing {DELIVERY_ID_HEADER}, {TIMESTAMP_HEADER} or {SIGNATURE_HEADER}; "
                              "register the webhook with the shared secret (FLYWHEEL_WEBHOOK_SECRET)")
    try:
        ts_f = float(ts)
    except ValueError:
        raise WebhookRejected(f"{TIMESTAMP_HEADER} {ts!r} is not unix seconds") from None
    expected = sign(secret, delivery_id, ts, body)
    if not any(hmac.compare_digest(expected, part.strip()) for part in _signatures(sig)):
        raise WebhookRejected("signature does not match (wrong secret or modified body)")
    age = (time.time() if now is None else now) - ts_f
    if abs(age) > window_s:
        raise WebhookRejected(f"timestamp {ts} is {age:.0f}s away from now, outside the {window_s:g}s replay window")
    return delivery_id


def _signatures(header: str) -> list[str]:
    """Standard Webhooks allows several space-separated signatures (key rotation)."""
    return [s for s in header.split(" ") if s]


class DeliveryDedupe:
    """Delivery ids seen within the replay window (older ones are rejected by `verify` anyway)."""

    def __init__(self, window_s: float, max_size: int = 100_000):
        self.window_s, self.max_size = window_s, max_size
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, delivery_id: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - 2 * self.window_s
                                  or len(self._seen) > self.max_size):
                self._seen.popitem(last=False)
            if delivery_id in self._seen:
                return False
            self._seen[delivery_id] = now
            return True

    def forget(self, delivery_id: str) -> None:
        """Un-see an id whose processing failed, so MLflow's retry is processed."""
        with self._lock:
            self._seen.pop(delivery_id, None)


def ensure_webhook(client, model: str, url: str, secret: str) -> str:  # noqa: ANN001
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
        wh = client.create_webhook(name=name, url=url, events=list(ALIAS_EVENTS), secret=secret, status="ACTIVE",
                                   description=f"Flywheel controller: alias moves of {model}")
        log.info("registered MLflow webhook %s -> %s", wh.webhook_id, url)
        return wh.webhook_id
    client.update_webhook(existing.webhook_id, url=url, events=list(ALIAS_EVENTS), secret=secret, status="ACTIVE")
    log.info("updated MLflow webhook %s -> %s", existing.webhook_id, url)
    return existing.webhook_id


def disable_webhook(client, model: str) -> None:  # noqa: ANN001
    for w in client.list_webhooks(max_results=100):
        if w.name == f"flywheel-{model}":
            client.update_webhook(w.webhook_id, status="DISABLED")
