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
operator verbs and `CanaryConfig` (`operator.py`), the alias reconciliation that the webhook
receiver and the poller run (`reconcile.py`), the webhooks' registration and verification
(`webhooks.py`); the alias conventions (`aliases.py`) and `Decision` (`deployments.py`) are in
app/contracts/.

docs/ROLLOUT.md explains the behaviour for operators.
"""
