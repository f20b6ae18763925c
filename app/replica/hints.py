"""What a deployment event may tell a replica about a version's artifacts, so a sync need not ask MLflow.

    details = {..., "artifacts": artifact_hints(source, policy_config)}   # the publisher (trainer)
    hint = ArtifactHint.from_details(event["details"])                      # the replica; None if absent

The trainer publishes `version_registered` with `details.artifacts` (optional, an addition to the
DESIGN.md event — old events and events from other publishers simply lack it):

- `source`: the model version's source URI (`<run artifacts>/ships/<ship_id>/model`), i.e. exactly
  what MLflow's `model-versions/get` returns; the replica takes the ship's artifact root from it
  instead of one REST round trip to the single-worker MLflow server per version;
- `config_sha256`: SHA-256 of the policy config in canonical JSON (`config_sha256(config)`); a
  replica already holding a version whose config has the same canonical hash reuses that config
  instead of downloading `config.json` (equal hashes of the canonical form = equal configs).

Neither is trusted for the weights: the manifest read from that root still names the version
(checked), every file's and tensor's SHA-256 and the checkpoint SHA-256 are verified as before,
and a hinted root that fails (missing files, wrong version) is dropped and the version is looked
up in MLflow again (app/replica/fetch.py).
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


def artifact_hints(source: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """The `details.artifacts` value a publisher adds to a version's deployment event."""
    out: dict[str, Any] = {"source": str(source)}
    if config is not None:
        out["config_sha256"] = config_sha256(config)
    return out


@dataclass(frozen=True)
class ArtifactHint:
    """Where a version's artifacts are, as a deployment event said."""

    root: str  # artifact URI of ships/<ship_id> (the source minus "/model")
    config_sha256: str | None = None

    @classmethod
    def from_details(cls, details: Any) -> "ArtifactHint | None":
        """The hint in an event's `details`, or None when absent or malformed (then MLflow is asked)."""
        hint = details.get(KEY) if isinstance(details, dict) else None
        if not isinstance(hint, dict):
            return None
        source = hint.get("source")
        if not isinstance(source, str) or not source.rstrip("/").endswith("/model"):
            return None
        sha = hint.get("config_sha256")
        if not (isinstance(sha, str) and len(sha) == 64):
            sha = None
        return cls(root=source.rstrip("/")[: -len("/model")], config_sha256=sha)
