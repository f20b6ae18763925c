"""Sync driven by the artifact hints of `version_registered` (app/contracts/hints.py), against the real
broker and MLflow server: the delta alone is fetched (no MLflow look-up, no manifest, no config), a
stale hint or a wrong artifact root still ends on verified weights, and a corrupt delta still falls
back to the anchor."""

from __future__ import annotations

from typing import Any

import pytest

from app.contracts.hints import artifact_hints
from tests.integration.replica.conftest import (
    publish_deployment,
    register_chain,
    serving_equals,
    status,
    wait_for,
)

pytestmark = pytest.mark.integration


def serving(srv, slot: str) -> Any:
    return getattr(srv.replica.store.snapshot(), slot)


def announce(settings, reg, version: str, **override: Any) -> None:
    """`version_registered` with the hints trainer/shipping.py publishes (fields overridable)."""
    m = reg.manifests[version]
    hints = artifact_hints(
        reg.sources[version],
        reg.config,
        m.checkpoint_sha256,
        m.parent_version,
        m.delta.model_dump() if m.delta else None,
    )
    publish_deployment(
        settings,
        "version_registered",
        version,
        from_version=m.parent_version,
        details={"artifacts": {**hints, **override}},
    )


def test_hinted_versions_sync_by_the_delta_alone_and_bad_hints_still_end_verified(
    registered, replica_factory
):
    settings, make = registered
    reg = make(anchor_every=8)
    states = register_chain(reg, 4, seed=20)
    announce(settings, reg, "1")
    announce(settings, reg, "2")
    announce(
        settings, reg, "3", checkpoint_sha256="0" * 64
    )  # stale/wrong: the manifest must decide
    announce(
        settings, reg, "4", source=reg.sources["2"]
    )  # another version's ship: MLflow must decide
    publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
    srv = replica_factory(settings, id="replica-hints")
    wait_for(lambda: status(srv)["champion"] == "1", what="champion v1")
    fetcher = srv.replica.agent.fetcher

    publish_deployment(settings, "canary_started", "2", from_version="1", traffic_pct=50.0)
    wait_for(lambda: status(srv)["candidate"] == "2", what="candidate v2")
    last = status(srv)["last_sync"]
    assert last["path"] == "delta" and last["chain"] == ["2/delta-from-1.fwd"], last
    assert last["config_reused"] is True and last["fallbacks"] == 0, last
    assert "2" not in fetcher._roots, "the artifact root came from the log, MLflow was not asked"
    assert serving(srv, "candidate").sha256 == reg.manifests["2"].checkpoint_sha256
    assert serving_equals(srv, "candidate", states[1])

    publish_deployment(settings, "promoted", "2", traffic_pct=100.0)
    publish_deployment(settings, "canary_started", "3", from_version="2", traffic_pct=10.0)
    wait_for(lambda: status(srv)["candidate"] == "3", what="candidate v3")
    last = status(srv)["last_sync"]
    assert "3/manifest.json" in last["chain"] and last["path"] == "delta", last
    assert serving(srv, "candidate").sha256 == reg.manifests["3"].checkpoint_sha256
    assert serving_equals(srv, "candidate", states[2]), (
        "a wrong hinted hash must not change what is served"
    )

    publish_deployment(settings, "promoted", "3", traffic_pct=100.0)
    publish_deployment(settings, "canary_started", "4", from_version="3", traffic_pct=10.0)
    wait_for(lambda: status(srv)["candidate"] == "4", what="candidate v4")
    assert fetcher._roots.get("4") == reg.sources["4"].rsplit("/model", 1)[0], (
        "the wrong hint was replaced by MLflow's"
    )
    assert serving(srv, "candidate").sha256 == reg.manifests["4"].checkpoint_sha256
    assert serving_equals(srv, "candidate", states[3])
    assert status(srv)["champion"] == "3" and serving_equals(srv, "champion", states[2])


def test_a_corrupt_hinted_delta_falls_back_to_the_anchor(
    registered, replica_factory, mlflow_server
):
    settings, make = registered
    reg = make(anchor_every=2)  # v1 anchor, v2 delta, v3 delta + anchor
    states = register_chain(reg, 3, seed=30)
    for v in ("1", "2", "3"):
        announce(settings, reg, v)
    publish_deployment(settings, "promoted", "2", traffic_pct=100.0)
    srv = replica_factory(settings, id="replica-hints-corrupt", retry_interval=0.5)
    wait_for(lambda: status(srv)["champion"] == "2", what="champion v2")

    path = reg.artifact_file(mlflow_server.root / "artifacts", "3", "delta-from-2.fwd")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    publish_deployment(settings, "promoted", "3", traffic_pct=100.0)
    wait_for(lambda: status(srv)["champion"] == "3", what="v3 via its anchor")
    last = status(srv)["last_sync"]
    assert last["path"] == "anchor" and last["fallbacks"] == 1, last
    assert serving(srv, "champion").sha256 == reg.manifests["3"].checkpoint_sha256
    assert serving_equals(srv, "champion", states[2])


def test_the_trainers_version_registered_event_carries_hints_that_match_the_registry(
    make_settings, mlflow_server, tmp_path
):
    import json

    from mlflow import MlflowClient

    from app.contracts.hints import ArtifactHint, config_sha256
    from kernels.delta.manifest import Manifest
    from tests.integration.replica.conftest import read_topic, ship_two_versions

    settings = ship_two_versions(make_settings, mlflow_server, tmp_path)
    events = read_topic(
        settings, "deployments", 2, where=lambda e: e["type"] == "version_registered"
    )
    client = MlflowClient(settings.mlflow_uri)
    for ev in events:
        mv = client.get_model_version(settings.model_name, ev["version"])
        hint = ArtifactHint.from_details(ev["details"])
        assert hint is not None and f"{hint.root}/model" == mv.source, (ev["details"], mv.source)
        root = mv.source.split("mlflow-artifacts:/", 1)[1].rsplit("/model", 1)[0]
        files = mlflow_server.root / "artifacts" / root
        manifest = Manifest.model_validate_json((files / "delta" / "manifest.json").read_bytes())
        config = json.loads((files / "model" / "artifacts" / "config.json").read_text())
        assert (
            hint.checkpoint_sha256 == manifest.checkpoint_sha256
            and hint.config_sha256 == config_sha256(config)
        )
        if manifest.delta is None:
            assert ev["version"] == "1" and hint.delta_file is None, "the base version is an anchor"
        else:
            assert hint.delta_from(manifest.parent_version) and (
                hint.delta_file,
                hint.delta_sha256,
                hint.delta_bytes,
            ) == (manifest.delta.file, manifest.delta.sha256, manifest.delta.bytes), (
                hint,
                manifest.delta,
            )
    assert sorted(e["version"] for e in events) == ["1", "2"]
