"""Flywheel: online learning from production feedback.

Roles live in sibling top-level packages: `app` (HTTP API, controller, replica, CLI,
settings, data layer), `streams` (Faust aggregators), `trainer` (the RL loop), `policy` (the
policy models the trainer trains and the replicas serve), `kernels` (numerics shared by the
replica and the trainer). docs/DESIGN.md "Layering" says what lives where.
"""
