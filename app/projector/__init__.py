"""The projector role: the SQL projections of the deployment log (`flywheel.deployments`) and
the sessions projection of the rollouts (`flywheel.rollouts`).

- `projector.py`: apply deployment events to the SQL projections; follow the topics; rebuild them
  from them (`flywheel projections`).
- `sessions.py`: a rollout record as a session's segment and its turns (`session_segments`,
  `session_turns`), idempotent per record key.
- `metrics.py`: its Prometheus metrics.

The contract it reads (`DeploymentEvent`, the log's reader) and the one fold of the log are in
app/contracts/ (deployments.py, deployment_state.py). See docs/DEPLOYMENTS.md for who publishes
what and how the projections are derived.

May import: app.contracts, app.db, app.infra, app.settings
Tests: tests/unit/deployments/, tests/integration/deployments/
Docs: docs/DEPLOYMENTS.md
"""
