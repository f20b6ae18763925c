"""The trainer raises the mean reward of a synthetic preference within a bounded CPU budget.

A simulated user accepts (+0.75, reward spec v1) completions that contain the byte "7" and
rejects (-0.25) the rest; the base policy (tiny, randomly initialised) shows it in ~8% of
12-token completions. Each round is the real loop in miniature: a "replica" policy loaded
with the last registered version's bf16 weights samples 64 completions (8 per prompt, one
group_id per prompt), the user labels them, the rollouts go through Kafka, the trainer trains
on them (4 steps of 16, lr 1e-2) and ships the next version to MLflow; 4 rounds. Measured on held-out sampling
seeds before and after.

Run: .venv/bin/pytest tests/integration/trainer/test_learning.py -q
"""

from __future__ import annotations

import json
import time

import pytest
from mlflow import MlflowClient

from policy import build_policy
from tests.integration.trainer.conftest import PROMPTS, TINY_POLICY, drain, produce, rollout_records
from trainer.config import TrainerConfig
from trainer.loop import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def user_reward(text: str) -> float:
    return 0.75 if "7" in text else -0.25


def preferred_rate(policy, n: int = 128, seed: int = 12345) -> float:
    tok = policy.tokenizer
    samples = policy.generate(
        [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)], max_tokens=12, seed=seed
    )
    return sum("7" in s.text for s in samples) / n


def test_trainer_raises_the_reward_of_a_synthetic_preference(trainer_env):
    settings, cfg_kw = trainer_env
    cfg_kw.update(lr=1e-2, batch_size=16, max_wait_s=5.0, checkpoint_every=4)
    cpu0 = time.process_time()
    trainer = Trainer(settings, TrainerConfig(**cfg_kw))
    replica = build_policy(TINY_POLICY)
    try:
        replica.load_serving_state_dict(
            trainer.registry.download_serving_state(trainer.last_shipped)
        )
        base_rate = preferred_rate(replica)
        round_rewards = []
        for rnd in range(4):
            records = rollout_records(
                replica,
                trainer.last_shipped,
                64,
                user_reward,
                seed=100 + rnd,
                group_size=8,
                prefix=f"round{rnd}-",
            )
            round_rewards.append(sum(r["reward"] for r in records) / len(records))
            produce(settings, records)
            drain(trainer, 64)
            version = trainer.maybe_ship(force=True)
            replica.load_serving_state_dict(trainer.registry.download_serving_state(version))
        final_rate = preferred_rate(replica)
        cpu = time.process_time() - cpu0
    finally:
        trainer.close()
    print(
        f"preferred rate {base_rate:.3f} -> {final_rate:.3f}; rollout reward per round {round_rewards}; "
        f"trainer-process CPU {cpu:.1f}s"
    )
    assert base_rate < 0.2, f"the property must be rare at the start, got {base_rate}"
    assert final_rate >= base_rate + 0.3, f"preferred rate {base_rate:.3f} -> {final_rate:.3f}"
    assert round_rewards[-1] > round_rewards[0], round_rewards
    mv = MlflowClient(settings.mlflow_uri).get_model_version(
        settings.model_name, str(trainer.last_shipped)
    )
    assert (
        mv.tags["rollouts_consumed"] == "64"
        and json.loads(mv.tags["train_metrics"])["reward_mean"] > -0.25
    )
    assert cpu < 120, f"CPU budget: {cpu:.1f}s"
