"""The session ledger's records (streams/ledger.py) are what the trainer trains on: a real
two-turn session of a tiny policy, written as the label join writes its turns, assembled by the
ledger, validates as the rollout contract and is accepted by the trainer's intake, and the
trainer's log-probs at every sampled token of both turns are the behaviour log-probs, bit for bit.

Both halves exist on their own (tests/unit/streams/test_ledger.py,
tests/unit/trainer/test_multi_turn.py); this test holds them to one another.

    .venv/bin/pytest tests/unit/trainer/test_ledger_records.py -q
"""

from __future__ import annotations

import pytest
import torch

from app.contracts.rollouts import Rollout
from streams.ledger import Ledger, LedgerConfig
from tests.unit.streams.test_ledger import turn_rec
from tests.unit.trainer.test_multi_turn import parse, stand_in
from trainer.loop import Trainer
from trainer.rollouts import Batch

TOOL_RESULT = list(b"\ntool: 42\nassistant: ")


def _turns(policy, prompt: list[int], seed: int) -> list[dict]:
    """Turn 0 sampled from `prompt`; turn 1 from its prompt + completion (its eos left out, as
    the built-in template renders history) + a tool result: the label join's two records."""
    eos = policy.tokenizer.eos_id
    (s0,) = policy.generate([prompt], max_tokens=6, temperature=1.0, seed=seed)
    history = s0.tokens[:-1] if s0.tokens[-1] == eos else s0.tokens
    p1 = [*prompt, *history, *TOOL_RESULT]
    (s1,) = policy.generate([p1], max_tokens=6, temperature=1.0, seed=seed + 1)
    sid = f"ledger-{seed}"
    return [
        turn_rec(sid, 0, prompt, s0.tokens, logprobs=s0.logprobs, model_version="3"),
        turn_rec(sid, 1, p1, s1.tokens, logprobs=s1.logprobs, model_version="3"),
    ]


@pytest.fixture(scope="module")
def policy():
    from policy import build_policy
    from tests.unit.policy.conftest import TINY

    torch.manual_seed(0)
    return build_policy(dict(TINY)).eval()


def test_a_ledger_segment_is_a_record_the_trainer_scores_exactly(policy):
    ledger = Ledger(LedgerConfig(), {})
    records = []
    for i in range(3):
        for rec in _turns(policy, list(b"def f(x):"), seed=10 * i):
            records += [e.value for e in ledger.on_rollout(rec, now=0.0) if e.topic == "rollouts"]
        records += [
            e.value
            for e in ledger.end_session(f"ledger-{10 * i}", now=1.0)
            if e.topic == "rollouts"
        ]
    assert len(records) == 3 and all(len(r["turns"]) == 2 for r in records), records
    for r in records:
        Rollout.model_validate(r)  # the contract
    rollouts = parse(policy, records)  # the trainer's intake: no refusal
    with torch.no_grad():
        f = Trainer._forward(stand_in(policy), Batch(rollouts=rollouts, staleness=[0] * 3))  # type: ignore[arg-type]
    c = f.batch
    assert float(c.mask.sum()) == sum(sum(r["loss_mask"]) for r in records)
    # the trainer's log-prob at every sampled token of both turns is the behaviour one
    assert torch.equal(f.logprobs * c.mask, c.behav * c.mask), (f.logprobs - c.behav) * c.mask
