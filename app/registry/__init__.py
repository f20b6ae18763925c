"""The control of the MLflow registry's aliases that both the API and the controller run.

The controller owns the rollout (the gate, the canary, the alias moves it decides); some of its
commands are served on the API's port, so the logic behind them lives here, below both roles,
and each runs it in its own process:

- `operator`: the operator verbs (promote, abort, rollback, pause, resume) as a function of the
  deployment state, the canary's plan and thresholds (`CanaryConfig`) and the controller
  settings the API reads (`ControllerCommandSettings`)
- `reconcile`: alias moves made outside Flywheel (the MLflow UI, its API) -> `alias_changed`
  events; run by the API's webhook receiver and the controller's poller
- `webhooks`: MLflow webhook registration, delivery verification and dedupe

A shared lower layer: it imports the contracts and the other lower layers, never a role
(pyproject.toml's import contracts). The deployment events these produce are carried out by the
controller; docs/ROLLOUT.md explains the behaviour for operators.

May import: app.contracts, app.settings
Tests: tests/unit/controller/test_webhooks.py, tests/integration/rollout/test_alias_sync.py, tests/integration/controller/test_mlflow_control_surface.py
Docs: docs/MLFLOW_UI.md, docs/ROLLOUT.md
"""
