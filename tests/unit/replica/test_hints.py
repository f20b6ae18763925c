"""The artifact hints a deployment event carries for replicas (app/contracts/hints.py): what parses,
what is refused (then the replica asks MLflow / reads the manifest), and the config hash."""

from __future__ import annotations

import json

from app.contracts.hints import ArtifactHint, artifact_hints, config_sha256

SOURCE = "mlflow-artifacts:/1/run/artifacts/ships/ship-1/model"
DELTA = {"file": "delta-from-3.fwd", "sha256": "b" * 64, "bytes": 1234}


def test_a_published_hint_round_trips_through_the_event_details():
    details = json.loads(
        json.dumps({"artifacts": artifact_hints(SOURCE, {"d_model": 16}, "a" * 64, "3", DELTA)})
    )
    hint = ArtifactHint.from_details(details)
    assert hint == ArtifactHint(
        root="mlflow-artifacts:/1/run/artifacts/ships/ship-1",
        config_sha256=config_sha256({"d_model": 16}),
        checkpoint_sha256="a" * 64,
        parent_version="3",
        delta_file="delta-from-3.fwd",
        delta_sha256="b" * 64,
        delta_bytes=1234,
    )
    assert hint.delta_from("3") and not hint.delta_from("2"), (
        "the one-GET path applies to the named parent only"
    )


def test_events_without_a_usable_hint_give_none_and_the_replica_asks_mlflow():
    assert ArtifactHint.from_details({}) is None
    assert ArtifactHint.from_details({"artifacts": "nope"}) is None
    assert (
        ArtifactHint.from_details(
            {"artifacts": {"source": "mlflow-artifacts:/1/run/artifacts/other"}}
        )
        is None
    )
    assert ArtifactHint.from_details(None) is None


def test_malformed_hashes_and_delta_refs_are_dropped_not_trusted():
    bad = artifact_hints(SOURCE, None, "A" * 64, "3", {**DELTA, "file": "../../etc/passwd"})
    hint = ArtifactHint.from_details({"artifacts": bad})
    assert hint is not None and hint.root.endswith("ships/ship-1")
    assert hint.checkpoint_sha256 is None, (
        "upper-case / non-hex is not a SHA-256 the manifests write"
    )
    assert hint.delta_file is None and not hint.delta_from("3"), (
        "a path outside the sync artifacts is refused"
    )
    no_size = {
        "artifacts": {
            **artifact_hints(SOURCE, None, "a" * 64, "3", DELTA),
            "delta": {**DELTA, "bytes": True},
        }
    }
    assert not ArtifactHint.from_details(no_size).delta_from("3")


def test_config_hash_is_the_same_after_a_json_round_trip_and_differs_for_another_config():
    cfg = {"type": "moe-byte", "d_model": 16, "top_k": 1, "kernels": "invariant", "scale": 0.125}
    assert config_sha256(json.loads(json.dumps(cfg, indent=1, sort_keys=True))) == config_sha256(
        cfg
    )
    assert config_sha256({**cfg, "d_model": 32}) != config_sha256(cfg)
