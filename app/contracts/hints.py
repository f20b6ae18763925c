"""What a deployment event may tell a replica about a version's artifacts, so a sync need not ask MLflow.

    details = {..., "artifacts": artifact_hints(source, policy_config)}   # the publisher (trainer)
    hint = ArtifactHint.from_details(event["details"])                      # the replica; None if absent

The trainer publishes `version_registered` with `details.artifacts` (optional, a key of the
free-form `details` of docs/DESIGN.md §Deployment events; events from other publishers lack it):

- `source`: the model version's source URI (`<run artifacts>/ships/<ship_id>/model`), i.e. exactly
  what MLflow's `model-versions/get` returns; the replica takes the ship's artifact root from it
  instead of one REST round trip to the single-worker MLflow server per version;
- `config_sha256`: SHA-256 of the policy config in canonical JSON (`config_sha256(config)`); a
  replica already holding a version whose config has the same canonical hash reuses that config
  instead of downloading `config.json` (equal hashes of the canonical form = equal configs);
- `checkpoint_sha256`, `parent_version` and `delta` (`{file, sha256, bytes}`): the manifest's
  checkpoint hash, parent and delta reference. A replica holding exactly `parent_version` then
  downloads the delta alone (one GET instead of manifest + delta), checks its size and SHA-256,
  decodes it against the held weights (the codec checks the held weights' checkpoint hash and
  hashes every decoded tensor) and requires the checkpoint SHA-256 of those tensor digests to be
  `checkpoint_sha256` — a SHA-256 over every tensor's name and digest, so it matches only if every
  tensor digest matches the manifest's (which the trainer made from the same weights).

Nothing here lets an unverified weight through: a wrong or stale hint fails verification and the
replica falls back to the manifest path, then the anchor (app/replica/fetch.py); a hinted root that
fails is dropped and the version is looked up in MLflow again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KEY = "artifacts"  # details key of the hint


def config_sha256(config: dict[str, Any]) -> str:
    """SHA-256 of a policy config in canonical JSON (sorted keys, indent 1, as trainer/registry.py writes it)."""
    return hashlib.sha256(json.dumps(config, indent=1, sort_keys=True).encode()).hexdigest()


def artifact_hints(
    source: str,
    config: dict[str, Any] | None,
    checkpoint_sha256: str | None = None,
    parent_version: str | None = None,
    delta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `details.artifacts` value a publisher adds to a version's deployment event.
    `delta`: the manifest's delta reference `{file, sha256, bytes}` (with `parent_version`)."""
    out: dict[str, Any] = {"source": str(source)}
    if config is not None:
        out["config_sha256"] = config_sha256(config)
    if checkpoint_sha256 is not None:
        out["checkpoint_sha256"] = checkpoint_sha256
    if delta is not None and parent_version is not None:
        out["parent_version"] = str(parent_version)
        out["delta"] = {
            "file": str(delta["file"]),
            "sha256": str(delta["sha256"]),
            "bytes": int(delta["bytes"]),
        }
    return out


def _sha(value: Any) -> str | None:
    ok = isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    return value if ok else None


@dataclass(frozen=True)
class ArtifactHint:
    """Where a version's artifacts are, as a deployment event said."""

    root: str  # artifact URI of ships/<ship_id> (the source minus "/model")
    config_sha256: str | None = None
    checkpoint_sha256: str | None = None  # the manifest's checkpoint SHA-256
    parent_version: str | None = None  # the version the delta is from
    delta_file: str | None = None  # file name among the sync artifacts (`delta-from-<parent>.fwd`)
    delta_sha256: str | None = None
    delta_bytes: int | None = None

    def delta_from(self, held_version: str) -> bool:
        """Whether the hint names a complete delta from `held_version` (the one-GET path applies)."""
        return (
            self.parent_version == held_version
            and self.checkpoint_sha256 is not None
            and self.delta_file is not None
            and self.delta_sha256 is not None
            and self.delta_bytes is not None
        )

    @classmethod
    def from_details(cls, details: Any) -> ArtifactHint | None:
        """The hint in an event's `details`, or None when absent or malformed (then MLflow is asked)."""
        hint = details.get(KEY) if isinstance(details, dict) else None
        if not isinstance(hint, dict):
            return None
        source = hint.get("source")
        if not isinstance(source, str) or not source.rstrip("/").endswith("/model"):
            return None
        delta = hint.get("delta") if isinstance(hint.get("delta"), dict) else {}
        name, size, parent = delta.get("file"), delta.get("bytes"), hint.get("parent_version")
        ok = (
            isinstance(name, str)
            and "/" not in name
            and name.endswith(".fwd")
            and isinstance(parent, str)
            and isinstance(size, int)
            and not isinstance(size, bool)
            and size >= 0
        )
        return cls(
            root=source.rstrip("/")[: -len("/model")],
            config_sha256=_sha(hint.get("config_sha256")),
            checkpoint_sha256=_sha(hint.get("checkpoint_sha256")),
            parent_version=parent if ok else None,
            delta_file=name if ok else None,
            delta_sha256=_sha(delta.get("sha256")) if ok else None,
            delta_bytes=size if ok else None,
        )
