"""The pure parts of the distributed trainer (trainer/distributed.py, trainer/loop.py): how the
global batch is split, which rank reads which partition, how the ranks' lineage, dedupe keys and
step metrics combine. The collectives themselves run in tests/integration/trainer/test_distributed.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer.config import TrainerConfig
from trainer.distributed import World, allocate, owned_partitions
from trainer.loop import combine_metrics
from trainer.rollouts import DedupeSet
from trainer.ship_state import Pending


def test_allocate_splits_the_global_batch_round_robin_within_what_each_rank_holds():
    assert allocate([5, 0, 3], 4) == [2, 0, 2]
    assert allocate([1, 9], 6) == [1, 5]
    assert allocate([2, 2], 16) == [2, 2]
    assert allocate([0, 0], 4) == [0, 0]
    assert sum(allocate([7, 7, 7], 16)) == 16


def test_each_partition_has_exactly_one_rank():
    parts = [0, 1, 2, 3, 4]
    mine = [owned_partitions(parts, World(rank=r, size=2)) for r in range(2)]
    assert mine == [[0, 2, 4], [1, 3]]
    three = [owned_partitions(parts, World(rank=r, size=3)) for r in range(3)]
    assert sorted(p for m in three for p in m) == parts


def test_single_world_collectives_are_the_identity():
    w = World.single()
    assert not w.distributed and w.is_main
    assert w.all_gather({"a": 1}) == [{"a": 1}]
    assert w.broadcast(7) == 7 and w.sum(3) == 3 and w.any(False) is False
    w.barrier("nothing")  # no process group: returns at once


def test_pending_merge_adds_what_ranks_trained_and_keeps_what_they_share():
    a = Pending(
        rollouts=2,
        request_ids=["a1", "a2"],
        first_offsets={0: 5},
        reward_sum=1.5,
        metric_sums={"loss": 0.4},
        steps=3,
        reward_specs=["v1"],
        reward_spec_counts={"v1": 2},
        session_ids=["s1", "s2"],
        turns=5,
        rebased_on=4,
    )
    a.skipped["duplicate"] = 1
    b = Pending(
        rollouts=1,
        request_ids=["b1"],
        first_offsets={1: 9},
        reward_sum=-0.5,
        metric_sums={"loss": 0.4},
        steps=3,
        reward_specs=["v2"],
        reward_spec_counts={"v2": 1},
        relabelled=1,
        session_ids=["s2", "s3"],  # s2's segments were on both ranks' partitions
        turns=2,
        rebased_on=4,
    )
    b.skipped["invalid"] = 2
    m = Pending.merge([a, b])
    assert m.rollouts == 3 and m.request_ids == ["a1", "a2", "b1"]
    assert m.first_offsets == {0: 5, 1: 9} and m.reward_sum == 1.0
    assert m.skipped["duplicate"] == 1 and m.skipped["invalid"] == 2
    assert m.reward_specs == ["v1", "v2"] and m.reward_spec_counts == {"v1": 2, "v2": 1}
    assert m.relabelled == 1
    assert m.session_ids == ["s1", "s2", "s3"] and m.turns == 7, "a session counts once"
    assert m.steps == 3 and m.metric_sums == {"loss": 0.4} and m.rebased_on == 4
    # a restored merged lineage counts once: the other ranks keep only the shared fields
    rest = m.local_part()
    assert rest.rollouts == 0 and rest.request_ids == [] and rest.steps == 3
    assert rest.session_ids == [] and rest.turns == 0
    again = Pending.merge([m, rest])
    assert again.to_dict() == m.to_dict()


def test_dedupe_keys_added_since_the_last_save_go_to_rank_0():
    s = DedupeSet(3)
    s.add(("r0", "v1"))
    assert s.drain_added() == [], "not recorded unless switched on (one process)"
    s.added = []
    s.add(("r1", "v1"))
    s.add(("r2", "v2"))
    assert s.drain_added() == [["r1", "v1"], ["r2", "v2"]]
    assert s.drain_added() == []
    main = DedupeSet(3, [["x", "v1"]])
    main.merge([["r1", "v1"], ["r2", "v2"], ["r3", "v1"]])
    assert ("x", "v1") not in main, "capacity evicts the oldest"
    assert all(k in main for k in [("r1", "v1"), ("r2", "v2"), ("r3", "v1")])


def test_step_metrics_combine_over_ranks():
    r0 = {
        "loss": 0.25,
        "pg_loss": 0.25,
        "batch_rollouts": 3.0,
        "batch_tokens": 30.0,
        "reward_mean": 1.0,
        "logprob_gap": 0.0,
        "grad_norm": 2.0,
        "staleness_max": 1.0,
    }
    r1 = {
        "loss": 0.5,
        "pg_loss": 0.5,
        "batch_rollouts": 1.0,
        "batch_tokens": 10.0,
        "reward_mean": -1.0,
        "logprob_gap": 0.4,
        "grad_norm": 2.0,
        "staleness_max": 3.0,
        "mismatch": 0.1,
    }
    m = combine_metrics([r0, None, r1])
    assert m["loss"] == 0.75 and m["batch_rollouts"] == 4.0 and m["batch_tokens"] == 40.0
    assert m["reward_mean"] == pytest.approx(0.5)  # by rollouts
    assert m["logprob_gap"] == pytest.approx(0.1)  # by tokens
    assert m["grad_norm"] == 2.0 and m["staleness_max"] == 3.0
    assert m["mismatch"] == pytest.approx(0.1), "a metric only one rank has is that rank's"
    assert combine_metrics([r0]) == r0, "one rank: unchanged"


def test_pause_hook_takes_a_rank():
    assert TrainerConfig(pause_at="after_register@0").pause_at == "after_register@0"
    assert TrainerConfig(pause_at="after_optimizer_step:3@1").pause_at == "after_optimizer_step:3@1"
    with pytest.raises(ValidationError, match="must be one of"):
        TrainerConfig(pause_at="nowhere@1")


def test_rank_settings_are_validated():
    with pytest.raises(ValidationError):
        TrainerConfig(parallel="tp")
    with pytest.raises(ValidationError):
        TrainerConfig(nproc=0)
    with pytest.raises(ValidationError):
        TrainerConfig(dist_backend="mpi")
