"""The session ledger's records (streams/ledger.py) are what the trainer trains on: a real
two-turn session of a tiny policy, written as the label join writes its turns, assembled by the
ledger, validates as the rollout contract and is accepted by the trainer's intake, and the
trainer's log-probs at every sampled token of both turns are the behaviour log-probs, bit for bit.

Both halves exist on their own (tests/unit/streams/test_ledger.py,
tests/unit/trainer/test_multi_turn.py); this test holds them to one another.

    .venv/bin/pytest tests/unit/trainer/test_ledger_records.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.contracts.events import encode_routes
from app.contracts.rollouts import Rollout
from policy.base import replayed_rows
from streams.ledger import Ledger, LedgerConfig
from tests.unit.streams.test_ledger import turn_rec
from tests.unit.trainer.test_multi_turn import parse, stand_in
from trainer.batch import replay_routes
from trainer.loop import Trainer
from trainer.rollouts import Batch

TOOL_RESULT = list(b"\ntool: 42\nassistant: ")


def _turns(policy, prompt: list[int], seed: int, routes: bool = False) -> list[dict]:
    """Turn 0 sampled from `prompt`; turn 1 from its prompt + completion (its eos left out, as
    the built-in template renders history) + a tool result: the label join's two records (with
    the routes each generation logged when `routes`)."""
    eos = policy.tokenizer.eos_id
    (s0,) = policy.generate([prompt], max_tokens=6, temperature=1.0, seed=seed)
    history = s0.tokens[:-1] if s0.tokens[-1] == eos else s0.tokens
    p1 = [*prompt, *history, *TOOL_RESULT]
    (s1,) = policy.generate([p1], max_tokens=6, temperature=1.0, seed=seed + 1)
    sid = f"ledger-{seed}"
    return [
        turn_rec(sid, k, p, s.tokens, logprobs=s.logprobs, model_version="3", **_logged(s, routes))
        for k, (p, s) in enumerate([(prompt, s0), (p1, s1)])
    ]


def _logged(sample, routes: bool) -> dict:
    if not routes:
        return {}
    b64, shape = encode_routes(sample.routes)
    return {"routes": b64, "route_shape": list(shape)}


def _segments(policy, routes: bool = False) -> list[dict]:
    """Three two-turn sessions, each one record of the ledger."""
    ledger = Ledger(LedgerConfig(), {})
    records = []
    for i in range(3):
        for rec in _turns(policy, list(b"def f(x):"), seed=10 * i, routes=routes):
            records += [e.value for e in ledger.on_rollout(rec, now=0.0) if e.topic == "rollouts"]
        records += [
            e.value
            for e in ledger.end_session(f"ledger-{10 * i}", now=1.0)
            if e.topic == "rollouts"
        ]
    assert len(records) == 3 and all(len(r["turns"]) == 2 for r in records), records
    return records


@pytest.fixture(scope="module")
def policy():
    from policy import build_policy
    from tests.unit.policy.conftest import TINY

    torch.manual_seed(0)
    return build_policy(dict(TINY)).eval()


def test_a_ledger_segment_is_a_record_the_trainer_scores_exactly(policy):
    records = _segments(policy)
    for r in records:
        Rollout.model_validate(r)  # the contract
    rollouts = parse(policy, records)  # the trainer's intake: no refusal
    with torch.no_grad():
        f = Trainer._forward(stand_in(policy), Batch(rollouts=rollouts, staleness=[0] * 3))  # type: ignore[arg-type]
    c = f.batch
    assert float(c.mask.sum()) == sum(sum(r["loss_mask"]) for r in records)
    # the trainer's log-prob at every sampled token of both turns is the behaviour one
    assert torch.equal(f.logprobs * c.mask, c.behav * c.mask), (f.logprobs - c.behav) * c.mask


def _forward(policy, rollouts):
    with torch.no_grad():
        f = Trainer._forward(
            stand_in(policy), Batch(rollouts=rollouts, staleness=[0] * len(rollouts))
        )  # type: ignore[arg-type]
    policy.eval()
    return f


def test_a_ledger_segment_s_routes_are_replayed_on_its_sampled_tokens_only(policy):
    records = _segments(policy, routes=True)
    rollouts = parse(policy, records)  # the intake checks the routes against the model: no refusal
    assert all(r.route_shape == [len(r.completion_tokens), 2, 2] for r in rollouts)
    f = _forward(policy, rollouts)
    c, mask = f.batch, f.batch.mask.bool()
    # what the trainer replays: each sampled token's logged experts, nothing at a mask-0 token
    for r, ids in zip(rollouts, c.routes):
        assert replayed_rows(ids).tolist() == [bool(m) for m in r.loss_mask]
        assert np.array_equal(ids[replayed_rows(ids)], r.routes_array()[np.array(r.loss_mask) == 1])
    # with the routes replayed, every sampled token of both turns scores its behaviour log-prob
    assert torch.equal(f.logprobs * c.mask, c.behav * c.mask), (f.logprobs - c.behav) * c.mask
    # ... which replaying the record's zeros between the turns too would not: they are no routing
    # the model chose (expert 0 twice), so the tokens after them would score otherwise
    with torch.no_grad():
        every_row = policy.logprobs(
            c.prompts, c.completions, [r.routes_array() for r in rollouts], c.temperatures
        )
    assert not torch.equal(every_row[mask], c.behav[mask])
    # and the sampled rows are replayed: moved off the logged experts in turn 1, its tokens move
    moved = []
    for r in rollouts:
        ids, t1 = r.routes_array(), r.turns[1]
        ids[t1.start : t1.end] = (ids[t1.start : t1.end] + 1) % 4
        moved.append(r.model_copy(update={"routes": encode_routes(ids)[0]}))
    g = _forward(policy, moved)
    for i, r in enumerate(rollouts):
        t0, t1 = r.turns
        assert torch.equal(g.logprobs[i, t0.start : t0.end], c.behav[i, t0.start : t0.end])
        assert bool((g.logprobs[i, t1.start : t1.end] != c.behav[i, t1.start : t1.end]).all())


def test_a_stale_turn_s_routes_are_not_replayed(policy):
    [r, *_] = parse(policy, _segments(policy, routes=True))
    stale = r.without_turns([0])  # the intake's mask for a stale turn 0: context, untrained
    ids = replay_routes(stale)
    assert replayed_rows(ids).tolist() == [bool(m) for m in stale.train_mask()]
    assert (
        not replayed_rows(ids)[: r.turns[0].end].any()
        and replayed_rows(ids)[r.turns[1].start :].all()
    )
