"""The HTTP API role, `flywheel api`: the editors' ingest (`POST /v1/events` into Kafka), the
deployment-status and session reads, the operator verbs, the MLflow webhook receiver, health and metrics.

- `main.py`: `create_app`, which assembles the routers of routes/ (one module per resource:
  `routes/events.py`, `routes/status.py`, `routes/sessions.py`, `routes/admin.py`,
  `routes/hooks.py`, `routes/health.py`).
- `deps.py`: the typed dependencies routes take (settings, database session, bearer-key auth).
- `jsonbody.py`, `ratelimit.py`, `metrics.py`: strict JSON bodies, per-key rate limits, Prometheus.
- `server.py`: uvicorn with the HTTP limits of app/httplimits.py.

May import: app.contracts, app.db, app.httplimits, app.infra, app.registry, app.settings
Tests: tests/unit/api/, tests/integration/api/, tests/integration/deployments/test_status_api.py,
tests/integration/deployments/test_sessions_api.py
Docs: docs/API.md
"""
