"""A multi-turn record (a session's segment: `turns` + `loss_mask`) through the real trainer: trained
exactly once beside one-call records, on its sampled tokens only, and counted in the lineage
(`sessions_trained`, `turns_trained`); one longer than the model's context is refused whole and
dead-lettered (`sequence_too_long`).

Real broker and MLflow server, a tiny real policy (tests/integration/trainer/conftest.py). The
session is two generations of the trainer's own policy around a tool result, written as the
session ledger writes it (app/contracts/rollouts.py); it is produced twice (a re-delivery).
Run: .venv/bin/pytest tests/integration/trainer/test_multi_turn_trainer.py -q
"""

from __future__ import annotations

import json
import uuid

import pytest
from mlflow import MlflowClient

from tests.integration.trainer.conftest import drain, produce, read_dlq, rollout_records
from tests.unit.trainer.test_validate import record as base_record
from trainer.config import TrainerConfig
from trainer.loop import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOOL = [10, 11, 12]  # a tool result between the turns: context, not trained on


def session_record(policy, version: int) -> dict:
    """Two sampled turns of `policy` around a tool result, as one multi-turn rollout record."""
    prompt = policy.tokenizer.encode("def add(a, b):\n    ")
    [s0] = policy.generate([prompt], max_tokens=8, temperature=1.0, seed=3)
    [s1] = policy.generate([prompt + s0.tokens + TOOL], max_tokens=8, temperature=1.0, seed=4)
    a, b = len(s0.tokens), len(s0.tokens) + len(TOOL)
    span = {"model_version": str(version), "temperature": 1.0}
    return base_record(
        request_id=f"session-{uuid.uuid4().hex[:8]}",
        session_id="s-agent",
        model_version=str(version),
        prompt_tokens=prompt,
        completion_tokens=s0.tokens + TOOL + s1.tokens,
        logprobs=s0.logprobs + [0.0] * len(TOOL) + s1.logprobs,
        routes=None,
        route_shape=None,
        reward=1.0,
        temperature=1.0,
        turns=[
            dict(span, request_id="call-0", start=0, end=a),
            dict(span, request_id="call-1", start=b, end=b + len(s1.tokens)),
        ],
        loss_mask=[1] * a + [0] * len(TOOL) + [1] * len(s1.tokens),
    )


def test_a_multi_turn_record_trains_once_and_is_counted_in_the_lineage(trainer_env):
    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**dict(cfg_kw, distill_coef=0.0)))
    try:
        one_call = rollout_records(trainer.policy, 1, 3, lambda text: float(len(text) % 2))
        session = session_record(trainer.policy, 1)
        context = trainer.policy.config_dict()["max_context"]
        too_long = dict(  # the same session with more history than the model's context holds
            session,
            request_id="session-too-long",
            prompt_tokens=[32] * (context - len(session["completion_tokens"])),
        )
        produce(settings, [*one_call, session, session, too_long])
        drain(trainer, 6)
        p = trainer.pending
        assert p.rollouts == 4 and p.skipped["duplicate"] == 1 and p.steps >= 1, p
        assert p.skipped["invalid"] == 1 and "session-too-long" not in p.request_ids, p
        [letter] = read_dlq(settings, 1)
        assert letter["reason"] == "sequence_too_long", letter
        assert "turns[1]" in letter["errors"][0]["message"], letter
        assert p.request_ids.count(session["request_id"]) == 1, p.request_ids
        trained = sum(len(r["completion_tokens"]) for r in one_call) + sum(session["loss_mask"])
        assert p.metric_sums["batch_tokens"] == trained, (p.metric_sums, trained)
        assert p.metric_sums["multi_turn_rollouts"] == 1.0, p.metric_sums
        version = trainer.maybe_ship(force=True)
        tags = (
            MlflowClient(settings.mlflow_uri)
            .get_model_version(settings.model_name, str(version))
            .tags
        )
        assert tags["rollouts_consumed"] == "4", tags
        # one session; 3 one-call records + the session's 2 turns
        assert (tags["sessions_trained"], tags["turns_trained"]) == ("1", "5"), tags
        metrics = json.loads(tags["train_metrics"])
        # the lineage's step metrics are means per step
        assert metrics["batch_tokens"] == pytest.approx(trained / p.steps), (metrics, trained)
        assert metrics["multi_turn_rollouts"] == pytest.approx(1.0 / p.steps), metrics
    finally:
        trainer.close()
