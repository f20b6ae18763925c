"""The rollout controller: offline gate, canary state machine, operator verbs, MLflow aliases.

- `ope.py`, `monitors.py`, `gate.py`: the offline gate run on every new model version.
- `state.py`: `Decision` (an event before its id and time) and `apply_event` / `fold` over event
  dicts, which apply the one fold of the log (app/contracts/deployment_state.py).
- `canary.py`: the sequential canary analysis and the pure state machine
  `transition(state, input, config) -> (state, decisions)`, plus the operator verbs.
- `aliases.py`, `reconciler.py`, `webhooks.py`: MLflow aliases as a control surface.
- `controller.py`: the `flywheel controller` role loop that wires them to Kafka and MLflow.

docs/ROLLOUT.md explains the behaviour for operators.
"""
