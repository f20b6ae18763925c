"""Prometheus metrics of `flywheel trainer` (served on FLYWHEEL_TRAINER_METRICS_PORT by trainer/launch.py).

Defined once at import so several Trainer objects in one process (tests) share them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

ROLLOUTS = Counter("flywheel_trainer_rollouts_total", "Rollouts processed by the trainer, by outcome.", ["outcome"])
STEPS = Counter("flywheel_trainer_steps_total", "Optimizer steps.")
SHIPS = Counter("flywheel_trainer_ships_total", "Versions registered by this process (incl. resumed ships).")
LAST_VERSION = Gauge("flywheel_trainer_last_shipped_version", "Last registered model version.")
BUFFERED = Gauge("flywheel_trainer_buffered_records", "Records fetched but not yet trained on or skipped.")
STEP_GAUGES = {name: Gauge(f"flywheel_trainer_{name}", f"Last optimizer step's {name.replace('_', ' ')}.")
               for name in ("loss", "reward_mean", "kl", "kl_coef", "ess", "clip_fraction", "masked_fraction", "staleness_mean",
                            "mismatch", "distill_kl", "grad_norm")}
