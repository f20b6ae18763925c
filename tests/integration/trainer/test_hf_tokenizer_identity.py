"""A rollout made with another tokenizer of the same name is refused, counted and dead-lettered.

Real broker (tests/conftest.py `make_settings`); the trainer's own intake (trainer/rollouts.py
`RolloutIntake`) with the spec of a real HF policy: a tiny Qwen2-MoE directory built offline
(tests/hf_models.py). Two rollouts sampled from it go to `<ns>.rollouts`: one names the policy's
tokenizer id (`<name>@<hash of the tokenizer files>`), the other the same name with another hash
(a tokenizer whose files were edited). The first is buffered for training; the second is refused
as `tokenizer_mismatch`, counted in `flywheel_trainer_rollouts_refused_total` and on `<ns>.dlq`.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/trainer/test_hf_tokenizer_identity.py -q
"""

from __future__ import annotations

import time
import uuid

import pytest

from app.infra.kafka import make_consumer, make_producer
from tests.integration.trainer.conftest import produce, read_dlq, refused_count, rollout_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_a_rollout_from_a_same_named_tokenizer_with_other_files_is_refused_and_counted(
    make_settings, tmp_path
):
    from policy import build_policy
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer
    from trainer.dlq import DeadLetters
    from trainer.rollouts import DedupeSet, RolloutIntake
    from trainer.validate import ModelSpec

    settings = make_settings()
    model_dir = tiny_qwen2_moe_dir(tmp_path / "tiny-moe", train_bpe_tokenizer(tmp_path / "tok"))
    policy = build_policy({"type": "hf", "model_dir": str(model_dir)}).eval()
    name, digest = policy.tokenizer.name.split("@")
    foreign = f"{name}@{'0' * 16 if digest != '0' * 16 else '1' * 16}"
    good, bad = rollout_records(policy, 1, 2, lambda _text: 1.0, seed=3)
    good["tokenizer"], bad["tokenizer"] = policy.tokenizer.name, foreign
    produce(settings, [good, bad])

    producer = make_producer(settings)
    consumer = make_consumer(settings, group_id=f"test-intake-{uuid.uuid4().hex[:8]}")
    before = refused_count("tokenizer_mismatch")
    try:
        intake = RolloutIntake(
            consumer,
            settings.topic("rollouts"),
            positions={},
            seen=DedupeSet(100),
            max_staleness=4,
            spec=ModelSpec.of(policy, replay_routes=True, max_abs_reward=1e6),
            dead_letters=DeadLetters(producer, settings.topic("dlq"), 1 << 20),
        )
        deadline = time.monotonic() + 90
        while intake.buffered() < 2:
            assert time.monotonic() < deadline, f"intake buffered {intake.buffered()} of 2"
            intake.poll(500)
        intake.dead_letters.flush()
        batch = intake.take(10, current_version=1)
    finally:
        consumer.close()
        producer.close(5)

    assert [r.request_id for r in batch.rollouts] == [good["request_id"]]
    assert batch.rollouts[0].tokenizer == policy.tokenizer.name
    assert batch.skipped["invalid"] == 1
    assert refused_count("tokenizer_mismatch") == before + 1
    letters = read_dlq(settings, 1)
    assert [d["reason"] for d in letters] == ["tokenizer_mismatch"]
    assert foreign in letters[0]["errors"][0]["message"]
    assert letters[0]["errors"][0]["field"] == "tokenizer"
