"""The trainer's ship state: what it trained since the last ship (`Pending`) and the ship it is
carrying out (`ShipIntent`).

Both are saved in the trainer's checkpoint (trainer/checkpoint.py) as plain dicts, since the
checkpoint is loaded with `torch.load(weights_only=True)`: `to_dict()` writes them, `from_dict()`
reads them back. `from_dict` accepts the dicts of every earlier trainer: keys added since
(`reward_spec_counts`, `relabelled`, `rebased_on`, `session_ids`, `turns`) take their empty
values, and partition keys are ints whatever they were saved as. `skipped_offsets` is the
exception: a lineage saved without it that skipped something has it unknown (None, saved as
such), not empty.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.rollouts import SKIP_REASONS

log = logging.getLogger(__name__)

ShipKind = Literal["base", "trained"]

# The most skipped offsets one version's lineage lists (`Pending.skipped_offsets`): past it they
# are dropped as unknown, and the version's `version_registered` has no `skipped_offsets` (a
# reader then knows only which version read a record, not whether it trained on it). 10,000
# offsets are at most ~120 KB of event, well under the deployments topic's record limit.
MAX_SKIPPED_OFFSETS = 10_000


def _skipped() -> dict[str, int]:
    return dict.fromkeys(SKIP_REASONS, 0)


@dataclass
class Pending:
    """Lineage accumulated since the last ship; the next version's tags are made of it."""

    rollouts: int = 0
    request_ids: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=_skipped)
    first_offsets: dict[int, int] = field(default_factory=dict)
    reward_sum: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    reward_specs: list[str] = field(default_factory=list)
    # rollouts trained per reward spec (relabelled ones under their new spec)
    reward_spec_counts: dict[str, int] = field(default_factory=dict)
    relabelled: int = 0
    # distinct session_id of the multi-turn records (`turns`) trained on, in first-trained order
    session_ids: list[str] = field(default_factory=list)
    # model calls trained on: a one-call record's 1, a multi-turn record's turns with trained tokens
    turns: int = 0
    # the champion version the trainer continued from after a rejection (trainer/loop.py)
    rebased_on: int | None = None
    # partition -> offsets of `<ns>.rollouts` read but not trained on (every reason in `skipped`),
    # in the order processed; None: unknown (saved by a trainer that did not list them, or more
    # than MAX_SKIPPED_OFFSETS)
    skipped_offsets: dict[int, list[int]] | None = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "rollouts": self.rollouts,
            "request_ids": list(self.request_ids),
            "skipped": dict(self.skipped),
            "first_offsets": dict(self.first_offsets),
            "reward_sum": self.reward_sum,
            "metric_sums": dict(self.metric_sums),
            "steps": self.steps,
            "reward_specs": list(self.reward_specs),
            "reward_spec_counts": dict(self.reward_spec_counts),
            "relabelled": self.relabelled,
            "session_ids": list(self.session_ids),
            "turns": self.turns,
        }
        if self.rebased_on is not None:
            d["rebased_on"] = self.rebased_on
        d["skipped_offsets"] = (  # None (unknown) saved as such: a missing key is an old lineage
            None
            if self.skipped_offsets is None
            else {p: list(o) for p, o in self.skipped_offsets.items()}
        )
        return d

    def add_skipped_offsets(self, offsets: dict[int, list[int]] | None) -> None:
        """List these offsets as read but not trained on; None (unknown) or more than
        MAX_SKIPPED_OFFSETS in all makes the whole list unknown until the next ship."""
        if self.skipped_offsets is None:
            return
        n = sum(map(len, self.skipped_offsets.values()))
        if offsets is None or n + sum(map(len, offsets.values())) > MAX_SKIPPED_OFFSETS:
            log.info(
                "skipped offsets not listed for the next version (%s)",
                "some unknown" if offsets is None else f"more than {MAX_SKIPPED_OFFSETS}",
            )
            self.skipped_offsets = None
            return
        for part, offs in offsets.items():
            if offs:
                self.skipped_offsets.setdefault(part, []).extend(offs)

    @classmethod
    def merge(cls, parts: list[Pending]) -> Pending:
        """The lineage of a distributed trainer's ranks as one (trainer/distributed.py): what each
        rank trained (rollouts, ids, skips, offsets, rewards, specs, turns) is added up in rank
        order (the skipped offsets unknown if any rank's are), and its sessions joined (a
        session's segments may be on two ranks' partitions); what every rank holds identically
        (steps, step metrics, `rebased_on`) is rank 0's."""
        first = parts[0]
        out = cls(
            steps=first.steps,
            metric_sums=dict(first.metric_sums),
            rebased_on=first.rebased_on,
        )
        for p in parts:
            out.rollouts += p.rollouts
            out.request_ids.extend(p.request_ids)
            for k, v in p.skipped.items():
                out.skipped[k] = out.skipped.get(k, 0) + v
            for part, off in p.first_offsets.items():
                out.first_offsets[part] = min(off, out.first_offsets.get(part, off))
            out.reward_sum += p.reward_sum
            for spec in p.reward_specs:
                if spec not in out.reward_specs:
                    out.reward_specs.append(spec)
            for k, v in p.reward_spec_counts.items():
                out.reward_spec_counts[k] = out.reward_spec_counts.get(k, 0) + v
            out.relabelled += p.relabelled
            out.add_sessions(p.session_ids)
            out.turns += p.turns
            out.add_skipped_offsets(p.skipped_offsets)
        return out

    def add_sessions(self, session_ids: list[str]) -> None:
        """Count these sessions as trained on (each once, however many of its segments)."""
        known = set(self.session_ids)
        for sid in session_ids:
            if sid not in known:
                known.add(sid)
                self.session_ids.append(sid)

    def local_part(self) -> Pending:
        """What a rank other than 0 keeps of a restored (merged) lineage: the fields every rank
        holds identically; what was trained stays in rank 0's part only, so `merge` counts it once."""
        return Pending(
            steps=self.steps, metric_sums=dict(self.metric_sums), rebased_on=self.rebased_on
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Pending:
        skipped = {**_skipped(), **d.get("skipped", {})}
        offsets: dict[int, list[int]] | None = None
        if d.get("skipped_offsets") is not None:
            offsets = {int(k): [int(x) for x in v] for k, v in d["skipped_offsets"].items()}
        elif "skipped_offsets" not in d:  # saved before they were listed: none only if no skip
            offsets = None if any(skipped.values()) else {}
        return cls(
            rollouts=int(d.get("rollouts", 0)),
            request_ids=list(d.get("request_ids", [])),
            skipped=skipped,
            first_offsets={int(k): int(v) for k, v in d.get("first_offsets", {}).items()},
            reward_sum=float(d.get("reward_sum", 0.0)),
            metric_sums=dict(d.get("metric_sums", {})),
            steps=int(d.get("steps", 0)),
            reward_specs=list(d.get("reward_specs", [])),
            reward_spec_counts=dict(d.get("reward_spec_counts", {})),
            relabelled=int(d.get("relabelled", 0)),
            session_ids=[str(x) for x in d.get("session_ids", [])],
            turns=int(d.get("turns", 0)),
            rebased_on=None if d.get("rebased_on") is None else int(d["rebased_on"]),
            skipped_offsets=offsets,
        )


@dataclass
class ShipIntent:
    """One ship, saved with the weights before anything reaches the registry, so a restarted
    trainer finishes it (trainer/shipping.py `execute_ship` is idempotent on `ship_id`)."""

    ship_id: str
    kind: ShipKind
    parent_version: int | None
    positions: dict[int, int]  # the Kafka offsets committed once the version is registered
    ranges: dict[int, list[int]]  # partition -> [first, end) offsets of the rollouts it trained on
    pending: Pending
    step: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "ship_id": self.ship_id,
            "kind": self.kind,
            "parent_version": self.parent_version,
            "positions": dict(self.positions),
            "ranges": {k: list(v) for k, v in self.ranges.items()},
            "pending": self.pending.to_dict(),
            "step": self.step,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShipIntent:
        return cls(
            ship_id=str(d["ship_id"]),
            kind=d["kind"],
            parent_version=None if d["parent_version"] is None else int(d["parent_version"]),
            positions={int(k): int(v) for k, v in d.get("positions", {}).items()},
            ranges={int(k): [int(x) for x in v] for k, v in d.get("ranges", {}).items()},
            pending=Pending.from_dict(d.get("pending", {})),
            step=int(d.get("step", 0)),
        )
