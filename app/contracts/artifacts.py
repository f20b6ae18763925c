"""Publishing a version's sync artifacts, and reconstructing a version from them.

Writer (the trainer, at ship time):

    m = publish_version(out_dir, "7", serving_sd, parent_sd, "6", parent_manifest, anchor_every=8)
    # out_dir now holds delta-from-6.fwd, anchor.safetensors (when due) and manifest.json;
    # the trainer logs the directory as the model version's MLflow artifacts.

Reader (a replica; `fetch(version, filename) -> bytes` is backed by MLflow artifacts and raises
FileNotFoundError for a missing file):

    sd, manifest = apply_chain("9", fetch, held=("7", held_sd))

It walks parent links from the target, plans the path from the held version (deltas forward)
and the path from the nearest anchor, tries the one with fewer bytes to download first and
the other on any failure, and verifies everything on the way: each file's SHA-256 against the
manifest, each delta's base and target checkpoint hashes, and the result's per-tensor and
checkpoint SHA-256s against the target manifest. `ChainError` when no verifiable path exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kernels.delta import DEFAULT_LEVEL, DeltaFormatError, encode_delta, hash_state_dict
from kernels.delta.codec import decode_delta_verified
from kernels.delta.manifest import (
    ANCHOR_FILE,
    MANIFEST_FILE,
    VERSION_PATTERN,
    ArtifactRef,
    Manifest,
    TensorInfo,
    delta_file,
)

log = logging.getLogger(__name__)
StateDict = Mapping[str, torch.Tensor]
FetchFn = Callable[[str, str], bytes]


class ChainError(RuntimeError):
    """No verifiable path reconstructs the requested version; `attempts` says what failed."""

    def __init__(self, target: str, attempts: list[str]):
        self.attempts = attempts
        super().__init__(f"cannot reconstruct version {target}: " + "; ".join(attempts))


def _write(out_dir: Path, name: str, data: bytes) -> ArtifactRef:
    (out_dir / name).write_bytes(data)
    return ArtifactRef(file=name, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def publish_version(
    out_dir: str | Path,
    version: str,
    state_dict: StateDict,
    parent_state_dict: StateDict | None,
    parent_version: str | None,
    chain_info: Manifest | None,
    anchor_every: int = 8,
    level: int = DEFAULT_LEVEL,
) -> Manifest:
    """Write version `version`'s delta (from its parent), anchor (when due) and manifest.json.

    `chain_info` is the parent's manifest (None for the first version). An anchor is written
    for the first version and whenever the chain since the last anchor would reach `anchor_every`.
    """
    version = str(version)
    if not re.match(VERSION_PATTERN, version):
        raise ValueError(f"version {version!r} must match {VERSION_PATTERN}")
    if anchor_every < 1:
        raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
    has_parent = parent_state_dict is not None
    if has_parent and (
        chain_info is None or parent_version is None or chain_info.version != str(parent_version)
    ):
        raise ValueError(
            "a parent state dict needs parent_version and the parent's manifest as chain_info"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    digests, sha = hash_state_dict(state_dict, threads=4)
    tensors = [
        TensorInfo(
            name=n,
            dtype=str(state_dict[n].dtype).removeprefix("torch."),
            shape=list(state_dict[n].shape),
            sha256=digests[n],
        )
        for n in sorted(state_dict, key=lambda n: n.encode())
    ]
    delta = None
    if has_parent:
        delta = _write(
            out,
            delta_file(str(parent_version)),
            encode_delta(parent_state_dict, state_dict, level=level),
        )
    due = not has_parent or chain_info.chain_depth + 1 >= anchor_every
    anchor = None
    if due:
        blob = save_safetensors(
            {n: t.detach().cpu().contiguous() for n, t in state_dict.items()},
            metadata={"version": version, "checkpoint_sha256": sha},
        )
        anchor = _write(out, ANCHOR_FILE, blob)
    manifest = Manifest(
        version=version,
        parent_version=str(parent_version) if has_parent else None,
        anchor_version=version if due else chain_info.anchor_version,
        chain_depth=0 if due else chain_info.chain_depth + 1,
        anchor_every=anchor_every,
        checkpoint_sha256=sha,
        tensors=tensors,
        delta=delta,
        anchor=anchor,
    )
    (out / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=1))
    log.info(
        "published version %s: delta %s bytes, anchor %s",
        version,
        delta.bytes if delta else None,
        anchor.bytes if anchor else None,
    )
    return manifest


# ---------------------------------------------------------------- reader


def fetch_manifest(fetch: FetchFn, version: str) -> Manifest:
    try:
        m = Manifest.model_validate(json.loads(fetch(version, MANIFEST_FILE)))
    except (ValueError, ValidationError) as e:
        raise DeltaFormatError(f"manifest of version {version} is invalid: {e}") from e
    if m.version != version:
        raise DeltaFormatError(
            f"manifest fetched for version {version} describes version {m.version}"
        )
    return m


@dataclass
class ChainPlan:
    target: str
    manifests: dict[str, Manifest] = field(default_factory=dict)
    from_held: list[str] | None = (
        None  # versions whose deltas apply, in order, starting at the held one
    )
    anchor: str | None = None  # the anchor version to start from
    from_anchor: list[str] = field(
        default_factory=list
    )  # versions whose deltas apply after the anchor

    def held_bytes(self) -> int:
        return sum(self.manifests[v].delta.bytes for v in self.from_held or [])

    def anchor_bytes(self) -> int:
        if self.anchor is None:
            return 0
        return self.manifests[self.anchor].anchor.bytes + sum(
            self.manifests[v].delta.bytes for v in self.from_anchor
        )


def resolve_chain(
    target: str, fetch: FetchFn, held_version: str | None = None, max_walk: int = 1000
) -> ChainPlan:
    """Walk parent links back from `target` to find the held version and the nearest anchor."""
    plan, path, version = ChainPlan(target=str(target)), [], str(target)
    while version is not None and len(path) <= max_walk:
        m = fetch_manifest(fetch, version)
        plan.manifests[version] = m
        if held_version is not None and version == held_version:
            plan.from_held = path[::-1]
        if m.anchor is not None and plan.anchor is None:
            plan.anchor, plan.from_anchor = version, path[::-1]
        if (plan.from_held is not None or held_version is None) and plan.anchor is not None:
            break
        if plan.anchor is not None and len(path) > 2 * max(m.anchor_every, 1):
            break  # the held version is far behind (or not an ancestor): the anchor path will do
        if m.delta is None:
            break
        path.append(version)
        version = m.parent_version
    return plan


def _fetch_verified(fetch: FetchFn, version: str, ref: ArtifactRef) -> bytes:
    data = fetch(version, ref.file)
    if len(data) != ref.bytes or hashlib.sha256(data).hexdigest() != ref.sha256:
        raise DeltaFormatError(
            f"{ref.file} of version {version} does not match its manifest SHA-256"
        )
    return data


def _apply_deltas(
    plan: ChainPlan, fetch: FetchFn, state: StateDict, sha: str | None, versions: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    digests: dict[str, str] = {}
    for v in versions:
        m = plan.manifests[v]
        state, digests, sha = decode_delta_verified(
            state, _fetch_verified(fetch, v, m.delta), base_checkpoint_sha256=sha
        )
        if sha != m.checkpoint_sha256:
            raise DeltaFormatError(
                f"delta of version {v} decodes to a checkpoint other than its manifest's"
            )
    return dict(state), digests, sha


def _check_against_manifest(
    state: StateDict, digests: dict[str, str], sha: str, m: Manifest
) -> None:
    if not digests:
        digests, sha = hash_state_dict(state, threads=4)
    want = {t.name: t.sha256 for t in m.tensors}
    if digests != want or sha != m.checkpoint_sha256:
        bad = sorted(set(want.items()) ^ set(digests.items()))[:3]
        raise DeltaFormatError(
            f"reconstructed version {m.version} does not match its manifest (e.g. {bad})"
        )


def apply_chain(
    target: str,
    fetch: FetchFn,
    held: tuple[str, StateDict] | None = None,
) -> tuple[dict[str, torch.Tensor], Manifest]:
    """Reconstruct version `target`, verified, from the held version or the nearest anchor."""
    target = str(target)
    attempts: list[str] = []
    try:
        plan = resolve_chain(target, fetch, held[0] if held else None)
    except (DeltaFormatError, FileNotFoundError) as e:
        raise ChainError(target, [f"manifest chain: {e}"]) from e
    routes = []
    if held is not None and plan.from_held is not None:
        routes.append(("held", plan.held_bytes()))
    if plan.anchor is not None:
        routes.append(("anchor", plan.anchor_bytes()))
    routes.sort(key=lambda r: r[1])
    for route, _ in routes:
        try:
            if route == "held":
                state, digests, sha = _apply_deltas(plan, fetch, held[1], None, plan.from_held)
            else:
                am = plan.manifests[plan.anchor]
                state = load_safetensors(_fetch_verified(fetch, plan.anchor, am.anchor))
                digests, sha = hash_state_dict(state, threads=4)
                if sha != am.checkpoint_sha256:
                    raise DeltaFormatError(
                        f"anchor of version {plan.anchor} does not match its manifest"
                    )
                state, d2, sha = _apply_deltas(plan, fetch, state, sha, plan.from_anchor)
                digests = d2 or digests
            _check_against_manifest(state, digests, sha, plan.manifests[target])
            log.info("reconstructed version %s via %s", target, route)
            return state, plan.manifests[target]
        except (
            DeltaFormatError,
            FileNotFoundError,
            ValueError,
        ) as e:  # ValueError: corrupt safetensors
            log.warning("version %s via %s failed: %s", target, route, e)
            attempts.append(f"via {route}: {e}")
    if not routes:
        attempts.append("no held version on the chain and no anchor found")
    raise ChainError(target, attempts)
