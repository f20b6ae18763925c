"""The trainer's dedupe key (request_id, reward_spec) and its persisted form.

A relabelled rollout (`flywheel streams relabel`) shares its request_id with the live one: it
is new data under another spec, trained on once; a repeat of either is a duplicate. State
files that hold plain request_ids still load and still stop repeats of live rollouts.
"""

from __future__ import annotations

import json

import torch

from tests.unit.trainer.test_intake_state import record
from trainer.checkpoint import load_state, save_state
from trainer.rollouts import DedupeSet, dedupe_key, parse_rollout
from trainer.ship_state import Pending, ShipIntent
from trainer.shipping import lineage_tags, reward_spec_detail


def rollout(**overrides):
    r, refusal = parse_rollout(json.dumps(record(**overrides)).encode())
    assert refusal is None, refusal
    return r


def test_the_key_is_request_id_and_reward_spec():
    live, relabelled = rollout(), rollout(reward_spec="v2", reward=-1.0, relabel_run="run-1")
    assert dedupe_key(live) == ("r1", "v1") and dedupe_key(relabelled) == ("r1", "v2")
    seen = DedupeSet(10)
    seen.add(dedupe_key(live))
    assert seen.seen(live) and not seen.seen(relabelled)
    seen.add(dedupe_key(relabelled))
    assert seen.seen(
        rollout(reward_spec="v2", relabel_run="run-2")
    )  # a second relabel run under v2: a repeat


def test_keys_survive_the_state_file_and_plain_request_ids_from_old_states_still_load(tmp_path):
    seen = DedupeSet(3)
    for key in [("a", "v1"), ("a", "v2"), ("b", "v1")]:
        seen.add(key)
    save_state(tmp_path, {"seen": seen.to_list()})
    loaded = DedupeSet(3, load_state(tmp_path)["seen"])
    assert loaded.to_list() == [["a", "v1"], ["a", "v2"], ["b", "v1"]] and ("a", "v2") in loaded
    old = DedupeSet(3, ["r1", "r2"])  # an older trainer's state: request_ids of live rollouts
    assert old.seen(rollout()) and old.seen(rollout(reward_spec="v7"))
    assert not old.seen(rollout(reward_spec="v2", relabel_run="run-1")), (
        "a relabelled rollout is new data"
    )
    old.add(("r3", "v1"))
    assert old.to_list() == ["r1", "r2", ["r3", "v1"]]
    save_state(tmp_path, {"seen": old.to_list(), "w": torch.zeros(1)})
    assert DedupeSet(3, load_state(tmp_path)["seen"]).to_list() == ["r1", "r2", ["r3", "v1"]]


def test_lineage_tags_count_rollouts_per_spec_and_old_pendings_still_tag():
    pending = dict(
        Pending().to_dict(),
        rollouts=5,
        steps=1,
        reward_specs=["v1", "v2"],
        reward_spec_counts={"v1": 2, "v2": 3},
        relabelled=3,
    )
    intent = {
        "ship_id": "s1",
        "kind": "trained",
        "parent_version": 1,
        "positions": {},
        "ranges": {},
        "pending": pending,
        "step": 3,
    }
    tags = lineage_tags(ShipIntent.from_dict(intent), "ns.rollouts")
    assert tags["reward_spec"] == "v1,v2" and json.loads(tags["reward_specs"]) == {"v1": 2, "v2": 3}
    assert tags["rollouts_relabelled"] == "3"
    old = {k: v for k, v in pending.items() if k not in ("reward_spec_counts", "relabelled")}
    tags = lineage_tags(ShipIntent.from_dict(dict(intent, pending=old)), "ns.rollouts")
    assert tags["reward_specs"] == "{}" and tags["rollouts_relabelled"] == "0"


def test_the_event_detail_reward_spec_fits_the_projection_column_or_is_left_to_reward_specs():
    assert reward_spec_detail("v1,v2") == "v1,v2"
    assert reward_spec_detail("none") is None
    assert reward_spec_detail("v1,v2-no-tool-hack") is None  # 18 characters: the column holds 16
