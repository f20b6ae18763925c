"""Deltas pushed on `<ns>.deltas` (app/contracts/pushed.py): the record format, the replica's bounded
store, and the fetcher using a pushed delta instead of a download — verified exactly like one, and
dropped (then downloaded from MLflow) when it does not verify. No broker or MLflow here: the
fetcher's artifact GET is replaced by a dict lookup that counts calls (the real path is covered by
tests/integration/replica/test_pushed.py)."""

from __future__ import annotations

import hashlib
from collections import namedtuple
from pathlib import Path

import pytest

from app.contracts.hints import ArtifactHint, artifact_hints
from app.contracts.pushed import PushedDelta
from app.replica.pushed_store import PushedDeltas
from tests.unit.replica.conftest import tiny_state

Rec = namedtuple("Rec", "topic partition offset key value headers")


def record(d: PushedDelta, offset: int = 0) -> Rec:
    key, value, headers = d.record()
    return Rec("ns.deltas", 0, offset, key.encode(), value, headers)


def test_a_pushed_delta_round_trips_through_its_record_and_other_models_or_broken_records_are_skipped():
    d = PushedDelta("policy", "8", "7", "delta-from-7.fwd", "a" * 64, b"\x00delta bytes")
    assert PushedDelta.from_record(record(d), "policy") == d
    assert PushedDelta.from_record(record(d), "another-model") is None
    no_sha = record(d)._replace(headers=[h for h in d.record()[2] if h[0] != "sha256"])
    assert PushedDelta.from_record(no_sha, "policy") is None, (
        "a record without its SHA-256 is not a pushed delta"
    )
    assert PushedDelta.from_record(record(d)._replace(value=None), "policy") is None


def test_the_store_keeps_the_newest_deltas_within_its_count_and_byte_bounds():
    store = PushedDeltas(max_bytes=100, max_items=3)
    for v in range(1, 6):
        assert store.offer(
            PushedDelta("m", str(v), str(v - 1), f"delta-from-{v - 1}.fwd", "a" * 64, b"x" * 10)
        )
    assert (
        len(store) == 3
        and store.get("2", "delta-from-1.fwd") is None
        and store.get("5", "delta-from-4.fwd")
    )
    assert not store.offer(PushedDelta("m", "9", "8", "delta-from-8.fwd", "a" * 64, b"x" * 101)), (
        "larger than the store"
    )
    assert store.offer(PushedDelta("m", "6", "5", "delta-from-5.fwd", "a" * 64, b"y" * 90))
    assert store.get("6", "delta-from-5.fwd") == b"y" * 90 and len(store) == 2, (
        "the oldest evicted to fit 100 bytes"
    )
    assert store.get("5", "delta-from-4.fwd") and store.get("4", "delta-from-3.fwd") is None
    store.drop("6", "delta-from-5.fwd")
    assert store.get("6", "delta-from-5.fwd") is None and not store.offer(None)


@pytest.fixture()
def chain(tmp_path: Path):
    """Versions 1 (anchor) and 2 (delta from 1) of a tiny policy as app/contracts/artifacts.py writes them,
    plus v1 loaded the way a replica holds it."""
    from app.contracts.artifacts import publish_version
    from app.replica.weights import load_verified
    from kernels.delta.hashing import hash_state_dict
    from tests.integration.rollout.stack import nudged

    cfg, s1 = tiny_state(0)
    s2 = nudged(s1, seed=1)
    m1 = publish_version(tmp_path / "1", "1", s1, None, None, None)
    m2 = publish_version(tmp_path / "2", "2", s2, s1, "1", m1)
    held = load_verified("1", s1, cfg, hash_state_dict(s1)[1])
    files = {(v, p.name): p.read_bytes() for v in ("1", "2") for p in (tmp_path / v).iterdir()}
    return cfg, s2, m2, held, files


def fetcher_on(files: dict, tmp_path: Path):
    """A VersionFetcher whose artifact GETs read `files` and are counted (no MLflow server: nothing
    may ask it, the port is closed)."""
    from app.replica.fetch import VersionFetcher
    from app.settings import Settings

    f = VersionFetcher(Settings(data_dir=tmp_path, mlflow_uri="http://127.0.0.1:9"))
    f.gets = []

    def get(uri: str) -> bytes:
        version, name = (
            uri.split("/ships/", 1)[1].split("/")[0].removeprefix("ship-"),
            uri.rsplit("/", 1)[1],
        )
        f.gets.append(f"{version}/{name}")
        if (version, name) not in files:
            raise FileNotFoundError(uri)
        return files[(version, name)]

    f._get = get
    return f


def hint_for(m2, cfg) -> ArtifactHint:
    src = "mlflow-artifacts:/1/run/artifacts/ships/ship-2/model"
    return ArtifactHint.from_details(
        {"artifacts": artifact_hints(src, cfg, m2.checkpoint_sha256, "1", m2.delta.model_dump())}
    )


def test_a_pushed_delta_replaces_the_download_and_is_verified_like_it(chain, tmp_path):
    import torch

    cfg, s2, m2, held, files = chain
    f = fetcher_on(files, tmp_path)
    try:
        f.learn("2", hint_for(m2, cfg))
        blob = files[("2", m2.delta.file)]
        f.pushed.offer(PushedDelta("m", "2", "1", m2.delta.file, m2.delta.sha256, blob))
        got = f.fetch("2", {"1": held})
        assert f.gets == [], (
            "nothing downloaded: the delta came from Kafka and the config from the held version"
        )
        assert got.chain == [f"kafka:2/{m2.delta.file}"] and got.bytes_by_kind == {
            "pushed": len(blob)
        }
        assert got.sha256 == m2.checkpoint_sha256 and got.digests == {
            t.name: t.sha256 for t in m2.tensors
        }
        assert all(torch.equal(got.state[k].view(torch.int16), s2[k].view(torch.int16)) for k in s2)
        assert got.pushed_rejected == 0
    finally:
        f.close()


def test_a_corrupt_pushed_delta_is_dropped_and_the_original_downloaded(chain, tmp_path):
    import torch

    cfg, s2, m2, held, files = chain
    f = fetcher_on(files, tmp_path)
    try:
        f.learn("2", hint_for(m2, cfg))
        bad = bytearray(files[("2", m2.delta.file)])
        bad[len(bad) // 2] ^= 0x01
        # the publisher's header claims the right hash: only the bytes are wrong
        f.pushed.offer(PushedDelta("m", "2", "1", m2.delta.file, m2.delta.sha256, bytes(bad)))
        assert hashlib.sha256(bytes(bad)).hexdigest() != m2.delta.sha256
        got = f.fetch("2", {"1": held})
        assert f.gets == [f"2/{m2.delta.file}"] and got.chain == [f"2/{m2.delta.file}"], (
            f.gets,
            got.chain,
        )
        assert got.pushed_rejected == 1 and f.pushed.get("2", m2.delta.file) is None
        assert got.sha256 == m2.checkpoint_sha256
        assert all(torch.equal(got.state[k].view(torch.int16), s2[k].view(torch.int16)) for k in s2)
    finally:
        f.close()


def test_the_publisher_refuses_a_delta_over_the_limit_or_with_another_hash_before_touching_kafka(
    tmp_path: Path,
):
    from app.contracts.pushed import publish_delta
    from app.settings import Settings

    # no broker at this address: a refusal must not need one
    s = Settings(data_dir=tmp_path, kafka_bootstrap="127.0.0.1:9", delta_push_max_bytes=16)
    blob = b"x" * 17
    assert not publish_delta(
        s, PushedDelta("m", "2", "1", "delta-from-1.fwd", hashlib.sha256(blob).hexdigest(), blob)
    )
    small = b"x" * 16
    assert not publish_delta(s, PushedDelta("m", "2", "1", "delta-from-1.fwd", "0" * 64, small)), (
        "wrong SHA-256"
    )
