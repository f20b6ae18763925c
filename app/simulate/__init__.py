"""The simulated editor population, `flywheel simulate`: users with preferences the model does not
know ask the replicas for completions and react with editor events, and the held-out evaluation
scores each registered version.

- `users.py`, `prompts.py`, `population.py`: the users, their prompts, the driver.
- `evaluate.py`: held-out acceptance per version, with its confidence interval.
- `agents.py`, `agent_eval.py`: agent users working sessions with real tools
  (`FLYWHEEL_SIMULATE_AGENTS`), and held-out task success per version.
- `config.py`: its settings.

May import: app.client, app.edits, app.sandbox, app.settings, policy
Tests: tests/unit/simulate/, tests/integration/simulate/
Docs: docs/DESIGN.md
"""
