"""Rollouts in -> a registered version with lineage tags; offsets committed only after it; pyfunc generates.

Real broker (make_settings) and real MLflow server (mlflow_server), a tiny real policy.
Run: .venv/bin/pytest tests/integration/trainer/test_ship.py -q
"""

from __future__ import annotations

import json

import mlflow
import pytest
from mlflow import MlflowClient

from tests.integration.trainer.conftest import (
    committed_offsets,
    drain,
    end_offsets,
    produce,
    produce_raw,
    registered_event,
    rollout_records,
)
from trainer.config import TrainerConfig
from trainer.loop import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_rollouts_become_a_registered_version_with_lineage_and_offsets_committed_after(
    trainer_env, tmp_path
):
    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**cfg_kw, max_staleness=0))
    client = MlflowClient(settings.mlflow_uri)
    try:
        # first start, empty registry: the base checkpoint is v1 and becomes champion
        assert trainer.last_shipped == 1
        v1 = client.get_model_version(settings.model_name, "1")
        assert (
            v1.tags["kind"] == "base"
            and v1.tags["parent_version"] == "none"
            and v1.tags["rollouts_consumed"] == "0"
        )
        assert client.get_model_version_by_alias(settings.model_name, "champion").version == "1"
        from app.contracts.aliases import detect_moves, read_snapshot

        assert detect_moves(read_snapshot(client, settings.model_name)) == [], (
            "the trainer's first champion is acknowledged like a controller move, not an outside (UI) move"
        )

        records = rollout_records(
            trainer.policy,
            1,
            10,
            lambda text: 0.75 if len(text) < 6 else -0.25,
            group_size=2,
            tool_error_every=3,
        )
        dup = dict(records[0])  # the streams worker re-emitted one rollout: trained once
        *_, dup_at = produce(settings, records + [dup])
        [bad_at] = produce_raw(settings, [("bad", b"not a rollout")])  # refused: invalid
        drain(trainer, 12)
        assert trainer.pending.rollouts == 10 and trainer.pending.skipped["duplicate"] == 1
        assert trainer.pending.skipped["invalid"] == 1
        assert committed_offsets(settings, cfg_kw["consumer_group"]) == {
            0: None,
            1: None,
            2: None,
        }, "nothing may be committed before a version is registered"

        version = trainer.maybe_ship(force=True)
        assert version == 2
        mv = client.get_model_version(settings.model_name, "2")
        assert mv.status == "READY"
        tags = mv.tags
        assert (
            tags["parent_version"] == "1"
            and tags["rollouts_consumed"] == "10"
            and tags["reward_spec"] == "v1"
        )
        assert tags["rollout_status"] == "registered" and len(tags["ship_id"]) == 32
        assert json.loads(tags["rollouts_skipped"]) == {
            "duplicate": 1,
            "failed": 0,
            "invalid": 1,
            "stale": 0,
        }
        # the event lists the two offsets it read and did not train on; every other one trained
        assert registered_event(settings, "2")["details"]["skipped_offsets"] == skipped_at(
            [dup_at, bad_at]
        )
        assert "skipped_offsets" not in tags, "an event detail, not a tag"
        offsets = json.loads(tags["kafka_offsets"])
        ends = end_offsets(settings)
        assert offsets["topic"] == settings.topic("rollouts")
        assert {int(p): tuple(r) for p, r in offsets["partitions"].items()} == {
            p: (0, e) for p, e in ends.items() if e
        }
        metrics = json.loads(tags["train_metrics"])
        assert (
            metrics["steps"] >= 3
            and "ess" in metrics
            and "kl" in metrics
            and "distill_kl" in metrics
        )
        # a partition the random request_ids left empty has nothing to commit (None reads from offset 0)
        assert {
            p: o or 0 for p, o in committed_offsets(settings, cfg_kw["consumer_group"]).items()
        } == ends

        # per-step metrics are in the run, so the MLflow UI plots curves
        history = client.get_metric_history(trainer.run_id, "loss")
        assert len(history) == trainer.step and [m.step for m in history] == list(
            range(1, trainer.step + 1)
        )
        for name in (
            "reward_mean",
            "kl",
            "ess",
            "clip_fraction",
            "masked_fraction",
            "staleness_mean",
            "mismatch",
        ):
            assert client.get_metric_history(trainer.run_id, name), f"metric {name} missing"
        # the behaviour log-probs came from v1 == champion, the KL reference: the mismatch is exactly 0
        assert {m.value for m in client.get_metric_history(trainer.run_id, "mismatch")} == {0.0}
        # pairs (group_size=2): a step judges both of a pair against each other, or neither (its
        # members arrived in different steps and each got that step's baseline)
        grouped = client.get_metric_history(trainer.run_id, "grouped_rollouts")
        sizes = client.get_metric_history(trainer.run_id, "batch_rollouts")
        assert len(grouped) == trainer.step and all(m.value % 2 == 0 for m in grouped)
        assert all(g.value <= b.value for g, b in zip(grouped, sizes))

        # the version is a pyfunc that generates text
        mlflow.set_tracking_uri(settings.mlflow_uri)
        model = mlflow.pyfunc.load_model(f"models:/{settings.model_name}/2")
        out = model.predict(["def add(a, b):\n    ", "x = "], params={"max_tokens": 8, "seed": 1})
        assert len(out) == 2 and all(isinstance(s, str) for s in out)
        again = model.predict(["def add(a, b):\n    ", "x = "], params={"max_tokens": 8, "seed": 1})
        assert again == out, "a fixed seed must reproduce the completions (params reach generate)"

        # with max_staleness 0, a rollout of v1 arriving after v2 shipped is behind, but v1 is still
        # the serving champion: what serves is never stale, it is trained on
        assert trainer.champion == 1
        produce(settings, [dict(records[1], request_id="late-from-champion-v1")])
        drain(trainer, 1)
        assert trainer.pending.skipped["stale"] == 0 and trainer.pending.rollouts == 1
        # once v2 is champion (read at the next ship), v1's rollouts are stale, and v2's are not
        client.set_registered_model_alias(settings.model_name, "champion", "2")
        assert trainer.maybe_ship(force=True) == 3 and trainer.champion == 2
        assert registered_event(settings, "3")["details"]["skipped_offsets"] == {}
        from_v2 = rollout_records(trainer.policy, 2, 1, lambda _: 0.5, prefix="from-champion-v2-")
        stale_at, _ = produce(settings, [dict(records[2], request_id="late-from-old-v1")] + from_v2)
        drain(trainer, 2)
        assert trainer.pending.skipped["stale"] == 1 and trainer.pending.rollouts == 1
        assert trainer.maybe_ship(force=True) == 4
        assert registered_event(settings, "4")["details"]["skipped_offsets"] == skipped_at(
            [stale_at]
        )
    finally:
        trainer.close()


def skipped_at(offsets: list[tuple[int, int]]) -> dict[str, list[int]]:
    """(partition, offset) pairs as a `version_registered` event's `skipped_offsets`."""
    out: dict[str, list[int]] = {}
    for part, offset in sorted(offsets):
        out.setdefault(str(part), []).append(offset)
    return out


def test_a_due_ship_waits_for_min_rollouts_and_ships_at_the_step_that_reaches_them(trainer_env):
    """min_rollouts 3: when the interval has passed with 2 rollouts trained, the ship waits (and the
    wait is exported), then happens as soon as the third is trained, not an interval later."""
    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**cfg_kw, min_rollouts=3))
    try:
        from prometheus_client import REGISTRY

        def waiting() -> float | None:
            return REGISTRY.get_sample_value("flywheel_trainer_ship_waiting")

        trainer.last_ship_at -= settings.ship_interval + 1  # the interval (1 h here) has passed
        records = rollout_records(trainer.policy, 1, 3, lambda _: 0.5)
        produce(settings, records[:2])
        drain(trainer, 2)
        assert trainer.pending.rollouts == 2
        assert trainer.maybe_ship() is None and trainer.last_shipped == 1
        assert waiting() == 1
        assert trainer.maybe_ship() is None, "still 2 rollouts: still waiting"
        produce(settings, records[2:])
        drain(trainer, 3)
        assert trainer.maybe_ship() == 2, "the third rollout makes the due ship happen at once"
        assert waiting() == 0
        tags = MlflowClient(settings.mlflow_uri).get_model_version(settings.model_name, "2").tags
        assert tags["rollouts_consumed"] == "3"
        assert trainer.maybe_ship() is None, "the next interval starts at the ship"
    finally:
        trainer.close()


@pytest.mark.parametrize("rule", ["scale", "full"])
def test_a_partial_batch_steps_at_its_share_of_the_learning_rate(trainer_env, rule):
    """3 rollouts where a batch is 12: after `max_wait_s` the trainer steps on them at lr x 3/12
    (`partial_batch_lr=scale`), or at lr (`full`). On a fresh AdamW the first update of every
    parameter with a gradient is lr x g / (|g| + eps), about lr, whatever the batch: the weights show
    the rate the step really ran at."""
    settings, cfg_kw = trainer_env
    cfg_kw.update(batch_size=12, max_wait_s=0.3, partial_batch_lr=rule, kl_coef=0.0)
    trainer = Trainer(settings, TrainerConfig(**cfg_kw, max_staleness=0))
    try:
        before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
        rewards = iter([1.0, -1.0, 0.25])
        produce(settings, rollout_records(trainer.policy, 1, 3, lambda _: next(rewards)))
        metrics = None
        for _ in range(400):
            metrics = trainer.train_step() or metrics
            if trainer.pending.rollouts >= 3:
                break
        assert trainer.pending.steps == 1 and trainer.pending.rollouts == 3, trainer.pending
        want = cfg_kw["lr"] * (3 / 12 if rule == "scale" else 1.0)
        assert metrics is not None and metrics["lr"] == pytest.approx(want)
        moved = max(
            float((p.detach() - before[n]).abs().max())
            for n, p in trainer.policy.named_parameters()
        )
        assert want * 0.9 < moved <= want * 1.001, (moved, want)
    finally:
        trainer.close()
