"""Write-back views of Faust tables: one changelog record per touched key per batch.

Why. A Faust table sends one changelog record for every `table[key] = value`. The join
touches a request's label on every event (open, each feedback, close), so a plain table
costs one producer round trip per event plus one per generation and close, and that path
(send_soon -> producer buffer task -> aiokafka) dominated the worker's time. The agent
now processes records in batches (`stream.take_events`) and reads and writes the tables
through a `BatchedTable`: reads fall through to the table's store, writes stay in a
dirty map, and `flush()` applies each dirty key to the store once and sends one
changelog record for it, encoded exactly as Faust encodes its own changelog writes (so
recovery after a restart reads them back unchanged).

Which changelog partition. Faust writes a key to the partition of the event being
processed. Every key the join touches while handling a record (or tick) of partition p
belongs to partition p (the record key is the request_id, checked on input), so the
agent sets `partition` before each record, as Faust's `current_event` does.

    view = BatchedTable(app_table)
    view.partition = 2
    view["r1"] = {...}            # in memory only
    await view.flush(outbox)      # store updated, one changelog record for "r1"
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from functools import partial
from typing import Any

from faust.types import TP

# (topic, key, value, partition) -> delivery future; see streams.app.Runtime.outbox
Outbox = Callable[[str, bytes | None, bytes | None, int | None], Awaitable[Any]]

_DELETED = object()


class BatchedTable(MutableMapping[str, Any]):
    """A Faust table seen through a write-back cache (one agent, concurrency 1: not thread-safe)."""

    def __init__(self, table: Any):
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

    async def flush(self, outbox: Outbox) -> list[Any]:
        """Apply the dirty keys to the store and send one changelog record each; returns the delivery futures."""
        if not self._dirty:
            return []
        dirty, self._dirty = self._dirty, {}
        topic = self.table.changelog_topic
        name = topic.get_topic_name()
        futs = []
        for key, (partition, value) in dirty.items():
            assert partition is not None, f"table {self.table.name}: write to {key!r} outside a record (no partition set)"
            kb, _ = topic.prepare_key(key, self.table.key_serializer)
            if value is _DELETED:
                self.store.pop(key, None)
                vb = None
            else:
                self.store[key] = value
                vb, _ = topic.prepare_value(value, self.table.value_serializer)
            fut = await outbox(name, kb, vb, partition)
            fut.add_done_callback(partial(self._on_sent, TP(name, partition)))
            futs.append(fut)
        self.records_sent += len(dirty)
        return futs

    def _on_sent(self, tp: TP, fut: Any) -> None:
        # what Faust's Table._on_changelog_sent does: a RocksDB store remembers the changelog
        # offset it holds, so a restart reads only the tail (the memory store ignores it)
        if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
            self.store.set_persisted_offset(tp, fut.result().offset)
