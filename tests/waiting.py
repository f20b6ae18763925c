"""Waiting in tests on a condition, never for a fixed time: one helper the suite's `wait_for`s
share.

    got = poll(lambda: status(srv)["champion"], 60, "the champion")   # its truthy value
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def poll(
    pred: Callable[[], Any],
    timeout: float,
    what: str,
    every: float = 0.1,
    fail: bool = True,
) -> Any:
    """`pred()`'s first truthy value, asked every `every` s until `timeout` s have passed; then an
    AssertionError naming `what` and the last value (or, with `fail=False`, that last value)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = pred()
        if last or time.monotonic() >= deadline:
            break
        time.sleep(every)
    if not last and fail:
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
    return last
