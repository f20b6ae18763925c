"""BatchedTable (streams/state.py): a write-back view of a real Faust table (memory store, no broker).

Reads see the batch's own writes, deletes become tombstones, and `drain()` turns the
dirty keys into one changelog record each, with the partition they were written under.
"""

from __future__ import annotations

import json

import faust
import pytest

from streams.state import BatchedTable


def _table() -> faust.Table:
    app = faust.App("unit-state", broker="kafka://127.0.0.1:1", store="memory://")
    return app.Table("t", partitions=3, key_type=str, value_type=None, default=None)


def test_reads_see_writes_and_drain_emits_one_record_per_key_with_its_partition():
    view = BatchedTable(_table())
    view.partition = 2
    view["a"] = {"v": 1}
    view["a"] = {"v": 2}
    view.partition = 0
    view["b"] = {"v": 3}
    assert view["a"] == {"v": 2} and "b" in view and sorted(view) == ["a", "b"]
    records = view.drain()
    assert sorted((json.loads(k), json.loads(v), p) for k, v, p in records) == [
        ("a", {"v": 2}, 2),
        ("b", {"v": 3}, 0),
    ]
    assert view.dirty == 0 and view.store["a"] == {"v": 2}  # applied to the store


def test_delete_is_a_tombstone_and_hides_the_stored_value():
    view = BatchedTable(_table())
    view.partition = 1
    view["a"] = {"v": 1}
    view.drain()
    del view["a"]
    assert "a" not in view and view.get("a") is None and list(view) == []
    with pytest.raises(KeyError):
        view["a"]
    assert view.drain() == [(b'"a"', None, 1)]
    assert "a" not in view.store


def test_a_write_outside_a_record_is_refused_at_drain():
    view = BatchedTable(_table())
    view["a"] = {"v": 1}
    with pytest.raises(AssertionError, match="outside a record"):
        view.drain()
