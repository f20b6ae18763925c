"""MLflow aliases (`champion`, `candidate`) and Flywheel's acknowledged copy of them.

MLflow keeps only the current alias targets, not who moved them or when. To tell a move made
in the MLflow UI (an instruction) from one Flywheel made itself, Flywheel keeps its own copy
on the registered model as tags:

    flywheel.alias.champion = "7"     # the alias target Flywheel has acknowledged
    flywheel.alias.candidate = "8"    # (absent tag = alias absent)
    flywheel.alias.seq = "12"         # bumped on every acknowledged change

- `sync_aliases` (controller decisions): writes the tag *first*, then moves the alias, so the
  webhook that MLflow fires for Flywheel's own move always finds tag == alias and is ignored.
  A removal goes the other way: the alias first, then its tag. A reader between the two calls
  then sees the alias already gone (which the controller leaves alone once its state has no
  candidate), never the alias still on a version whose tag is gone: after a promotion that
  was `candidate` on the new champion, which the controller answered as an outside move
  ("alias restored").
- `detect_moves` (webhook receiver and polling reconciler): alias != tag means someone moved
  the alias outside Flywheel; each such move becomes an `alias_changed` event whose id is a
  hash of (model, alias, from, to, seq), so the webhook path and the poll path that see the
  same move produce the same event id (deduplicated downstream); `acknowledge` then updates
  the tags.

Note: `MlflowClient.search_model_versions` returns empty `aliases`; aliases are read from
`get_registered_model(name).aliases` ({alias: version}).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

ALIASES = ("champion", "candidate")
TAG_PREFIX = "flywheel.alias."
SEQ_TAG = "flywheel.alias.seq"


@dataclass(frozen=True)
class Snapshot:
    """MLflow's aliases and Flywheel's acknowledged copy, read in one call."""

    aliases: dict[str, str | None]
    acked: dict[str, str | None]
    seq: int


@dataclass(frozen=True)
class AliasMove:
    alias: str
    from_version: str | None
    to_version: str | None
    seq: int

    def event_id(self, model: str) -> str:
        key = f"{model}|{self.alias}|{self.from_version}|{self.to_version}|{self.seq}"
        return hashlib.sha256(key.encode()).hexdigest()[:32]


def read_snapshot(client, model: str) -> Snapshot:
    rm = client.get_registered_model(model)
    aliases = dict(rm.aliases or {})
    tags = dict(rm.tags or {})
    return Snapshot(
        aliases={a: aliases.get(a) for a in ALIASES},
        acked={a: tags.get(TAG_PREFIX + a) or None for a in ALIASES},
        seq=int(tags.get(SEQ_TAG, "0") or 0),
    )


def detect_moves(snap: Snapshot) -> list[AliasMove]:
    """Aliases that differ from Flywheel's acknowledged copy: moves made outside Flywheel."""
    return [
        AliasMove(a, snap.acked[a], snap.aliases[a], snap.seq)
        for a in ALIASES
        if snap.aliases[a] != snap.acked[a]
    ]


def _set_ack(client, model: str, alias: str, version: str | None) -> None:
    if version is None:
        try:
            client.delete_registered_model_tag(model, TAG_PREFIX + alias)
        except Exception as exc:  # absent tag: nothing to delete
            log.debug("delete tag %s%s: %s", TAG_PREFIX, alias, exc)
    else:
        client.set_registered_model_tag(model, TAG_PREFIX + alias, version)


def acknowledge(client, model: str, moves: list[AliasMove]) -> None:
    """Record `moves` as known (after their events are published)."""
    if not moves:
        return
    for m in moves:
        _set_ack(client, model, m.alias, m.to_version)
    client.set_registered_model_tag(model, SEQ_TAG, str(max(m.seq for m in moves) + 1))


def sync_aliases(
    client, model: str, want: dict[str, str | None]
) -> list[tuple[str, str | None, str | None]]:
    """Make MLflow's aliases (and the acknowledged tags) equal `want`; returns [(alias, old, new)] moved.

    Tag first, alias second: the webhook MLflow fires for this move then reads tag == alias.
    A removal: alias first, tag second (module docstring).
    """
    snap = read_snapshot(client, model)
    outside = [m for m in detect_moves(snap) if m.alias in want]
    if (
        outside
    ):  # moved in MLflow since the caller's last reconcile: report it first, never overwrite it
        log.info(
            "not moving aliases of %s: %s moved outside Flywheel and is not reconciled yet",
            model,
            [(m.alias, m.from_version, m.to_version) for m in outside],
        )
        return []
    changed = []
    bumped = False
    for alias, version in want.items():
        assert alias in ALIASES, f"unknown alias {alias!r}; Flywheel manages {ALIASES}"
        moved = snap.aliases[alias] != version
        if moved and version is None:  # a removal: the alias, then its tag
            client.delete_registered_model_alias(model, alias)
        if snap.acked[alias] != version:
            _set_ack(client, model, alias, version)
            bumped = True
        if moved and version is not None:  # a move: the tag (above), then the alias
            client.set_registered_model_alias(model, alias, version)
        if moved:
            changed.append((alias, snap.aliases[alias], version))
            log.info(
                "moved MLflow alias %s@%s: %s -> %s", model, alias, snap.aliases[alias], version
            )
    if bumped:
        client.set_registered_model_tag(model, SEQ_TAG, str(snap.seq + 1))
    return changed
