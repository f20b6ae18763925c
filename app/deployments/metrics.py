"""Prometheus metrics of the deployment log and its projector (default registry, /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

PUBLISHED = Counter(
    "flywheel_deployment_events_published_total",
    "Deployment events acknowledged by Kafka.",
    ["type"],
)
INVALID_EVENTS = Counter(
    "flywheel_deployment_events_invalid_total",
    "Records on the deployments topic that are not valid events (skipped).",
)
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
