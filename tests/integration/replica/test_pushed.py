"""Deltas pushed on `<ns>.deltas` (app/contracts/pushed.py) with the real broker, MLflow server and
trainer: the trainer pushes each delta (the same bytes as its MLflow artifact) before announcing
the version; a replica syncs from the pushed copy without downloading anything; a corrupt pushed
copy is refused and the original downloaded; a replica started later still finds the recent
pushed deltas."""

from __future__ import annotations

import pytest

from tests.integration.replica.conftest import (
    publish_deployment,
    register_chain,
    serving_equals,
    status,
    wait_for,
)
from tests.integration.replica.test_hints import announce

pytestmark = pytest.mark.integration


def push(settings, reg, version: str, data: bytes | None = None) -> None:
    from app.contracts.pushed import PushedDelta
    from app.infra.kafka import make_producer

    ref = reg.manifests[version].delta
    blob = data if data is not None else (reg.delta_bytes[version])
    producer = make_producer(settings, profile="immediate")
    try:
        key, value, headers = PushedDelta(
            settings.model_name,
            version,
            reg.manifests[version].parent_version,
            ref.file,
            ref.sha256,
            blob,
        ).record()
        producer.send(settings.topic("deltas"), key=key, value=value, headers=headers).get(10)
    finally:
        producer.close()


def pushed_counter(srv, outcome: str) -> float:
    from app.replica import metrics as m

    return m.PUSHED.labels(srv.config.id, outcome)._value.get()


def test_a_replica_syncs_from_pushed_deltas_without_downloading_and_refuses_a_corrupt_one(
    registered, replica_factory, mlflow_server
):
    settings, make = registered
    reg = make(anchor_every=8)
    states = register_chain(reg, 4, seed=40)
    reg.delta_bytes = {
        v: reg.artifact_file(
            mlflow_server.root / "artifacts", v, reg.manifests[v].delta.file
        ).read_bytes()
        for v in ("2", "3", "4")
    }
    announce(settings, reg, "1")
    push(
        settings, reg, "2"
    )  # before the replica starts: it must still find it (the newest few are read)
    announce(settings, reg, "2")
    publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
    srv = replica_factory(settings, id="replica-pushed")
    wait_for(lambda: status(srv)["champion"] == "1", what="champion v1")

    publish_deployment(settings, "canary_started", "2", from_version="1", traffic_pct=50.0)
    wait_for(lambda: status(srv)["candidate"] == "2", what="candidate v2")
    last = status(srv)["last_sync"]
    assert last["chain"] == ["kafka:2/delta-from-1.fwd"] and last["path"] == "delta", last
    assert last["stages_ms"]["download"] == 0.0 and last["config_reused"] is True, last
    assert serving(srv, "candidate").sha256 == reg.manifests["2"].checkpoint_sha256
    assert serving_equals(srv, "candidate", states[1])
    assert pushed_counter(srv, "used") == 1

    # pushed while the replica runs, then announced and promoted at once (the trainer's order)
    publish_deployment(settings, "promoted", "2", traffic_pct=100.0)
    push(settings, reg, "3")
    announce(settings, reg, "3")
    publish_deployment(settings, "promoted", "3", traffic_pct=100.0)
    wait_for(lambda: status(srv)["champion"] == "3", what="champion v3")
    assert status(srv)["last_sync"]["chain"] == ["kafka:3/delta-from-2.fwd"], status(srv)[
        "last_sync"
    ]
    assert serving_equals(srv, "champion", states[2])

    # a pushed copy whose bytes are wrong (its header claims the right hash): refused, MLflow's used
    bad = bytearray(reg.delta_bytes["4"])
    bad[len(bad) // 3] ^= 0x04
    push(settings, reg, "4", bytes(bad))
    announce(settings, reg, "4")
    publish_deployment(settings, "promoted", "4", traffic_pct=100.0)
    wait_for(lambda: status(srv)["champion"] == "4", what="champion v4")
    last = status(srv)["last_sync"]
    assert last["chain"] == ["4/delta-from-3.fwd"] and last["fallbacks"] == 0, last
    assert serving(srv, "champion").sha256 == reg.manifests["4"].checkpoint_sha256
    assert serving_equals(srv, "champion", states[3]), "only verified weights are served"
    assert pushed_counter(srv, "rejected") == 1 and pushed_counter(srv, "received") == 3


def serving(srv, slot: str):
    return getattr(srv.replica.store.snapshot(), slot)


def test_the_trainer_pushes_each_delta_before_announcing_it_with_the_bytes_of_its_artifact(
    make_settings, mlflow_server, tmp_path
):
    import json

    from kafka import TopicPartition
    from mlflow import MlflowClient

    from app.contracts.pushed import PushedDelta
    from app.infra.kafka import make_consumer
    from kernels.delta.manifest import Manifest
    from tests.integration.replica.conftest import ship_two_versions

    settings = ship_two_versions(make_settings, mlflow_server, tmp_path)

    consumer = make_consumer(settings, group_id=None)
    try:
        records = {}
        for name in ("deltas", "deployments"):
            tp = TopicPartition(settings.topic(name), 0)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
            end = consumer.end_offsets([tp])[tp]
            records[name] = []
            while consumer.position(tp) < end:
                for recs in consumer.poll(timeout_ms=1000).values():
                    records[name].extend(recs)
    finally:
        consumer.close()
    pushed = [PushedDelta.from_record(r, settings.model_name) for r in records["deltas"]]
    assert [(p.version, p.parent_version) for p in pushed] == [("2", "1")], (
        "v1 is an anchor: nothing to push"
    )
    registered = [json.loads(r.value) for r in records["deployments"]]
    assert [e["version"] for e in registered if e["type"] == "version_registered"] == ["1", "2"]
    assert records["deltas"][0].timestamp <= next(
        r.timestamp for r in records["deployments"] if json.loads(r.value)["version"] == "2"
    ), "pushed before announced"
    mv = MlflowClient(settings.mlflow_uri).get_model_version(settings.model_name, "2")
    files = (
        mlflow_server.root
        / "artifacts"
        / mv.source.split("mlflow-artifacts:/", 1)[1].rsplit("/model", 1)[0]
        / "delta"
    )
    manifest = Manifest.model_validate_json((files / "manifest.json").read_bytes())
    assert (pushed[0].file, pushed[0].sha256) == (manifest.delta.file, manifest.delta.sha256)
    assert pushed[0].data == (files / manifest.delta.file).read_bytes(), (
        "the pushed bytes are the MLflow artifact's"
    )
