"""Turn alias moves made outside Flywheel (MLflow UI or client) into `alias_changed` events.

    events = reconcile_once(client, model, publish, via="poll")

Compares the registered model's aliases with Flywheel's acknowledged copy (app/contracts/aliases.py),
publishes one `alias_changed` event per difference (source `mlflow-ui`, from/to version,
reason), then acknowledges them. The controller consumes those events and carries the move
out (canary_started / promoted / aborted / restore; see app/controller/canary.py `reconcile`).
The API's webhook receiver (app/api/routes/hooks.py) calls the same function with
`via="webhook"`; the controller's poller (app/controller/reconciler.py `Reconciler`) calls it
every `poll_interval_s` as the fallback for lost or disabled webhooks.

Publishing happens before acknowledging: a crash in between re-detects the move on the next
pass and re-publishes it with the same deterministic event id, which the consumers dedupe.

Settling. Flywheel's own move (`sync_aliases`) is two MLflow calls: the acknowledged tag first,
then the alias. A reader in another process (the API's webhook receiver, the trainer) that
looks between the two sees alias != tag, which is exactly what an outside move looks like.
So a difference is reported only if it is still there, unchanged (same alias, from, to and
seq), `settle_s` later: Flywheel's own move finishes (and bumps seq) within milliseconds, an
operator's move stays. It adds `settle_s` (0.5 s) to the reaction to a real UI move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from app.contracts.aliases import AliasMove, acknowledge, detect_moves, read_snapshot
from app.contracts.deployments import Decision

log = logging.getLogger(__name__)

ALIAS_MOVES = Counter(
    "flywheel_controller_alias_moves_total",
    "Alias moves made outside Flywheel that were carried out",
    ["alias", "via"],
)
# webhook threads, the poller and the controller's own alias moves of one process take turns
alias_lock = threading.RLock()
SETTLE_S = (
    0.5  # how long an alias/tag difference must persist to count as a move made outside Flywheel
)


def settled_moves(client, model: str, settle_s: float = SETTLE_S) -> list[AliasMove]:
    """Moves made outside Flywheel: differences still present, unchanged, `settle_s` later."""
    moves = detect_moves(read_snapshot(client, model))
    if not moves or settle_s <= 0:
        return moves
    time.sleep(settle_s)
    again = detect_moves(read_snapshot(client, model))
    transient = [m for m in moves if m not in again]
    if transient:
        log.debug(
            "alias differences of %s gone within %.2fs (a move in progress, not an outside move): %s",
            model,
            settle_s,
            transient,
        )
    return [m for m in again if m in moves]


def reconcile_once(
    client,
    model: str,
    publish: Callable[[dict[str, Any]], Any],
    via: str,
    extra: dict[str, Any] | None = None,
    settle_s: float = SETTLE_S,
) -> list[dict[str, Any]]:
    """Publish an `alias_changed` event for every alias that moved outside Flywheel; returns them."""
    with alias_lock:
        moves = settled_moves(client, model, settle_s)
        events = []
        for m in moves:
            verb = "removed" if m.to_version is None else f"moved to version {m.to_version}"
            d = Decision(
                type="alias_changed",
                version=m.to_version,
                from_version=m.from_version,
                source="mlflow-ui",
                actor="mlflow-ui",
                reason=f"alias {m.alias} {verb} in MLflow (was {m.from_version}); seen by {via}",
                details={"alias": m.alias, "observed_via": via, "seq": m.seq, **(extra or {})},
            )
            ev = d.to_event(model, event_id=m.event_id(model))
            publish(ev)
            events.append(ev)
            ALIAS_MOVES.labels(m.alias, via).inc()
            log.info(
                "alias %s@%s %s -> %s (via %s)", model, m.alias, m.from_version, m.to_version, via
            )
        acknowledge(client, model, moves)
        return events
