"""Replica status: `<ns>.replica-status`, a compacted topic of replica heartbeats.

A replica reports what it serves (`replica_heartbeat`: champion and candidate versions, traffic
share, status, url) every `heartbeat_interval`. Those reports go to their own topic, keyed by
replica id, not to `<ns>.deployments`: the deployment log holds decisions only (and the
replicas' `replica_synced` / `replica_sync_failed`, one per version and replica), so what a
replica, the controller or the projector replays at start does not grow with uptime. The
topic is compacted (app/contracts/topics.py): the broker keeps at least the latest report of
each replica; a reader takes the newest by `ts` (the projector: `apply_replica_status`).

    from app.contracts.replica_status import ReplicaStatusLog

    with ReplicaStatusLog(settings) as status:
        status.publish(DeploymentEvent(type="replica_heartbeat", model=..., source="replica",
                                       details={"replica_id": "r-1", "champion_version": "7"}))
        for logged in status.read():        # from the beginning to the current end
            ...

The record value is the `DeploymentEvent` JSON of the deployment log, so the one decoder and
the one fold (app/contracts/deployment_state.py, `apply_heartbeat`) read it.
"""

from __future__ import annotations

import logging

from app.contracts.deployments import PUBLISHED, DeploymentEvent, DeploymentLog
from app.infra.kafka import make_producer
from app.settings import Settings

log = logging.getLogger(__name__)

STATUS_TYPES = frozenset({"replica_heartbeat"})


class ReplicaStatusLog(DeploymentLog):
    """Publish heartbeats to and read them from `<ns>.replica-status` (keyed by replica id)."""

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.topic = settings.topic("replica-status")

    def publish(self, event: DeploymentEvent) -> tuple[int, int]:
        """Append one heartbeat keyed by its replica id; (partition, offset) once acknowledged."""
        if event.type not in STATUS_TYPES:
            raise ValueError(
                f"{event.type} does not belong on {self.topic} (only {sorted(STATUS_TYPES)}); "
                "publish decisions to the deployment log"
            )
        if self._producer is None:
            self._producer = make_producer(self.settings, profile="immediate")
        future = self._producer.send(
            self.topic, key=event.details["replica_id"], value=event.to_bytes()
        )
        meta = future.get(timeout=max(1.0, self.settings.kafka_produce_timeout * 2))
        PUBLISHED.labels(event.type).inc()
        return meta.partition, meta.offset
