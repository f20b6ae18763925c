"""The engine interface and the built-in torch engine."""

from __future__ import annotations

import weakref
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
    """Each version is an in-process torch policy (weights.load_verified), built on the side and
    verified before the sync agent swaps it in.

    Standby (`ReplicaConfig.standby`, on by default): the engine remembers the policies it loaded.
    A new version is loaded in place into one the store no longer serves and no request holds (its
    leases idle: `WeightStore.hold` refuses a lease on a version the store no longer serves, so
    none can start on it afterwards); without one, into a fresh shadow of a held version
    (`Policy.shadow`). Either way the serving version is untouched until the swap, and what is
    swapped in was verified bit for bit after the load."""

    name = "torch"
    in_place = False
    slots = 1  # the policy generates one batch at a time

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.cfg = cfg
        # (policy, its version's leases, config, the store's snapshot when it was loaded) of every
        # version loaded and not yet let go
        self._loaded: list[tuple[Any, Any, dict[str, Any], weakref.ref]] = []

    def _take_standby(self, store: WeightStore, config: Mapping[str, Any]) -> Any | None:
        """A retired policy of `config` (loaded, then swapped out: no held version uses it) that no
        request holds, taken out of the engine's list. A policy loaded since the store's last swap
        (the champion built in the same reconcile as the candidate) is not retired; every other
        retired policy is let go (freed when its requests end)."""
        now = store.snapshot()
        held = {id(lv.policy) for lv in now.held()}
        keep, standby = [], None
        for entry in self._loaded:
            policy, leases, cfg, loaded_at = entry
            if id(policy) in held or loaded_at() is now:
                keep.append(entry)
            elif standby is None and leases.count == 0 and cfg == dict(config):
                standby = policy
        self._loaded = keep
        return standby

    def _remember(self, lv: LoadedVersion, store: WeightStore | None) -> LoadedVersion:
        if self.cfg.standby and store is not None:
            self._loaded.append(
                (lv.policy, lv.leases, dict(lv.config), weakref.ref(store.snapshot()))
            )
        return lv

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

        standby = self._take_standby(store, config)
        serving: Serving = store.snapshot()
        return self._remember(
            load_verified(
                version,
                state,
                config,
                sha256,
                template=next(iter(serving.held()), None),
                digests=digests or None,
                standby=standby,
            ),
            store,
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
