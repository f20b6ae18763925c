"""A plain reference computation of reward spec v1 and the join, for checking the worker.

Written separately from streams/labels.py and streams/reward.py: it looks at each
request's whole history at once instead of running a state machine. Assumes record
timestamps strictly increase in arrival order within a partition, and that closed labels
are remembered for longer than the test runs (no retention expiry).

    expected(arrivals, window_s) -> Expected(rollouts={rid: {...}}, late=[(reason, event_id)], dlq=[event_id])
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

WEIGHTS_V1 = {
    "accept": 0.75,
    "reject": -0.25,
    "persistence": 1.0,
    "rating": 0.5,
    "followup": 0.5,
    "tool_error": -0.5,
    "floor": -1.0,
}


@dataclass
class Arrival:
    order: int  # position in the partition's log (global arrival order is fine)
    rt: float  # record timestamp, seconds
    ev: dict[str, Any]


@dataclass
class Expected:
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    late: Counter = field(default_factory=Counter)  # (reason, event_id) -> count
    dlq: Counter = field(default_factory=Counter)  # event_id -> count


def _key(ev: dict) -> tuple[float, str]:
    return (datetime.fromisoformat(ev["ts"].replace("Z", "+00:00")).timestamp(), ev["event_id"])


def reference_reward(
    evs: list[dict[str, Any]], w: dict[str, float] = WEIGHTS_V1
) -> tuple[float, dict | None]:
    """Reward spec v1 straight from the table of docs/DESIGN.md §Reward spec."""
    if not evs:
        return 0.0, None
    comps: dict[str, float | None] = dict.fromkeys(
        ("decision", "persistence", "rating", "followup", "tool_errors")
    )
    decisions = [e for e in evs if e["type"] in ("accept", "reject")]
    accepted = False
    if decisions:
        first = min(decisions, key=_key)
        accepted = first["type"] == "accept"
        comps["decision"] = w["accept"] if accepted else w["reject"]
    pers = [e for e in evs if e["type"] == "edit_persistence"]
    if accepted and pers:
        comps["persistence"] = w["persistence"] * max(pers, key=_key)["fraction"]
    ratings = [e for e in evs if e["type"] == "rating"]
    if ratings:
        comps["rating"] = w["rating"] * max(ratings, key=_key)["value"]
    fus = sorted((e for e in evs if e["type"] == "followup"), key=_key)
    if fus:
        comps["followup"] = w["followup"] * (sum(e["sentiment"] for e in fus) / len(fus))
    n_err = sum(1 for e in evs if e["type"] == "tool_error")
    if n_err:
        comps["tool_errors"] = max(w["tool_error"] * n_err, w["floor"])
    reward = sum(v for v in comps.values() if v is not None)
    return reward, comps


def expected(arrivals: list[Arrival], window_s: float) -> Expected:
    out = Expected()
    by_rid: dict[str, list[Arrival]] = {}
    for a in sorted(arrivals, key=lambda a: a.order):
        by_rid.setdefault(a.ev["request_id"], []).append(a)
    for rid, arr in by_rid.items():
        seen, dedup = set(), []
        for a in arr:
            if a.ev["event_id"] not in seen:
                seen.add(a.ev["event_id"])
                dedup.append(a)
        gens = [a for a in dedup if a.ev["type"] == "generation"]
        g = gens[0] if gens else None
        for a in gens[1:]:
            out.dlq[a.ev["event_id"]] += 1
        fb = [a for a in dedup if a.ev["type"] != "generation"]
        before = [a for a in fb if g is None or a.order < g.order]
        after = [a for a in fb if g is not None and a.order > g.order]
        included, orphans = [], []
        cycle, start = [], None
        for a in before:
            if start is not None and a.rt >= start + window_s:
                orphans += cycle
                cycle, start = [], None
            if start is None:
                start = a.rt
            cycle.append(a)
        if cycle:
            if g is not None and g.rt < start + window_s:
                included += cycle
            else:
                orphans += cycle
        for a in after:
            if a.rt < g.rt + window_s:
                included.append(a)
            else:
                out.late[("after_close", a.ev["event_id"])] += 1
        for a in orphans:
            out.late[("orphan", a.ev["event_id"])] += 1
        if g is not None:
            reward, comps = reference_reward([a.ev for a in included])
            errs = sorted((a.ev for a in included if a.ev["type"] == "tool_error"), key=_key)
            out.rollouts[rid] = {
                "reward": reward,
                "components": comps,
                "model_version": g.ev["model_version"],
                "completion_tokens": g.ev["completion_tokens"],
                "closed_at": g.rt + window_s,
                "tool_errors": [
                    {
                        "message": e["message"],
                        "hint": e.get("hint"),
                        "token_index": e["token_index"],
                    }
                    for e in errs
                ],
            }
    return out
