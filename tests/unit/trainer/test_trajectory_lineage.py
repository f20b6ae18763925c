"""What a version's lineage says about trajectories: `sessions_trained` (distinct sessions of the
multi-turn records trained on) and `turns_trained` (model calls trained on: a one-call record is
one call and no session; a multi-turn record's turns that trained, a stale one left out).

Records go through the real intake (test_multi_turn's `taken`: parse, validate, per-turn
staleness) and the trainer's own accounting (`Trainer._account`) into `Pending`, then its tags.

    .venv/bin/pytest tests/unit/trainer/test_trajectory_lineage.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from policy import build_policy
from tests.unit.trainer.test_multi_turn import SPEC, record, taken, turns
from tests.unit.trainer.test_validate import record as one_call_record
from trainer.loop import Trainer
from trainer.ship_state import Pending, ShipIntent
from trainer.shipping import lineage_tags
from trainer.validate import ModelSpec


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    """test_multi_turn's model: vocabulary 259, context 64."""
    return ModelSpec.of(build_policy(SPEC), replay_routes=True, max_abs_reward=1e6)


def _intent(pending: Pending) -> ShipIntent:
    return ShipIntent("s1", "trained", 1, {}, {}, pending, 3)


def test_sessions_count_once_and_turns_count_what_trained(spec):
    records = [
        record(request_id="seg-1"),  # session "s", two fresh turns
        record(request_id="seg-2"),  # the same session's next segment
        # another session whose turn 0 (v2) is 2 versions behind: stale, masked, not a trained turn
        record(
            request_id="seg-3",
            session_id="s9",
            turns=turns((0, 2), (4, 6), versions=("2", "4")),
            loss_mask=None,
        ),
        one_call_record(request_id="one", session_id="s-one"),  # one call: 1 turn, no session
    ]
    batch = taken(spec, records, current=4)
    assert len(batch.rollouts) == 4 and batch.stale_turn_tokens == 2, batch
    holder = SimpleNamespace(pending=Pending())
    Trainer._account(holder, batch)  # type: ignore[arg-type]
    p = holder.pending
    assert p.session_ids == ["s", "s9"] and p.turns == 2 + 2 + 1 + 1, (p.session_ids, p.turns)
    tags = lineage_tags(_intent(p), "ns.rollouts")
    assert (tags["sessions_trained"], tags["turns_trained"]) == ("2", "6")
    # the next batch's segment of a session already counted adds turns, not a session
    more = taken(spec, [record(request_id="seg-4")], current=4)
    Trainer._account(holder, more)  # type: ignore[arg-type]
    assert len(p.session_ids) == 2 and p.turns == 8
    # and both survive the state file's dict form
    assert Pending.from_dict(p.to_dict()) == p


def test_a_pending_saved_before_the_counts_tags_zero():
    old = {
        k: v for k, v in Pending(rollouts=3).to_dict().items() if k not in ("session_ids", "turns")
    }
    tags = lineage_tags(_intent(Pending.from_dict(old)), "ns.rollouts")
    assert (tags["sessions_trained"], tags["turns_trained"]) == ("0", "0")
