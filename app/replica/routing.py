"""Which version serves a session: a stable hash of session_id against the canary's traffic split.

    slot = pick_slot("user-42", traffic_pct=25.0, has_candidate=True)   # "candidate" | "champion"

A session's bucket is the first 8 bytes of SHA-256(session_id) modulo 10 000 (basis points), so
it is the same in every process, on every replica and across restarts (Python's `hash()` is
salted per process and would not be). The candidate serves the sessions whose bucket is below
`traffic_pct * 100`: raising the split from 5 % to 25 % only adds sessions to the candidate, a
session never flips back and forth while the canary ramps up.
"""

from __future__ import annotations

import hashlib
from typing import Literal

Slot = Literal["champion", "candidate"]
BUCKETS = 10_000  # basis points: traffic_pct has two decimals of resolution


def session_bucket(session_id: str) -> int:
    """Stable bucket in [0, BUCKETS) of a session id."""
    digest = hashlib.sha256(session_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def pick_slot(session_id: str, traffic_pct: float, has_candidate: bool) -> Slot:
    """`candidate` for sessions whose bucket is below the candidate's share, else `champion`."""
    assert 0.0 <= traffic_pct <= 100.0, f"traffic_pct must be in [0, 100], got {traffic_pct}"
    if not has_candidate:
        return "champion"
    return (
        "candidate"
        if session_bucket(session_id) < round(traffic_pct * BUCKETS / 100.0)
        else "champion"
    )
