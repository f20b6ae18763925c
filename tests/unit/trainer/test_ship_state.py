"""The trainer's typed ship state (trainer/ship_state.py) and the checkpoints it is saved in:
a state saved as string-keyed dicts (every earlier trainer's form) still loads, and the typed
state saves to the same dict form and reads back equal."""

from __future__ import annotations

import torch

from trainer.checkpoint import load_state, save_state
from trainer.rollouts import SKIP_REASONS
from trainer.ship_state import Pending, ShipIntent

# A trainer state as trainers saved it before `reward_spec_counts` and `relabelled` were counted:
# `pending` and `intent` are plain dicts, the intent's pending is the same lineage.
OLD_PENDING = {
    "rollouts": 7,
    "request_ids": ["r1", "r2", "r3", "r4", "r5", "r6", "r7"],
    "skipped": {"duplicate": 2, "stale": 0, "invalid": 1},  # no "failed": an older reason list
    "first_offsets": {0: 10, 1: 4},
    "reward_sum": 3.5,
    "metric_sums": {"loss": 1.25, "kl": 0.5},
    "steps": 2,
    "reward_specs": ["v1"],
}
OLD_STATE = {
    "model": {"w": torch.zeros(2)},
    "step": 2,
    "positions": {0: 17, 1: 4},
    "seen": ["r1"],
    "last_shipped": 3,
    "last_ship_at": 0.0,
    "committed": {0: 10},
    "pending": OLD_PENDING,
    "intent": {
        "ship_id": "abc123",
        "kind": "trained",
        "parent_version": 3,
        "positions": {0: 17, 1: 4},
        "ranges": {0: [10, 17]},
        "pending": OLD_PENDING,
        "step": 2,
    },
    "optimizer": None,
    "run_id": "run-1",
}


def test_a_checkpoint_with_the_old_dict_form_loads_into_the_typed_state(tmp_path):
    save_state(tmp_path, OLD_STATE)
    state = load_state(tmp_path)
    pending = Pending.from_dict(state["pending"])
    assert pending.rollouts == 7 and pending.steps == 2 and pending.reward_sum == 3.5
    assert pending.request_ids == OLD_PENDING["request_ids"]
    assert pending.first_offsets == {0: 10, 1: 4}
    # keys added since take their empty values; every skip reason is counted
    assert (
        pending.reward_spec_counts == {} and pending.relabelled == 0 and pending.rebased_on is None
    )
    assert pending.session_ids == [] and pending.turns == 0
    assert pending.skipped == {**dict.fromkeys(SKIP_REASONS, 0), "duplicate": 2, "invalid": 1}
    intent = ShipIntent.from_dict(state["intent"])
    assert (intent.ship_id, intent.kind, intent.parent_version, intent.step) == (
        "abc123",
        "trained",
        3,
        2,
    )
    assert intent.positions == {0: 17, 1: 4} and intent.ranges == {0: [10, 17]}
    assert intent.pending == pending


def test_partition_keys_saved_as_strings_read_back_as_ints():
    d = dict(OLD_STATE["intent"], positions={"0": 17}, ranges={"0": [10, 17]})
    intent = ShipIntent.from_dict(d)
    assert intent.positions == {0: 17} and intent.ranges == {0: [10, 17]}


def test_the_typed_state_saves_as_plain_dicts_and_reads_back_equal(tmp_path):
    pending = Pending.from_dict(OLD_PENDING)
    pending.reward_spec_counts["v1"] = 7
    pending.relabelled = 1
    pending.rebased_on = 2
    pending.session_ids = ["s1", "s2"]
    pending.turns = 9
    intent = ShipIntent("s1", "base", None, {}, {}, Pending(), 0)
    # weights_only loading (trainer/checkpoint.py) accepts only plain containers: no dataclasses
    save_state(tmp_path, {"pending": pending.to_dict(), "intent": intent.to_dict()})
    state = load_state(tmp_path)
    assert Pending.from_dict(state["pending"]) == pending
    assert ShipIntent.from_dict(state["intent"]) == intent
    assert "rebased_on" not in Pending().to_dict()  # only present once the trainer rebased
