"""What several roles share, in one package that imports no role.

Each module is the single home of one contract:

- `events`: the editor event schema (POST /v1/events, `<ns>.interactions`)
- `rollouts`: the rollout record format (`<ns>.rollouts`, `<ns>.version-metrics`, `<ns>.dlq`)
- `deployments`: the typed deployment events (and `Decision`, an event before its id and time)
  and the deployment log's reader/writer
- `deployment_state`: the one typed fold of the deployment log (controller, replicas, API, projector)
- `replica_status`: replica heartbeats on the compacted `<ns>.replica-status`
- `artifacts`: the version artifacts (delta chain, anchors, manifest): written at ship time, read by replicas
- `hints`: the artifact hints carried by `version_registered`
- `pushed`: the pushed-delta record format of `<ns>.deltas`
- `aliases`: the MLflow alias and tag conventions
- `deadletter`: the dead-letter writer
- `topics`: every topic's name and configuration

The roles (app.api, app.replica, app.controller, app.projector, streams, trainer,
app.simulate, app.report) import these, the policy package (policy) and `kernels/`,
never each other; `lint-imports` (contracts in pyproject.toml) enforces it.

May import: app.infra, app.settings, kernels
Tests: tests/unit/deployments/, tests/unit/test_kafka_limits.py, tests/unit/api/test_event_schema.py
Docs: docs/DESIGN.md, docs/DEPLOYMENTS.md
"""
