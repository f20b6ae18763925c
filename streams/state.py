"""Write-back views of Faust tables: one changelog record per touched key per batch.

Why. A Faust table sends one changelog record for every `table[key] = value`. The join
touches a request's label on every event (open, each feedback, close), so a plain table
costs one producer round trip per event plus one per generation and close, and that path
(send_soon -> producer buffer task -> aiokafka) dominated the worker's time. The agent
now processes records in batches (`stream.take_events`) and reads and writes the tables
through a `BatchedTable`: reads fall through to the table's store, writes stay in a
dirty map, and `drain()` applies each dirty key to the store once and returns one
changelog record for it, encoded exactly as Faust's json codec encodes its own changelog
writes (so recovery after a restart reads them back unchanged); the agent sends them
with streams.outbox after the batch's outputs.

Which changelog partition. Faust writes a key to the partition of the event being
processed. Every key the join touches while handling a record (or tick) of partition p
belongs to partition p (the record key is the request_id, checked on input), so the
agent sets `partition` before each record, as Faust's `current_event` does.

    view = BatchedTable(app_table)
    view.partition = 2
    view["r1"] = {...}            # in memory only
    records = view.drain()        # store updated; [(b'"r1"', b'{...}', 2)] for the changelog
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import orjson
from faust.types import TP

_DELETED = object()


class BatchedTable(MutableMapping[str, Any]):
    """A Faust table seen through a write-back cache (one agent, concurrency 1: not thread-safe)."""

    def __init__(self, table: Any):
        assert (table.key_serializer, table.value_serializer) == ("json", "json"), (
            f"table {table.name}: BatchedTable writes Faust's json encoding, got {table.key_serializer}/{table.value_serializer}"
        )
        self.table = table
        self.partition: int | None = None
        self._dirty: dict[str, tuple[int | None, Any]] = {}
        self.records_sent = 0

    @property
    def store(self) -> Any:
        """The table's Store (memory or RocksDB): a mapping without changelog side effects."""
        return self.table.data

    # --- mapping API (what the Aggregator uses) ------------------------------------------
    def __getitem__(self, key: str) -> Any:
        hit = self._dirty.get(key)
        if hit is not None:
            if hit[1] is _DELETED:
                raise KeyError(key)
            return hit[1]
        return self.store[key]

    def get(self, key: str, default: Any = None) -> Any:
        hit = self._dirty.get(key)
        if hit is not None:
            return default if hit[1] is _DELETED else hit[1]
        try:
            return self.store[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return self.get(key, _DELETED) is not _DELETED  # type: ignore[arg-type]

    def __setitem__(self, key: str, value: Any) -> None:
        assert value is not None, f"None is the changelog tombstone; delete {key!r} instead"
        self._dirty[key] = (self.partition, value)

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self._dirty[key] = (self.partition, _DELETED)

    def __iter__(self) -> Iterator[str]:
        for key, (_, value) in list(self._dirty.items()):
            if value is not _DELETED:
                yield key
        for key in list(self.store.keys()):
            if key not in self._dirty:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    # --- batch end -------------------------------------------------------------------------
    @property
    def dirty(self) -> int:
        return len(self._dirty)

    @property
    def changelog(self) -> str:
        return self.table.changelog_topic.get_topic_name()

    def drain(self) -> list[tuple[bytes, bytes | None, int]]:
        """Apply the dirty keys to the store; returns one changelog record (key, value, partition) per key."""
        dirty, self._dirty = self._dirty, {}
        out = []
        for key, (partition, value) in dirty.items():
            assert partition is not None, (
                f"table {self.table.name}: write to {key!r} outside a record (no partition set)"
            )
            if value is _DELETED:
                self.store.pop(key, None)
                out.append((_dumps(key), None, partition))
            else:
                self.store[key] = value
                out.append((_dumps(key), _dumps(value), partition))
        self.records_sent += len(out)
        return out

    def persisted(self, first_offsets: dict[int, int]) -> None:
        """What Faust's Table._on_changelog_sent does: a RocksDB store remembers which changelog offset
        it holds so a restart reads only the tail (the memory store ignores it). The first offset of
        the batch is a safe lower bound: re-reading changelog records is idempotent."""
        name = self.changelog
        for partition, offset in first_offsets.items():
            self.store.set_persisted_offset(TP(name, partition), offset)


def _dumps(obj: Any) -> bytes:
    # byte-for-byte what Faust's "json" codec writes (faust.utils.json.dumps with orjson), so the
    # table's own recovery decodes these records (tests/unit/streams/test_agent.py checks it)
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_UTC_Z)
