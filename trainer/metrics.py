"""Prometheus metrics of `flywheel trainer` (served on FLYWHEEL_TRAINER_METRICS_PORT by trainer/launch.py).

Defined once at import so several Trainer objects in one process (tests) share them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from trainer.validate import REFUSAL_REASONS

ROLLOUTS = Counter(
    "flywheel_trainer_rollouts_total",
    "Rollouts processed by the trainer, by outcome (trained = consumed "
    "by an optimizer step; duplicate, stale, invalid = refused at intake, failed = the step raised on it).",
    ["outcome"],
)
REFUSED = Counter(
    "flywheel_trainer_rollouts_refused_total",
    "Rollouts refused and dead-lettered, by reason "
    "(trainer/validate.py; step_failed = the optimizer step raised on it).",
    ["reason"],
)
for _reason in REFUSAL_REASONS:
    REFUSED.labels(_reason)  # every reason is exported from the start, at 0
STEP_FAILURES = Counter(
    "flywheel_trainer_step_failures_total",
    "Optimizer steps that raised (the batch was then "
    "retried without the rollouts that raise alone; see docs/TRAINER.md).",
)
STEPS = Counter("flywheel_trainer_steps_total", "Optimizer steps.")
REBASES = Counter(
    "flywheel_trainer_rebases_total",
    "Times the trainer continued from the champion because the gate "
    "found one of its versions confidently worse than the champion.",
)
SHIPS = Counter(
    "flywheel_trainer_ships_total", "Versions registered by this process (incl. resumed ships)."
)
ASSUMED_TEMPERATURE = Counter(
    "flywheel_trainer_rollouts_assumed_temperature_total",
    "Rollouts trained on without a recorded sampling temperature (records written before the "
    "field): scored at FLYWHEEL_TRAINER_TEMPERATURE instead of their replica's temperature.",
)
STALE_TURN_TOKENS = Counter(
    "flywheel_trainer_stale_turn_tokens_total",
    "Sampled tokens of multi-turn records left untrained because their turn's model_version was "
    'stale (the record trained on its fresh turns; docs/TRAINER.md "Multi-turn records").',
)
CONSTRAINED_TURN_TOKENS = Counter(
    "flywheel_trainer_constrained_turn_tokens_total",
    "Sampled tokens of multi-turn records left untrained because their turn was sampled under a "
    "grammar constraint (the record trained on its other turns).",
)
GROUPED = Counter(
    "flywheel_trainer_rollouts_grouped_total",
    "Rollouts trained with their group's baseline (a group_id shared by >= 2 rollouts of the "
    "step: n > 1 choices, or parallel sessions on one task); the rest of "
    'flywheel_trainer_rollouts_total{outcome="trained"} got the batch\'s.',
)
POSITIVE_HELD_BACK = Counter(
    "flywheel_trainer_positive_held_back_total",
    "Rollouts of agent sessions that did not succeed whose advantage was above 0 and held at 0 "
    "(FLYWHEEL_TRAINER_ADV_POSITIVE_NEEDS_SUCCESS; 0 while it is off).",
)
ERROR_TURN_TOKENS = Counter(
    "flywheel_trainer_error_turn_tokens_total",
    "Tokens of calls that came back as tool errors, trained at FLYWHEEL_TRAINER_ERROR_TURN_ADVANTAGE "
    "instead of their session's advantage (0 while it is off).",
)
LAST_VERSION = Gauge("flywheel_trainer_last_shipped_version", "Last registered model version.")
SHIP_WAITING = Gauge(
    "flywheel_trainer_ship_waiting",
    "1 while a due ship waits for FLYWHEEL_TRAINER_MIN_ROLLOUTS trained rollouts, else 0.",
)
VERDICT_WAIT = Gauge(
    "flywheel_trainer_verdict_wait",
    "1 while training waits for the verdict on a version FLYWHEEL_TRAINER_VERDICT_WAIT_AHEAD "
    "versions ahead of the champion, else 0.",
)
VERDICT_WAIT_SECONDS = Counter(
    "flywheel_trainer_verdict_wait_seconds_total",
    "Seconds training waited for a verdict (FLYWHEEL_TRAINER_VERDICT_WAIT_AHEAD).",
)
RANKS = Gauge(
    "flywheel_trainer_ranks", "Ranks of the trainer (torchrun's WORLD_SIZE; 1 = one process)."
)
PARTITIONS = Gauge(
    "flywheel_trainer_partitions",
    "Rollouts partitions this rank reads (with ranks: p % ranks == rank; one process: its group assignment).",
)
BUFFERED = Gauge(
    "flywheel_trainer_buffered_records", "Records fetched but not yet trained on or skipped."
)
# progress of the base policy's pretraining on an empty registry (trainer/pretrain.py), read by
# the live view of `flywheel run` (app/status_view.py): 0 steps = this process is not pretraining
PRETRAIN_STEPS = Gauge(
    "flywheel_trainer_pretrain_steps",
    "Steps of the base policy's pretraining (its total; 0 while this process has not pretrained).",
)
MID_SKILL = Gauge(
    "flywheel_trainer_mid_skill",
    "p(right) of mid-training's last probe of the agent tasks' skill (trainer/skill_probe.py; 0 until it probes).",
)
PRETRAIN_STEP = Gauge(
    "flywheel_trainer_pretrain_step",
    "Pretraining steps done (equal to flywheel_trainer_pretrain_steps once pretraining finished).",
)
PRETRAIN_LOSS = Gauge("flywheel_trainer_pretrain_loss", "Last pretraining step's next-token loss.")
STEP_GAUGES = {
    name: Gauge(f"flywheel_trainer_{name}", f"Last optimizer step's {name.replace('_', ' ')}.")
    for name in (
        "loss",
        "reward_mean",
        "kl",
        "kl_coef",
        "ess",
        "clip_fraction",
        "trust_clip_fraction",
        "masked_fraction",
        "staleness_mean",
        "mismatch",
        "distill_kl",
        "grad_norm",
        "lr",
    )
}
