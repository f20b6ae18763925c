"""The engine interface and the built-in torch engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from app.replica.config import ReplicaConfig
    from app.replica.weights import LoadedVersion, Serving, WeightStore


class EngineUnavailable(RuntimeError):
    """The engine cannot generate right now (its server is unreachable or died): 503."""


class EngineRefused(Exception):
    """This engine cannot serve the version (another architecture, a policy type it does not run)."""


class Engine(Protocol):
    """Loads verified versions; the sync agent (app/replica/sync.py) drives it.

    `in_place`: loading may overwrite weights a held version generates with (vLLM); the sync agent
    then builds at most one version per reconcile and checks `usable()` before reusing one."""

    name: str
    in_place: bool
    slots: int  # model calls that may run at once (app/replica/admission.py)

    def load(
        self,
        slot: str,
        version: str,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        sha256: str,
        *,
        store: WeightStore,
        digests: Mapping[str, str] | None = None,
    ) -> LoadedVersion:
        """Load `state` (verified by the fetcher) for `slot` and verify what the engine holds
        against `sha256`; raises VerificationError (and keeps serving what it served) otherwise."""
        ...

    def load_cached(
        self,
        version: str,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        sha256: str,
    ) -> LoadedVersion:
        """Load a version from the replica's verified cache at start (before any request)."""
        ...

    def usable(self, lv: LoadedVersion) -> bool:
        """Whether `lv` still generates with its own weights."""
        ...

    def status(self) -> dict[str, Any]: ...

    def check(self) -> None:
        """Repair what can be repaired (a vLLM server that exited); the sync agent calls it."""
        ...

    def close(self) -> None: ...


class BuiltinEngine:
    """Today's engine: each version is a new in-process torch policy (weights.load_verified)."""

    name = "torch"
    in_place = False
    slots = 1  # the policy generates one batch at a time

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.cfg = cfg

    def load(
        self,
        slot: str,
        version: str,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        sha256: str,
        *,
        store: WeightStore,
        digests: Mapping[str, str] | None = None,
    ) -> LoadedVersion:
        from app.replica.weights import load_verified

        serving: Serving = store.snapshot()
        return load_verified(
            version,
            state,
            config,
            sha256,
            template=next(iter(serving.held()), None),
            digests=digests or None,
        )

    def load_cached(
        self,
        version: str,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        sha256: str,
    ) -> LoadedVersion:
        from app.replica.weights import load_verified

        return load_verified(version, state, config, sha256)

    def usable(self, lv: LoadedVersion) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        return {"engine": self.name}

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass
