"""The rollout controller: offline gate, canary state machine, MLflow aliases.

- `ope.py`, `monitors.py`, `gate.py`: the offline gate run on every new model version.
- `state.py`: `apply_event` / `fold` over event dicts, which apply the one fold of the log
  (app/contracts/deployment_state.py).
- `canary.py`: the sequential canary analysis and the pure state machine
  `transition(state, input, config) -> (state, decisions)`.
- `reconciler.py`: the polling alias reconciler (MLflow aliases as a control surface).
- `config.py`: `ControllerSettings`.
- `controller.py`: the `flywheel controller` role loop that wires them to Kafka and MLflow.

What the API serves on the controller's behalf lives in app/registry/, below both roles: the
operator verbs and `CanaryConfig` (`app/registry/operator.py`), the alias reconciliation that the
webhook receiver and the poller run (`app/registry/reconcile.py`), the webhooks' registration and
verification (`app/registry/webhooks.py`); the alias conventions
(`app/contracts/aliases.py`) and `Decision` (`app/contracts/deployments.py`) are contracts.

docs/ROLLOUT.md explains the behaviour for operators.

May import: app.contracts, app.edits, app.infra, app.registry, app.sandbox, app.settings, policy
Tests: tests/unit/controller/, tests/integration/controller/, tests/integration/rollout/
Docs: docs/ROLLOUT.md
"""
