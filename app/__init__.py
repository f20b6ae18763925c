"""Flywheel: online learning from production feedback.

Roles live in sibling top-level packages: `app` (HTTP API, controller, replica, CLI,
settings, data layer), `streams` (Faust aggregators), `trainer` (policy and RL loop),
`kernels` (numerics shared by the replica and the trainer).
"""
