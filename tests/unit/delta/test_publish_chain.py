"""Publishing versions with deltas and anchors, and reconstructing any version from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.contracts.artifacts import ChainError, apply_chain, publish_version, resolve_chain

from .conftest import bit_equal, make_small_pair, perturb


def publish_chain(root: Path, n: int, anchor_every: int):
    base, _ = make_small_pair()
    rng = np.random.default_rng(3)
    versions, parent, manifest = {}, None, None
    for v in range(1, n + 1):
        sd = {k: perturb(rng, t, 0.2) for k, t in (parent or base).items()}
        manifest = publish_version(
            root / str(v),
            str(v),
            sd,
            parent,
            str(v - 1) if parent else None,
            manifest,
            anchor_every=anchor_every,
        )
        versions[str(v)], parent = sd, sd
    return versions


def dir_fetch(root: Path):
    def fetch(version: str, name: str) -> bytes:
        return (root / version / name).read_bytes()  # FileNotFoundError when missing

    return fetch


def test_anchors_are_written_every_k_versions(tmp_path):
    publish_chain(tmp_path, 7, anchor_every=3)
    anchors = sorted(int(p.parent.name) for p in tmp_path.glob("*/anchor.safetensors"))
    assert anchors == [1, 4, 7]
    assert (tmp_path / "5" / "delta-from-4.fwd").exists() and not (
        tmp_path / "1" / "delta-from-0.fwd"
    ).exists()


def test_reconstructs_from_held_version_and_from_anchor(tmp_path):
    versions = publish_chain(tmp_path, 6, anchor_every=3)
    fetch = dir_fetch(tmp_path)
    plan = resolve_chain("6", fetch, held_version="5")
    assert plan.from_held == ["6"] and plan.anchor == "4" and plan.from_anchor == ["5", "6"]
    sd, m = apply_chain("6", fetch, held=("5", versions["5"]))
    assert bit_equal(sd, versions["6"]) and m.version == "6"
    sd, _ = apply_chain("6", fetch)  # nothing held: anchor 4, then deltas 5 and 6
    assert bit_equal(sd, versions["6"])


def test_corrupt_delta_falls_back_to_the_anchor(tmp_path):
    versions = publish_chain(tmp_path, 3, anchor_every=10)
    # make the held route the cheaper one, then corrupt its delta
    delta = tmp_path / "3" / "delta-from-2.fwd"
    data = bytearray(delta.read_bytes())
    data[len(data) // 2] ^= 0x40
    delta.write_bytes(bytes(data))
    with pytest.raises(ChainError):
        apply_chain(
            "3", dir_fetch(tmp_path), held=("2", versions["2"])
        )  # both routes need that delta
    versions = publish_chain(tmp_path / "b", 4, anchor_every=3)  # anchors at 1 and 4
    bad = tmp_path / "b" / "4" / "delta-from-3.fwd"
    bad.write_bytes(bad.read_bytes()[:-1] + b"\0")
    sd, _ = apply_chain("4", dir_fetch(tmp_path / "b"), held=("3", versions["3"]))
    assert bit_equal(sd, versions["4"]), "must fall back to version 4's anchor"


def test_wrong_held_weights_fall_back_to_the_anchor(tmp_path):
    versions = publish_chain(tmp_path, 2, anchor_every=5)
    sd, _ = apply_chain(
        "2", dir_fetch(tmp_path), held=("1", versions["2"])
    )  # held lies about its version
    assert bit_equal(sd, versions["2"])


def test_no_verifiable_path_raises_a_clear_error(tmp_path):
    publish_chain(tmp_path, 2, anchor_every=5)
    (tmp_path / "1" / "anchor.safetensors").write_bytes(b"garbage")
    with pytest.raises(ChainError, match="cannot reconstruct version 2") as err:
        apply_chain("2", dir_fetch(tmp_path))
    assert any("anchor" in a for a in err.value.attempts)
