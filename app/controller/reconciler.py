"""The controller's polling alias reconciler: the fallback for lost or disabled MLflow webhooks.

    Reconciler(client, model, publish, interval_s=5.0).start()

Every `interval_s` it runs the alias reconciliation (app/registry/reconcile.py
`reconcile_once`, `via="poll"`) that the API's webhook receiver runs on each delivery.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from app.registry.reconcile import reconcile_once

log = logging.getLogger(__name__)


class Reconciler:
    """Polls MLflow every `interval_s` in a daemon thread (the webhook fallback). A failed pass
    (MLflow or Kafka away) is retried next interval, with one `waiting for` line (app/infra/wait.py)."""

    def __init__(
        self, client, model: str, publish: Callable[[dict[str, Any]], Any], interval_s: float
    ):
        assert interval_s > 0, f"poll interval must be > 0, got {interval_s}"
        self.client, self.model, self.publish, self.interval_s = client, model, publish, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_forever(self) -> None:
        from app.infra.wait import Waiter

        away = Waiter(f"MLflow and Kafka to reconcile the aliases of {self.model}")
        while not self._stop.is_set():
            try:
                reconcile_once(self.client, self.model, self.publish, via="poll")
            except Exception as exc:  # MLflow or Kafka away: one log line, try again next interval
                log.debug("alias reconciliation of %s failed", self.model, exc_info=True)
                away.pending(
                    f"{type(exc).__name__}: {str(exc)[:300]} (next try in {self.interval_s:g}s)"
                )
            else:
                if away.active:
                    away.there()
            self._stop.wait(self.interval_s)

    def start(self) -> Reconciler:
        self._thread = threading.Thread(
            target=self.run_forever, name="alias-reconciler", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 30)
