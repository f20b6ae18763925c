"""Which version trained on a rollout record (app/api/routes/sessions.py `read_ranges`,
`trained_by`): from the offset ranges of the trainer's lineage, exact only where the version
cannot have skipped the record; malformed lineage names nothing."""

from __future__ import annotations

from types import SimpleNamespace

from app.api.routes.sessions import read_ranges, trained_by

TOPIC = "ns.rollouts"


def _version(version: str, consumed: int | None, lineage: dict) -> SimpleNamespace:
    return SimpleNamespace(version=version, rollouts_consumed=consumed, lineage=lineage)


def _offsets(parts: dict, topic: str = TOPIC) -> dict:
    return {"kafka_offsets": {"topic": topic, "partitions": parts}}


def test_a_version_that_trained_on_everything_it_read_trained_on_each_record() -> None:
    ranges = read_ranges([_version("2", 5, _offsets({"0": [0, 3], "1": [10, 12]}))], TOPIC)
    assert trained_by(ranges, 0, 0) == ("2", "2")
    assert trained_by(ranges, 1, 11) == ("2", "2")
    assert trained_by(ranges, 0, 3) == (None, None), "the range's end is exclusive"
    assert trained_by(ranges, 2, 0) == (None, None)


def test_a_version_that_skipped_some_is_only_known_to_have_read_them() -> None:
    ranges = read_ranges([_version("3", 2, _offsets({"0": [0, 3]}))], TOPIC)
    assert trained_by(ranges, 0, 1) == ("3", None)


def test_listed_skipped_offsets_make_every_other_offset_exact() -> None:
    lineage = {**_offsets({"0": [0, 4]}), "skipped_offsets": {"0": [2]}}
    ranges = read_ranges([_version("4", 3, lineage)], TOPIC)
    assert [trained_by(ranges, 0, o)[1] for o in range(4)] == ["4", "4", None, "4"]


def test_another_topic_or_malformed_lineage_names_nothing() -> None:
    versions = [
        _version("5", 1, _offsets({"0": [0, 1]}, topic="other.rollouts")),
        _version("6", 1, {"kafka_offsets": "0:0-1"}),
        _version("7", 1, _offsets({"0": [0, "1"], "x": [0, 1], "1": [0]})),
        _version("8", None, {}),
    ]
    assert read_ranges(versions, TOPIC) == []
