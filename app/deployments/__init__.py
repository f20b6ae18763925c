"""Deployment event sourcing: the `flywheel.deployments` contract, its log, its SQL projections.

- `events.py`: `DeploymentEvent` (the contract) and `DeploymentLog` (publish + read the topic).
- `projector.py`: apply events to the SQL projections; follow the topic; rebuild from it.

See docs/DEPLOYMENTS.md for who publishes what and how the projections are derived.
"""
