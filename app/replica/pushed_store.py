"""The pushed deltas a replica received from `<ns>.deltas` (record format: app/contracts/pushed.py),
kept in memory until a sync uses them."""

from __future__ import annotations

import threading
from collections import OrderedDict

from app.contracts.pushed import PushedDelta


class PushedDeltas:
    """The pushed deltas a replica received, newest kept: at most `max_items` and `max_bytes`.
    Thread-safe (the follower offers, the sync reads)."""

    def __init__(self, max_bytes: int = 64 << 20, max_items: int = 8):
        self.max_bytes, self.max_items = max_bytes, max_items
        self._items: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def offer(self, d: PushedDelta | None) -> bool:
        """Keep `d` unless it is larger than the whole store; evicts the oldest. True if kept."""
        if d is None or len(d.data) > self.max_bytes:
            return False
        with self._lock:
            self._items.pop((d.version, d.file), None)
            self._items[(d.version, d.file)] = d.data
            while (
                len(self._items) > self.max_items
                or sum(map(len, self._items.values())) > self.max_bytes
            ):
                self._items.popitem(last=False)
        return True

    def get(self, version: str, file: str) -> bytes | None:
        with self._lock:
            return self._items.get((str(version), file))

    def drop(self, version: str, file: str) -> None:
        with self._lock:
            self._items.pop((str(version), file), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
