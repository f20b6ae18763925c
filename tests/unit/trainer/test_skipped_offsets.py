"""The offsets a version read and did not train on (`skipped_offsets` of its `version_registered`):
listed by the intake for every skip reason, kept in the pending lineage (saved, merged over ranks,
bounded), and published only when they account for every offset of the version's ranges, in the
shape the sessions API reads (app/api/routes/sessions.py `read_ranges`).

Run: .venv/bin/pytest tests/unit/trainer/test_skipped_offsets.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from app.api.routes.sessions import read_ranges, trained_by
from tests.unit.trainer.test_intake_state import record
from trainer.checkpoint import load_state, save_state
from trainer.rollouts import DedupeSet, RolloutIntake
from trainer.ship_state import MAX_SKIPPED_OFFSETS, Pending, ShipIntent
from trainer.shipping import skipped_offsets_detail

TOPIC = "ns.rollouts"


class _Consumer:
    """A consumer holding (partition, offset, value) records (what `RolloutIntake.poll` reads)."""

    def __init__(self, records: list[tuple[int, int, bytes]]):
        from kafka.structs import TopicPartition

        self.records: dict = {}
        for part, offset, value in records:
            self.records.setdefault(TopicPartition(TOPIC, part), []).append(
                SimpleNamespace(offset=offset, key=None, value=value)
            )

    def subscribe(self, topics, listener=None):
        pass

    def poll(self, timeout_ms, max_records):
        out, self.records = self.records, {}
        return out


def _value(**overrides) -> bytes:
    return json.dumps(record(**{"model_version": "5", **overrides})).encode()


def test_the_intake_lists_the_offset_of_every_record_it_skips():
    """Partition 0: a rollout, its duplicate, bytes that are no rollout, a rollout two versions
    behind (stale at max_staleness 1); partition 1: a rollout and its duplicate."""
    consumer = _Consumer(
        [
            (0, 10, _value(request_id="a")),
            (0, 11, _value(request_id="a")),
            (0, 12, b"not json"),
            (0, 13, _value(request_id="old", model_version="3")),
            (1, 4, _value(request_id="b")),
            (1, 5, _value(request_id="b")),
        ]
    )
    intake = RolloutIntake(consumer, TOPIC, positions={}, seen=DedupeSet(100), max_staleness=1)
    intake.poll(0)
    batch = intake.take(10, current_version=5)
    assert [r.request_id for r in batch.rollouts] == ["a", "b"]
    assert batch.skipped == {"duplicate": 2, "invalid": 1, "stale": 1, "failed": 0}
    assert batch.skipped_offsets == {0: [11, 12, 13], 1: [5]}
    # a batch cut to the rollouts a step consumed keeps what was skipped
    assert batch.only([0]).skipped_offsets == {0: [11, 12, 13], 1: [5]}

    p = Pending()
    p.add_skipped_offsets(batch.skipped_offsets)
    p.add_skipped_offsets({1: [7], 2: []})
    assert p.skipped_offsets == {0: [11, 12, 13], 1: [5, 7]}


def test_more_offsets_than_the_bound_make_the_list_unknown_until_the_next_ship():
    p = Pending()
    p.add_skipped_offsets({0: list(range(MAX_SKIPPED_OFFSETS))})
    assert p.skipped_offsets is not None, "exactly the bound is still listed"
    p.add_skipped_offsets({1: [0]})
    assert p.skipped_offsets is None
    p.add_skipped_offsets({1: [1]})
    assert p.skipped_offsets is None, "unknown stays unknown"
    assert p.to_dict()["skipped_offsets"] is None, "saved as unknown, not left out"
    assert Pending.from_dict(p.to_dict()).skipped_offsets is None
    q = Pending()
    q.add_skipped_offsets(None)
    assert q.skipped_offsets is None


def test_skipped_offsets_are_saved_with_the_state_and_read_back(tmp_path):
    p = Pending(rollouts=2, skipped_offsets={0: [3, 5], 2: [1]})
    p.skipped["duplicate"] = 3
    intent = ShipIntent("ship", "trained", 1, {0: 6, 2: 2}, {0: [2, 6], 2: [1, 2]}, p, 4)
    unknown = Pending(rollouts=1, skipped_offsets=None)
    save_state(
        tmp_path,
        {"pending": p.to_dict(), "intent": intent.to_dict(), "unknown": unknown.to_dict()},
    )
    state = load_state(tmp_path)
    assert Pending.from_dict(state["pending"]) == p
    assert Pending.from_dict(state["unknown"]).skipped_offsets is None
    assert ShipIntent.from_dict(state["intent"]).pending.skipped_offsets == {0: [3, 5], 2: [1]}
    # partition keys saved as strings (a JSON round trip) read back as ints
    assert Pending.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_a_lineage_saved_before_offsets_were_listed_has_them_unknown_unless_nothing_was_skipped():
    old = Pending(rollouts=3).to_dict()
    del old["skipped_offsets"]
    assert Pending.from_dict(old).skipped_offsets == {}, "no skip: none skipped, known"
    old["skipped"] = {"duplicate": 1, "stale": 0, "invalid": 0}
    assert Pending.from_dict(old).skipped_offsets is None


def test_merge_joins_the_ranks_offsets_and_is_unknown_if_any_rank_is():
    a = Pending(skipped_offsets={0: [4]})
    b = Pending(skipped_offsets={1: [9, 11]})
    assert Pending.merge([a, b]).skipped_offsets == {0: [4], 1: [9, 11]}
    assert Pending.merge([a, Pending(skipped_offsets=None)]).skipped_offsets is None
    # a restored merged lineage counts once: the other ranks' parts list none
    m = Pending.merge([a, b])
    assert Pending.merge([m, m.local_part()]).skipped_offsets == m.skipped_offsets
    # the bound holds for the merged list too
    half = MAX_SKIPPED_OFFSETS // 2 + 1
    big = [Pending(skipped_offsets={r: list(range(half))}) for r in range(2)]
    assert Pending.merge(big).skipped_offsets is None


def _intent(rollouts: int, skipped_offsets: dict | None, ranges: dict) -> ShipIntent:
    p = Pending(rollouts=rollouts, skipped_offsets=skipped_offsets)
    p.skipped["duplicate"] = sum(map(len, (skipped_offsets or {}).values()))
    return ShipIntent("ship", "trained", 1, {}, ranges, p, 1)


def test_the_event_detail_lists_them_by_partition_only_when_they_account_for_the_ranges():
    intent = _intent(4, {1: [12, 10], 0: [3], 2: []}, {0: [0, 4], 1: [10, 13]})
    assert skipped_offsets_detail(intent) == {"0": [3], "1": [10, 12]}
    assert skipped_offsets_detail(_intent(2, {}, {0: [0, 2]})) == {}, "none skipped: known"
    assert skipped_offsets_detail(_intent(2, None, {0: [0, 4]})) is None, "unknown"
    # trained + listed short of the ranges (records never read): not certain, left out
    assert skipped_offsets_detail(_intent(1, {0: [3]}, {0: [0, 4]})) is None
    # a skip counted without its offset
    miscounted = _intent(3, {0: [3]}, {0: [0, 4]})
    miscounted.pending.skipped["failed"] = 1
    assert skipped_offsets_detail(miscounted) is None


def test_the_sessions_api_reads_the_detail_as_exact():
    """What the trainer publishes is what app/api/routes/sessions.py reads: every offset of the
    ranges but the skipped ones is trained by the version."""
    intent = _intent(5, {0: [1], 1: [11]}, {0: [0, 4], 1: [10, 13]})
    lineage = {
        "kafka_offsets": {
            "topic": TOPIC,
            "partitions": {str(k): v for k, v in intent.ranges.items()},
        },
        "skipped_offsets": json.loads(json.dumps(skipped_offsets_detail(intent))),
    }
    mv = SimpleNamespace(version="7", rollouts_consumed=5, lineage=lineage)
    ranges = read_ranges([mv], TOPIC)
    assert [trained_by(ranges, 0, o)[1] for o in range(4)] == ["7", None, "7", "7"]
    assert [trained_by(ranges, 1, o)[1] for o in range(10, 13)] == ["7", None, "7"]
    assert trained_by(ranges, 1, 11) == ("7", None)
