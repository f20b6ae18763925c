"""Prometheus metrics of the deployment log's SQL projector (default registry, /metrics); the
log's own counters are in app/contracts/deployments.py."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

PROJECTED = Counter(
    "flywheel_deployment_events_projected_total",
    "Deployment events applied to the SQL projections.",
    ["result"],
)
PROJECTED_OFFSET = Gauge(
    "flywheel_deployment_projector_offset",
    "Last Kafka offset the projector applied.",
    ["partition"],
)
SESSION_RECORDS = Counter(
    "flywheel_session_records_projected_total",
    "Records of <ns>.rollouts applied to the sessions projection.",
    ["result"],
)
COMMITS_FAILED = Counter(
    "flywheel_projector_commits_failed_total",
    "Offset commits of the projector's follower that failed (the group rebalanced, or the commit "
    "timed out); the batch is re-delivered and its records are no-ops.",
    ["reason"],
)
