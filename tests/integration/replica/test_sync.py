"""The sync agent against the real broker and the real MLflow server: forward delta sync with every
hash verified, promotion without a fetch, fallback to the anchor on a corrupt delta, a failed sync
that keeps the old weights serving, and the replica events it publishes."""

from __future__ import annotations

import httpx
import pytest

from kernels.delta.hashing import checkpoint_sha256
from tests.integration.replica.conftest import (
    publish_deployment,
    read_topic,
    register_chain,
    serving_equals,
    status,
    wait_for,
)

pytestmark = pytest.mark.integration


def replica_events(settings, n: int, type_: str) -> list[dict]:
    # heartbeats have their own compacted topic; the deployment log keeps syncs and failures
    topic = "replica-status" if type_ == "replica_heartbeat" else "deployments"
    return read_topic(settings, topic, n, where=lambda e: e["type"] == type_)


def test_replica_follows_the_log_and_syncs_forward_by_verified_deltas(registered, replica_factory):
    settings, make = registered
    reg = make(anchor_every=8)
    s1, s2, s3 = register_chain(reg, 3, seed=1)
    publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
    srv = replica_factory(settings, id="replica-fwd", heartbeat_interval=0.5)
    wait_for(lambda: status(srv)["champion"] == "1", what="champion v1")
    assert status(srv)["last_sync"]["path"] == "anchor", "nothing held: the anchor of v1"

    publish_deployment(settings, "canary_started", "2", from_version="1", traffic_pct=50.0)
    wait_for(lambda: status(srv)["candidate"] == "2", what="candidate v2")
    last = status(srv)["last_sync"]
    # one new manifest + the delta, fetched in parallel; v1's manifest is not read again
    assert last["path"] == "delta" and sorted(last["chain"]) == [
        "2/delta-from-1.fwd",
        "2/manifest.json",
    ], last
    assert last["fallbacks"] == 0 and set(last["stages_ms"]) >= {
        "lookup",
        "download",
        "decode",
        "load",
    }, last
    assert status(srv)["traffic_pct"] == 50.0

    publish_deployment(settings, "promoted", "2", traffic_pct=100.0)
    wait_for(
        lambda: status(srv)["champion"] == "2" and status(srv)["candidate"] is None,
        what="v2 promoted",
    )
    assert status(srv)["last_sync"]["path"] == "held", "promotion reuses the loaded candidate"

    publish_deployment(settings, "canary_started", "3", from_version="2", traffic_pct=5.0)
    wait_for(lambda: status(srv)["candidate"] == "3", what="candidate v3")
    assert [c for c in status(srv)["last_sync"]["chain"] if c.endswith(".fwd")] == [
        "3/delta-from-2.fwd"
    ]
    for slot, state in (("champion", s2), ("candidate", s3)):
        lv = getattr(srv.replica.store.snapshot(), slot)
        assert lv.sha256 == checkpoint_sha256(state) == reg.manifests[lv.version].checkpoint_sha256
        assert serving_equals(srv, slot, state), (
            f"{slot} weights differ from what the trainer shipped"
        )

    synced = replica_events(settings, 4, "replica_synced")
    assert [(e["version"], e["details"]["slot"], e["details"]["path"]) for e in synced] == [
        ("1", "champion", "anchor"),
        ("2", "candidate", "delta"),
        ("2", "champion", "held"),
        ("3", "candidate", "delta"),
    ]
    assert all(
        e["details"]["replica_id"] == "replica-fwd" and e["source"] == "replica" for e in synced
    )
    beats = replica_events(settings, 2, "replica_heartbeat")
    assert beats and beats[-1]["details"]["replica_id"] == "replica-fwd"
    text = httpx.get(f"{srv.url}/metrics").text
    assert 'flywheel_replica_sync_bytes_total{kind="delta",replica_id="replica-fwd"}' in text


def test_a_corrupt_delta_falls_back_to_the_anchor_and_a_corrupt_anchor_keeps_the_old_version(
    registered, replica_factory, mlflow_server
):
    settings, make = registered
    reg = make(anchor_every=2)  # v1 anchor, v2 delta, v3 delta+anchor, v4 delta, v5 delta+anchor
    states = register_chain(reg, 5, seed=10)
    assert reg.manifests["3"].anchor is not None and reg.manifests["3"].delta is not None
    root = mlflow_server.root / "artifacts"

    def corrupt(version: str, filename: str) -> None:
        path = reg.artifact_file(root, version, filename)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))

    publish_deployment(settings, "promoted", "2", traffic_pct=100.0)
    srv = replica_factory(settings, id="replica-corrupt", retry_interval=0.5)
    wait_for(lambda: status(srv)["champion"] == "2", what="champion v2")

    corrupt("3", "delta-from-2.fwd")
    publish_deployment(settings, "promoted", "3", traffic_pct=100.0)
    wait_for(lambda: status(srv)["champion"] == "3", what="v3 via its anchor")
    last = status(srv)["last_sync"]
    assert last["path"] == "anchor" and last["fallbacks"] == 1, last
    assert serving_equals(srv, "champion", states[2])

    corrupt("5", "delta-from-4.fwd")
    corrupt("5", "anchor.safetensors")
    publish_deployment(settings, "promoted", "5", traffic_pct=100.0)
    failed = wait_for(
        lambda: replica_events(settings, 1, "replica_sync_failed"), what="replica_sync_failed"
    )
    assert failed[0]["version"] == "5" and failed[0]["details"]["champion_version"] == "3", failed[
        0
    ]
    assert "ChainError" in failed[0]["details"]["error"]
    assert status(srv)["champion"] == "3" and serving_equals(srv, "champion", states[2])
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "s", "prompt": "x", "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["model_version"] == "3", r.text
    text = httpx.get(f"{srv.url}/metrics").text
    assert 'flywheel_replica_fallbacks_total{replica_id="replica-corrupt"} 1.0' in text
    assert (
        'flywheel_replica_sync_failures_total{reason="ChainError",replica_id="replica-corrupt"}'
        in text
    )
