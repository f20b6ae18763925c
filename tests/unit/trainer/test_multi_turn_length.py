"""A multi-turn record longer than the model's context is refused whole (`sequence_too_long`:
counted, dead-lettered, skipped as invalid), naming the first turn past the context; it is never
split into rows that fit, since each would score its turn given less context than the turn was
sampled with (docs/TRAINER.md "The objective on trajectories"). A one-call record keeps its
refusal as before (tests/unit/trainer/test_validate.py).

    .venv/bin/pytest tests/unit/trainer/test_multi_turn_length.py -q
"""

from __future__ import annotations

import json

import pytest

from policy import build_policy
from tests.unit.trainer.test_multi_turn import SPEC, _Consumer, record, refusal_of
from tests.unit.trainer.test_validate import record as one_call_record
from trainer.metrics import REFUSED
from trainer.rollouts import DedupeSet, RolloutIntake
from trainer.validate import ModelSpec

# test_multi_turn's record: 6 completion tokens, turn 0 sampled [0, 2), turn 1 [4, 6); context 64
FITS = [100] * 57  # 1 (bos) + 57 + 6 = 64: exactly the context
LONG = [100] * 60  # 1 + 60 + 6 = 67: turn 0 ends at token 63, turn 1 at 67


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    """test_multi_turn's model: vocabulary 259, context 64."""
    return ModelSpec.of(build_policy(SPEC), replay_routes=True, max_abs_reward=1e6)


def test_a_multi_turn_record_that_fits_exactly_is_accepted(spec):
    assert refusal_of(record(prompt_tokens=FITS), spec) is None


def test_a_multi_turn_record_past_the_context_is_refused_whole_naming_its_turn(spec):
    refusal = refusal_of(record(prompt_tokens=LONG), spec)
    assert refusal is not None
    assert (refusal.reason, refusal.field) == ("sequence_too_long", "completion_tokens")
    assert "= 67 exceed the model's context 64; turns[1] ends at token 67" in refusal.message
    assert "not split" in refusal.message, refusal.message
    # a one-call record's message is what it was
    one = refusal_of(one_call_record(prompt_tokens=[100] * 62), spec)
    assert one.reason == "sequence_too_long" and "turns[" not in one.message, one


class _Letters:
    """What the intake hands a dead letter to (trainer/dlq.py `DeadLetters.send`)."""

    def __init__(self):
        self.sent = []

    def send(self, src, reason, errors):
        self.sent.append((src.offset, reason, errors))


def test_the_intake_counts_and_dead_letters_it_and_trains_on_the_rest(spec):
    letters = _Letters()
    values = [record(request_id="long", prompt_tokens=LONG), record(request_id="fits")]
    intake = RolloutIntake(
        _Consumer([json.dumps(v).encode() for v in values]),
        "ns.rollouts",
        positions={},
        seen=DedupeSet(10),
        max_staleness=4,
        spec=spec,
        dead_letters=letters,
    )
    before = REFUSED.labels("sequence_too_long")._value.get()
    intake.poll(0)
    batch = intake.take(2, current_version=4)
    assert [r.request_id for r in batch.rollouts] == ["fits"] and batch.skipped["invalid"] == 1
    assert REFUSED.labels("sequence_too_long")._value.get() == before + 1
    [(offset, reason, errors)] = letters.sent
    assert (offset, reason) == (0, "sequence_too_long") and "turns[1]" in errors[0]["message"]
    assert intake.positions == {0: 2}, "the refused record is processed: positions move past it"
