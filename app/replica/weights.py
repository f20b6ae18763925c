"""The weights a replica serves: verified versions, the atomic swap, and the local verified cache.

A replica holds up to two loaded versions, the champion and the candidate, plus the candidate's
traffic share, as ONE immutable `Serving` snapshot. A request reads the snapshot once (a single
reference read) and keeps the `LoadedVersion` it picked until it has answered, so a swap never
changes the weights under a running generation. A sync builds the new version completely on
the side (in a policy no request uses: a fresh shadow, or the built-in engine's standby, the
policy of a version no longer served whose requests have all finished, loaded in place; then
verified against the decoded, hash-verified state dict) and then publishes
it with `WeightStore.swap(...)`: one reference assignment under a lock. There is no moment at
which a request can see half of an old and half of a new version (docs/DESIGN.md §Invariants:
no torn weights).

`load_verified(version, state, config, sha256)` is the only way to make a `LoadedVersion`: it
loads the state dict into a fresh policy and hashes the policy's own serving weights
(kernels/delta/hashing.py, the same definition as the manifests), refusing a mismatch, so what
generates is exactly what was verified. A sync passes the per-tensor digests the delta codec
computed while decoding (`digests=`); then the weights are hashed once, not twice: the digests
must give `sha256`, and the policy's serving weights must equal `state` bit for bit (a memory
comparison, ~10x cheaper than SHA-256).

`WeightCache` keeps verified versions on local disk (`<cache_dir>/v<N>.safetensors` + a
`v<N>.json` commit marker written last, both via write-to-temp + fsync + rename) and which
versions were serving (`serving.json`). A restarted replica — even one killed with SIGKILL in
the middle of applying a version — loads the marked versions, re-verifies their hashes and
serves at once; temp files of an interrupted apply are removed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from kernels.delta.hashing import checkpoint_sha256_from_digests, hash_state_dict

log = logging.getLogger(__name__)


class VerificationError(Exception):
    """Weights whose SHA-256 differs from the one the registry published: never served."""


T = TypeVar("T")


class Leases:
    """Requests that picked a version and have not finished with it. An engine that updates its
    weights in place (app/replica/engines/vllm.py) waits for them before it overwrites a version:
    a request always generates with the weights of the version it names."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._n = 0

    @property
    def count(self) -> int:
        return self._n

    def acquire(self) -> Lease:
        with self._cond:
            self._n += 1
        return Lease(self)

    def _release(self) -> None:
        with self._cond:
            self._n -= 1
            if self._n == 0:
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no request holds the version (False after `timeout_s`)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout=timeout_s)


class LeaseReleased(RuntimeError):
    """A generation wrapped by `Lease.run` started after its request had released the lease."""


class Lease:
    """One request's hold on a version; `release()` is idempotent.

    The generation itself runs on a worker thread that outlives a cancelled request handler, so a
    handler's `release()` alone could let an engine overwrite the weights under a generation still
    running. `run(fn)` wraps the function that thread calls: while it runs, the hold stays until
    both the holder has released and the call has returned; a call that starts after the holder
    released raises `LeaseReleased` instead of generating on weights no longer held.
    """

    def __init__(self, leases: Leases) -> None:
        self._leases: Leases | None = leases
        self._lock = threading.Lock()
        self._running = 0
        self._released = False

    def release(self) -> None:
        with self._lock:
            self._released = True
            if self._running:
                return  # the generation thread lets go when it returns
            leases, self._leases = self._leases, None
        if leases is not None:
            leases._release()

    def run(self, fn: Callable[..., T]) -> Callable[..., T]:
        def call(*args: Any, **kwargs: Any) -> T:
            with self._lock:
                if self._leases is None:
                    raise LeaseReleased("the request released its lease before generating")
                self._running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._running -= 1
                    last = self._released and self._running == 0
                    leases = self._leases if last else None
                    if last:
                        self._leases = None
                if leases is not None:
                    leases._release()

        return call


@dataclass(frozen=True)
class LoadedVersion:
    """One verified version, ready to generate. Immutable: a new version is a new object."""

    version: str
    policy: Any  # policy.base.Policy, eval mode, loaded from `state`
    state: Mapping[
        str, torch.Tensor
    ]  # the verified bf16 serving state dict (base for the next delta)
    sha256: str  # checkpoint SHA-256 (kernels/delta/hashing.py)
    config: Mapping[str, Any]  # Policy.config_dict(), rebuilds the architecture
    loaded_at: float = dataclasses.field(default_factory=time.time)
    leases: Leases = dataclasses.field(default_factory=Leases, compare=False, repr=False)


@dataclass(frozen=True)
class Serving:
    """What the replica serves right now; replaced as a whole, never mutated."""

    champion: LoadedVersion | None = None
    candidate: LoadedVersion | None = None
    traffic_pct: float = 0.0  # candidate's share of sessions, 0-100

    def versions(self) -> dict[str, str | None]:
        return {
            "champion": self.champion.version if self.champion else None,
            "candidate": self.candidate.version if self.candidate else None,
        }

    def held(self) -> list[LoadedVersion]:
        return [lv for lv in (self.champion, self.candidate) if lv is not None]


def load_verified(
    version: str,
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    sha256: str,
    threads: int = 2,
    template: LoadedVersion | None = None,
    digests: Mapping[str, str] | None = None,
    standby: Any = None,
) -> LoadedVersion:
    """Load `state` into a NEW policy and verify the policy's own serving weights against `sha256`.

    Hashing what the policy will actually serve (after loading) covers the state dict too: the
    bf16 -> fp32 master -> bf16 round trip is exact, so any difference in `state` shows here.
    `template`: a held version with the same config, whose structure is copied instead of built
    (cheaper than a fresh random initialisation) without its weights (`Policy.shadow()`: every
    serving tensor is fresh, then loaded from `state` and verified; a LoRA policy shares its frozen
    base with the template, verified when the template was built by its config's `files_sha256`,
    and only the adapter is fresh).
    `digests`: per-tensor SHA-256s of exactly these `state` tensors, computed by the caller from
    their bytes (the delta codec does while decoding, and checks them against the manifest).
    Then `sha256` must be the checkpoint hash of these digests and the policy's serving weights
    must equal `state` bit for bit; nothing is hashed twice.
    `standby`: a policy built from the same config that nothing generates with any more (a version
    no longer served, its leases idle: the built-in engine's standby, app/replica/engines/base.py).
    `state` is loaded into it in place, every serving tensor overwritten, then verified as above;
    a standby that fails verification must not be used again.
    """
    from policy import build_policy

    if standby is not None:
        policy = standby
    elif template is not None and dict(template.config) == dict(config):
        policy = template.policy.shadow()
    else:
        policy = build_policy(dict(config))
    policy.load_serving_state_dict(dict(state))
    policy.eval()
    if digests is None:
        loaded = hash_state_dict(policy.serving_state_dict(), threads)[1]
        if loaded != sha256:
            raise VerificationError(
                f"version {version}: weights hash {loaded[:12]}…, "
                f"the registry published {sha256[:12]}…"
            )
    else:
        claimed = checkpoint_sha256_from_digests(digests)
        if set(digests) != set(state) or claimed != sha256:
            raise VerificationError(
                f"version {version}: the decoded tensors' digests give {claimed[:12]}…, "
                f"the registry published {sha256[:12]}…"
            )
        serving = policy.serving_state_dict()
        bad = sorted(set(serving) ^ set(state)) or [
            k for k, t in serving.items() if not _same_bits(t, state[k])
        ]
        if bad:
            raise VerificationError(
                f"version {version}: the loaded weights differ from the verified ones in {bad[:3]}"
            )
    return LoadedVersion(
        version=str(version), policy=policy, state=dict(state), sha256=sha256, config=dict(config)
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and -0.0 included), as raw bytes — compared as 64-bit
    words when both byte views allow it (~3.5x faster than byte by byte)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ua, ub = (
        a.contiguous().reshape(-1).view(torch.uint8),
        b.contiguous().reshape(-1).view(torch.uint8),
    )
    if ua.numel() % 8 == 0 and ua.storage_offset() % 8 == 0 and ub.storage_offset() % 8 == 0:
        ua, ub = ua.view(torch.int64), ub.view(torch.int64)
    return torch.equal(ua, ub)


class WeightStore:
    """The replica's current `Serving` snapshot; `swap` replaces it atomically."""

    def __init__(self, serving: Serving | None = None):
        self._lock = threading.Lock()
        self._serving = serving or Serving()

    def snapshot(self) -> Serving:
        return self._serving  # one reference read: always a complete, consistent snapshot

    def swap(self, **changes: Any) -> Serving:
        """Replace fields of the snapshot (champion=, candidate=, traffic_pct=) in one assignment."""
        with self._lock:
            new = dataclasses.replace(self._serving, **changes)
            if new.traffic_pct and new.candidate is None:
                new = dataclasses.replace(new, traffic_pct=0.0)
            self._serving = new
            return new

    def hold(self, lv: LoadedVersion) -> Lease | None:
        """A lease on `lv` if the store still serves it, else None (pick again): a swap that took
        `lv` out before the lease was counted is seen here, so an in-place engine that waited for
        `lv`'s leases after the swap never loads over a request that holds one."""
        lease = lv.leases.acquire()
        if any(x is lv for x in self._serving.held()):
            return lease
        lease.release()
        return None

    def find(self, version: str) -> LoadedVersion | None:
        return next((lv for lv in self._serving.held() if lv.version == str(version)), None)


def _fsync_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: temp file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WeightCache:
    """Verified versions on local disk, so a restarted replica serves before it has synced."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for tmp in self.root.glob("*.tmp"):  # left by an apply that was killed
            log.warning("removing %s, left by an interrupted apply", tmp)
            tmp.unlink()

    def _weights(self, version: str) -> Path:
        return self.root / f"v{version}.safetensors"

    def _marker(self, version: str) -> Path:
        return self.root / f"v{version}.json"

    def versions(self) -> list[str]:
        """Versions with a commit marker, oldest first."""
        return sorted((p.stem[1:] for p in self.root.glob("v*.json")), key=int)

    def put(self, lv: LoadedVersion) -> None:
        """Persist a verified version: weights first, then its marker (the commit point)."""
        from safetensors.torch import save

        if self._marker(lv.version).exists():
            return
        data = save(
            {k: v.contiguous() for k, v in lv.state.items()}, metadata={"sha256": lv.sha256}
        )
        _fsync_write(self._weights(lv.version), data)
        _fsync_write(
            self._marker(lv.version),
            json.dumps(
                {"version": lv.version, "sha256": lv.sha256, "config": dict(lv.config)},
                sort_keys=True,
            ).encode(),
        )

    def read(self, version: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
        """(state, config, sha256) of a cached version, unverified (`load` verifies)."""
        from safetensors.torch import load_file

        meta = json.loads(self._marker(version).read_text())
        return load_file(str(self._weights(version))), meta["config"], meta["sha256"]

    def load(self, version: str, threads: int = 1, engine: Any = None) -> LoadedVersion:
        """Load and verify a cached version (into `engine`, app/replica/engines/, when given: it
        verifies as it loads); a corrupt one is deleted and raises VerificationError."""
        try:
            state, config, sha256 = self.read(version)
            if engine is not None:
                return engine.load_cached(str(version), state, config, sha256)
            return load_verified(str(version), state, config, sha256, threads)
        except Exception as exc:
            if engine is not None and not isinstance(exc, (VerificationError, OSError, ValueError)):
                raise  # the engine failed (not the file): the cached version stays
            self.drop(version)
            raise VerificationError(
                f"cached version {version} is unusable ({type(exc).__name__}: {exc}); removed"
            ) from exc

    def drop(self, version: str) -> None:
        for p in (self._marker(version), self._weights(version)):
            p.unlink(missing_ok=True)

    def set_serving(self, serving: Serving) -> None:
        _fsync_write(
            self.root / "serving.json",
            json.dumps(
                {**serving.versions(), "traffic_pct": serving.traffic_pct}, sort_keys=True
            ).encode(),
        )

    def restore(self, threads: int = 1, engine: Any = None) -> Serving:
        """The last serving state, every version re-verified; a missing/corrupt one falls back to the
        newest verified cached version (for the champion) or nothing (for the candidate)."""
        try:
            want = json.loads((self.root / "serving.json").read_text())
        except (FileNotFoundError, ValueError):
            want = {}
        loaded: dict[str, LoadedVersion] = {}

        def get(version: str | None) -> LoadedVersion | None:
            if version is None or version not in self.versions():
                return None
            if version not in loaded:
                try:
                    loaded[version] = self.load(version, threads, engine)
                except VerificationError as exc:
                    log.error("%s", exc)
                    return None
            return loaded[version]

        champion = get(want.get("champion"))
        for v in reversed(self.versions()):
            if champion is not None:
                break
            champion = get(v)
        candidate = get(want.get("candidate"))
        traffic = float(want.get("traffic_pct") or 0.0) if candidate is not None else 0.0
        return Serving(champion=champion, candidate=candidate, traffic_pct=traffic)

    def prune(self, keep: int, protect: set[str]) -> None:
        """Keep the newest `keep` versions and every version in `protect`."""
        versions = self.versions()
        for v in versions[:-keep] if keep else versions:
            if v not in protect:
                self.drop(v)
