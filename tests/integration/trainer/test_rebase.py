"""The trainer continues from the champion when the gate fails one of its versions.

Real broker and MLflow server (trainer_env), a tiny real policy. The gate's verdict arrives as the
controller writes it: MLflow version tags `flywheel.gate.*`.
Run: .venv/bin/pytest tests/integration/trainer/test_rebase.py -q
"""

from __future__ import annotations

import pytest
import torch
from mlflow import MlflowClient

from tests.integration.trainer.conftest import drain, produce, rollout_records
from trainer.config import TrainerConfig
from trainer.loop import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _train_and_ship(trainer: Trainer, settings, version_of_samples: int, n: int = 8) -> int:
    produce(
        settings,
        rollout_records(
            trainer.policy,
            version_of_samples,
            n,
            lambda text: float(len(text.encode()) % 3),
            seed=version_of_samples,
        ),
    )
    drain(trainer, n)
    return trainer.maybe_ship(force=True)


def test_a_rejected_version_makes_the_trainer_continue_from_the_champion(trainer_env):
    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**cfg_kw, verdict_check_s=1.0))
    client = MlflowClient(settings.mlflow_uri)
    try:
        champion = {
            k: v.clone() for k, v in trainer.policy.serving_state_dict().items()
        }  # v1, the champion
        assert _train_and_ship(trainer, settings, 1) == 2
        assert trainer.maybe_rebase(now=1e9) is None, "no verdict yet: nothing to do"

        # the gate passed v2: the trainer's line is fine
        client.set_model_version_tag(settings.model_name, "2", "flywheel.gate.status", "passed")
        client.set_model_version_tag(
            settings.model_name, "2", "flywheel.gate.reward_vs_champion", "pass 0.01"
        )
        assert trainer.maybe_rebase(now=2e9) is None and trainer.verdicts_seen == 2
        moved = trainer.policy.serving_state_dict()
        assert any(not torch.equal(moved[k], champion[k]) for k in champion), (
            "training moved the weights"
        )
        assert trainer.optimizer.state, "the optimizer has moments"

        assert _train_and_ship(trainer, settings, 2) == 3
        # v3 is confidently worse than the champion (v1)
        client.set_model_version_tag(settings.model_name, "3", "flywheel.gate.status", "failed")
        client.set_model_version_tag(
            settings.model_name, "3", "flywheel.gate.reward_vs_champion", "fail -0.31"
        )
        assert trainer.maybe_rebase(now=2e9 + 0.5) is None, (
            "verdicts are read at most every verdict_check_s"
        )
        assert trainer.maybe_rebase(now=3e9) == 1
        now = trainer.policy.serving_state_dict()
        assert all(torch.equal(now[k], champion[k]) for k in champion), (
            "the weights are the champion's"
        )
        assert not trainer.optimizer.state, "the rejected line's optimizer moments are gone"
        assert trainer.maybe_rebase(now=4e9) is None, "one verdict, one rebase"

        assert _train_and_ship(trainer, settings, 3) == 4
        tags = client.get_model_version(settings.model_name, "4").tags
        assert tags["rebased_on"] == "1" and tags["parent_version"] == "3"

        # v4's predicted reward is fine but it breaks more tool calls: any failed check sends the
        # trainer back (its descendants would break them too)
        client.set_model_version_tag(settings.model_name, "4", "flywheel.gate.status", "failed")
        client.set_model_version_tag(
            settings.model_name, "4", "flywheel.gate.reward_vs_champion", "pass 0.02"
        )
        client.set_model_version_tag(
            settings.model_name, "4", "flywheel.gate.tool_call_validity_rate", "fail 0.17"
        )
        assert _train_and_ship(trainer, settings, 4) == 5
        assert any(
            not torch.equal(v, champion[k]) for k, v in trainer.policy.serving_state_dict().items()
        )
        assert trainer.maybe_rebase(now=5e9) == 1
        now = trainer.policy.serving_state_dict()
        assert all(torch.equal(now[k], champion[k]) for k in champion)
    finally:
        trainer.close()

    # the rebase survived a restart: the state holds the verdicts seen, so v3's verdict is not re-applied
    again = Trainer(settings, TrainerConfig(**cfg_kw, verdict_check_s=1.0))
    try:
        assert again.verdicts_seen == 4 and again.maybe_rebase(now=1e10) is None
    finally:
        again.close()


def test_a_planted_version_does_not_trigger_a_rebase(trainer_env):
    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**cfg_kw, verdict_check_s=1.0, plant_bad_version=2))
    client = MlflowClient(settings.mlflow_uri)
    try:
        assert _train_and_ship(trainer, settings, 1) == 2
        assert client.get_model_version(settings.model_name, "2").tags["planted_bad"] == "true"
        client.set_model_version_tag(settings.model_name, "2", "flywheel.gate.status", "failed")
        client.set_model_version_tag(
            settings.model_name, "2", "flywheel.gate.reward_vs_champion", "fail -2.5"
        )
        before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
        assert trainer.maybe_rebase(now=1e9) is None
        assert all(torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())
    finally:
        trainer.close()


def test_training_waits_for_the_verdict_on_a_version_far_ahead_of_the_champion(trainer_env):
    """`verdict_wait_ahead`: with the last shipped version 2 ahead of the champion and not judged,
    nothing trains and nothing is fetched (the records wait in Kafka); a canary is still a wait; a
    promotion, a failed gate and a canary ended without a promotion each end it."""
    from trainer.metrics import VERDICT_WAIT

    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**cfg_kw, verdict_check_s=1.0, verdict_wait_ahead=2))
    client, name = MlflowClient(settings.mlflow_uri), settings.model_name
    try:
        assert trainer.champion == 1
        assert _train_and_ship(trainer, settings, 1) == 2
        assert not trainer.waits_for_verdict(now=1e9), "1 ahead of the champion"
        assert _train_and_ship(trainer, settings, 2) == 3
        assert trainer.waits_for_verdict(now=2e9), "2 ahead, no gate verdict"
        assert VERDICT_WAIT._value.get() == 1

        produce(settings, rollout_records(trainer.policy, 1, 4, lambda t: float(len(t)), seed=9))
        step = trainer.step
        for _ in range(10):  # 10 polls of poll_timeout_ms each
            assert trainer.train_step() is None
        assert (trainer.step, trainer.intake.buffered()) == (step, 0), "paused: nothing fetched"

        client.set_model_version_tag(name, "3", "flywheel.gate.status", "passed")
        client.set_registered_model_alias(name, "candidate", "3")
        assert trainer.waits_for_verdict(now=3e9), "in its canary: still awaiting the verdict"

        # promoted: the champion moved, the wait ends, the KL reference and staleness follow
        client.set_registered_model_alias(name, "champion", "3")
        client.delete_registered_model_alias(name, "candidate")
        assert not trainer.waits_for_verdict(now=4e9)
        assert trainer.champion == 3 and VERDICT_WAIT._value.get() == 0
        drain(trainer, 4)  # the records that waited in Kafka train now
        assert trainer.pending.rollouts == 4
        assert trainer.maybe_ship(force=True) == 4

        # v5, 2 ahead of v3: the gate fails it, which is a verdict (maybe_rebase goes back to v3)
        assert _train_and_ship(trainer, settings, 3) == 5
        assert trainer.waits_for_verdict(now=5e9)
        client.set_model_version_tag(name, "5", "flywheel.gate.status", "failed")
        assert not trainer.waits_for_verdict(now=6e9)

        # v6 passes the gate and its canary ends without a promotion (no candidate, champion v3)
        assert _train_and_ship(trainer, settings, 4) == 6
        assert trainer.waits_for_verdict(now=7e9)
        client.set_model_version_tag(name, "6", "flywheel.gate.status", "passed")
        assert not trainer.waits_for_verdict(now=8e9), "passed, not in a canary, not promoted"
    finally:
        trainer.close()
