"""The trainer scores each rollout at the temperature its replica sampled it at (the record's
`temperature`), not at its own FLYWHEEL_TRAINER_TEMPERATURE; a record written before the field
still parses and is scored at the trainer's setting, counted.

The rollouts are real generations of a tiny MoE policy at different temperatures, written as
the streams worker writes them (app/contracts/rollouts.py) and parsed as the trainer's intake parses
them (`parse_rollout`). The trainer's objective (`Trainer._loss`) runs on a stand-in holding only
what it reads (config, policy, no reference policy): a Trainer needs MLflow and Kafka.

    .venv/bin/pytest tests/unit/trainer/test_rollout_temperature.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import REGISTRY

from app.contracts.events import encode_routes
from app.contracts.rollouts import Rollout as RolloutRecord
from policy import build_policy
from tests.unit.policy.conftest import TINY, make_prompts
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.rollouts import Batch, parse_rollout
from trainer.ship_state import Pending
from trainer.validate import ModelSpec

TEMPERATURES = (0.7, 1.3, 0.0)  # 0 = greedy, scored at T = 1


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return build_policy(dict(TINY)).eval()


def _records(policy, temperatures=TEMPERATURES) -> list[dict]:
    """One generation per temperature, as rollout records (dicts of the topic's JSON)."""
    out = []
    prompts = make_prompts(len(temperatures), seed=5)
    for i, (prompt, t) in enumerate(zip(prompts, temperatures, strict=True)):
        [s] = policy.generate([prompt], max_tokens=12, temperature=t, seed=11 + i)
        routes, shape = encode_routes(s.routes)
        record = RolloutRecord(
            request_id=f"r{i}",
            session_id="s",
            group_id=None,
            model_version="1",
            prompt_tokens=prompt,
            completion_tokens=s.tokens,
            logprobs=s.logprobs,
            routes=routes,
            route_shape=list(shape),
            reward=float(i),
            components=None,
            tool_errors=[],
            reward_spec="v1",
            generated_at="2026-01-01T00:00:00Z",
            labelled_at="2026-01-01T00:15:00Z",
            closed_by="window",
            tokenizer="byte-v1",
            temperature=t,
        )
        out.append(json.loads(record.model_dump_json()))
    return out


def _parse(policy, records: list[dict]):
    spec = ModelSpec.of(policy, replay_routes=True, max_abs_reward=1e6)
    parsed = [parse_rollout(json.dumps(r).encode(), spec) for r in records]
    assert all(refusal is None for _, refusal in parsed), parsed
    return [rollout for rollout, _ in parsed]


def _scored(policy, rollouts, trainer_temperature: float):
    """The trainer's recomputed log-probs of `rollouts` and the behaviour ones, masked."""
    cfg = TrainerConfig(temperature=trainer_temperature, distill_coef=0.0)
    stand_in = SimpleNamespace(cfg=cfg, policy=policy, ref_policy=None)
    batch = Batch(rollouts=rollouts, staleness=[0] * len(rollouts))
    with torch.no_grad():
        f = Trainer._forward(stand_in, batch)  # type: ignore[arg-type]
    logp, c = f.logprobs, f.batch
    policy.eval()
    return logp * c.mask, c.behav * c.mask


def test_each_rollout_is_scored_at_its_own_temperature(policy):
    rollouts = _parse(policy, _records(policy))
    assert [r.temperature for r in rollouts] == list(TEMPERATURES)
    # whatever the trainer's own setting, every rollout's log-probs are those it was sampled with
    for setting in (1.0, 0.5):
        logp, behav = _scored(policy, rollouts, setting)
        assert torch.equal(logp, behav), (setting, (logp - behav).abs().max())


def test_a_rollout_without_temperature_parses_and_is_scored_at_the_trainer_s_setting(policy):
    records = _records(policy, (0.7, 0.7))
    del records[1]["temperature"]  # a record written before the field
    rollouts = _parse(policy, records)
    assert [r.temperature for r in rollouts] == [0.7, None]
    assert collate(rollouts, 0.5).temperatures.tolist() == pytest.approx([0.7, 0.5])

    logp, behav = _scored(policy, rollouts, 0.7)  # the trainer's setting matches the replica's
    assert torch.equal(logp, behav)
    logp, behav = _scored(policy, rollouts, 1.0)  # it does not: only the old record is off
    assert torch.equal(logp[0], behav[0])
    assert float((logp[1] - behav[1]).abs().max()) > 1e-3


def test_rollouts_trained_without_a_temperature_are_counted(policy):
    records = _records(policy, (0.7, 1.3))
    del records[0]["temperature"]
    rollouts = _parse(policy, records)
    name = "flywheel_trainer_rollouts_assumed_temperature_total"
    before = REGISTRY.get_sample_value(name) or 0.0
    Trainer._account(SimpleNamespace(pending=Pending()), Batch(rollouts=rollouts))  # type: ignore[arg-type]
    assert REGISTRY.get_sample_value(name) == before + 1
