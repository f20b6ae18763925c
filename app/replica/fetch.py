"""Reconstruct a registered version's weights from its MLflow artifacts, verified.

    fetcher = VersionFetcher(settings)
    got = fetcher.fetch("9", held={"7": loaded_v7})   # -> Fetched(state, config, sha256, path, ...)

Layout (trainer/registry.py + app/contracts/artifacts.py): a version's model source is
`<run artifacts>/ships/<ship_id>/model`; its sync artifacts (`manifest.json`,
`delta-from-<parent>.fwd`, `anchor.safetensors` when due) lie next to it in
`ships/<ship_id>/<artifacts_dir>` (default `delta`), and the policy architecture in
`model/artifacts/config.json`.

Where a version's artifacts are: from the deployment log when it says so (`learn(version, hint)`:
the trainer's `version_registered` event carries the model version's source and its policy
config's canonical SHA-256, app/contracts/hints.py), else one MLflow REST look-up (model version ->
artifact root), cached per version. A hinted root that fails is dropped and MLflow is asked; if
MLflow names another root, the sync is retried once from there.

Fast path (the common case: the target's parent is the newest version the replica holds):
ONE round of parallel GETs — the target's manifest, the delta from the held version (requested
speculatively, before the manifest has named it) and the policy config, unless a held version's
config has the canonical SHA-256 the deployment event gave (then that config is reused: equal
hashes of the canonical JSON = equal configs; no hash, no reuse) — then one verified
decode: the delta file's SHA-256 against the manifest, the delta's base checkpoint hash
against the held version's already-verified hash (no re-hash of the held weights), every
decoded tensor's SHA-256 and the checkpoint SHA-256 against the manifest. The per-tensor
digests the codec computed travel with the result (`Fetched.digests`), so loading does not
hash the weights a second time (weights.load_verified compares the loaded bits instead).

General path (anything else, or any failure of the fast path): `app.contracts.artifacts.apply_chain`
walks the manifests back from the target, tries the cheaper of "deltas forward from the held
version" and "nearest anchor + deltas", falls back to the other on any hash mismatch or
corrupt file, and verifies every file, every delta's base/target hashes and the result's
per-tensor and checkpoint SHA-256s against the target's manifest. When the fast path's delta
itself failed verification, only the anchor route is tried (the same delta would fail again).

Manifests and policy configs are immutable per version, so both are cached in memory once
they parsed (a sync that fails drops the cached manifests it used; the retry re-reads them):
a sync reads one new manifest, not the whole chain back to the anchor.

`fetch(version, filename) -> bytes`: artifacts behind the MLflow server's artifact proxy
(`mlflow-artifacts:` URIs, the default of `mlflow server`) are read with one plain HTTP GET each
(no temp files), any other scheme goes through `mlflow.artifacts.download_artifacts`.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import httpx
import torch

from app.contracts.hints import ArtifactHint, config_sha256
from app.replica.pushed_store import PushedDeltas
from app.settings import Settings
from kernels.delta import DeltaFormatError
from kernels.delta.manifest import MANIFEST_FILE, Manifest, delta_file

log = logging.getLogger(__name__)


@dataclass
class Fetched:
    """A reconstructed, verified version (not yet loaded into a policy)."""

    version: str
    state: dict[str, torch.Tensor]
    config: dict[str, Any]
    sha256: str
    path: str  # "delta" (forward from a held version) or "anchor" (nearest anchor + deltas)
    chain: list[str]  # artifact files fetched, in order ("7/delta-from-6.fwd", ...)
    bytes_by_kind: dict[str, int] = field(
        default_factory=dict
    )  # delta / anchor / manifest / config
    fallbacks: int = 0  # 1 when the first path failed verification and the other one was used
    digests: dict[str, str] = field(
        default_factory=dict
    )  # per-tensor SHA-256s verified against the manifest
    timings: dict[str, float] = field(
        default_factory=dict
    )  # seconds per stage (lookup, download, decode)
    config_reused: bool = (
        False  # the config came from a held version (hash given by the deployment log)
    )
    pushed_rejected: int = (
        0  # pushed deltas that failed verification (the originals were downloaded)
    )


def _kind(filename: str) -> str:
    if filename.endswith(".fwd"):
        return "delta"
    if filename.endswith(".safetensors"):
        return "anchor"
    return "manifest" if filename == "manifest.json" else "other"


class VersionFetcher:
    """MLflow-backed `fetch(version, filename)` plus the verified reconstruction of a version."""

    def __init__(
        self,
        settings: Settings,
        artifacts_dir: str = "delta",
        timeout_s: float = 120.0,
        decode_threads: int = 1,
        pushed_max_bytes: int = 64 << 20,
    ):
        from mlflow import MlflowClient

        self.uri, self.model = settings.mlflow_uri.rstrip("/"), settings.model_name
        self.artifacts_dir = artifacts_dir
        self.decode_threads = (
            decode_threads  # threads of the verified delta decode (ReplicaConfig.decode_threads)
        )
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.http = httpx.Client(
            timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=8)
        )
        self._roots: dict[
            str, str
        ] = {}  # version -> artifact URI of ships/<ship_id> (immutable per version)
        self._hints: dict[
            str, ArtifactHint
        ] = {}  # version -> what the deployment log said (not yet failed)
        self._manifests: dict[
            str, bytes
        ] = {}  # version -> manifest.json bytes that parsed (immutable)
        self._configs: dict[str, dict[str, Any]] = {}  # version -> policy config (immutable)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="fetch")
        self.pushed = PushedDeltas(
            max_bytes=pushed_max_bytes
        )  # deltas received on `<ns>.deltas` (app/contracts/pushed.py)

    # --- MLflow ---------------------------------------------------------------------------------------
    def champion_alias(self) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(self.model, "champion").version)
        except MlflowException:
            return None

    def learn(self, version: str, hint: ArtifactHint) -> None:
        """Remember where the deployment log says `version`'s artifacts are (used until it fails)."""
        with self._lock:
            self._hints[str(version)] = hint

    def _hinted(self, version: str) -> ArtifactHint | None:
        with self._lock:
            return None if version in self._roots else self._hints.get(version)

    def _root(self, version: str) -> str:
        with self._lock:
            root = self._roots.get(version)
            hint = self._hints.get(version)
        if root is not None:
            return root
        if hint is not None:
            return hint.root
        return self._lookup_root(version)

    def _lookup_root(self, version: str) -> str:
        """The ship's artifact root as MLflow's registry names it (one REST call; cached)."""
        with self._lock:
            root = self._roots.get(version)
        if root is not None:
            return root
        source = self._model_version_source(str(version)).rstrip(
            "/"
        )  # outside the lock: may be slow
        assert source.endswith("/model"), (
            f"version {version}'s source {source} is not a trainer ship (…/ships/<ship_id>/model)"
        )
        with self._lock:
            self._roots[version] = source[: -len("/model")]
            return self._roots[version]

    def _model_version_source(self, version: str) -> str:
        """The model version's source URI: one REST call (MLflow's documented
        `GET /api/2.0/mlflow/model-versions/get`) on the fetcher's keep-alive HTTP client, or
        through MlflowClient for a non-HTTP registry URI."""
        if urlparse(self.uri).scheme in ("http", "https"):
            r = self.http.get(
                f"{self.uri}/api/2.0/mlflow/model-versions/get",
                params={"name": self.model, "version": version},
            )
            if r.status_code in (400, 404):  # RESOURCE_DOES_NOT_EXIST / INVALID_PARAMETER_VALUE
                raise FileNotFoundError(
                    f"model version {self.model}/{version} not found: {r.text[:300]}"
                )
            r.raise_for_status()
            return str(r.json()["model_version"]["source"])
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version(self.model, version).source)
        except MlflowException as exc:
            raise FileNotFoundError(
                f"model version {self.model}/{version} not found: {exc}"
            ) from exc

    def _get(self, uri: str) -> bytes:
        """Bytes of one artifact URI; FileNotFoundError when it does not exist."""
        parsed = urlparse(uri)
        if parsed.scheme == "mlflow-artifacts":
            host = f"http://{parsed.netloc}" if parsed.netloc else self.uri
            r = self.http.get(
                f"{host}/api/2.0/mlflow-artifacts/artifacts/{quote(parsed.path.lstrip('/'))}"
            )
            if r.status_code == 404:
                raise FileNotFoundError(uri)
            r.raise_for_status()
            return r.content
        import mlflow
        from mlflow.exceptions import MlflowException

        with tempfile.TemporaryDirectory(prefix="flywheel-fetch-") as tmp:
            try:
                path = mlflow.artifacts.download_artifacts(
                    artifact_uri=uri, dst_path=tmp, tracking_uri=self.uri
                )
            except (MlflowException, OSError) as exc:
                raise FileNotFoundError(f"{uri}: {exc}") from exc
            return Path(path).read_bytes()

    def fetch_file(self, version: str, filename: str) -> bytes:
        """The `fetch` callback of app.contracts.artifacts: one sync artifact of `version` (manifests cached)."""
        version = str(version)
        if filename == MANIFEST_FILE:
            with self._lock:
                cached = self._manifests.get(version)
            if cached is not None:
                return cached
        data = self._get(f"{self._root(version)}/{self.artifacts_dir}/{filename}")
        if filename == MANIFEST_FILE:
            self._parse_manifest(version, data)  # only a manifest that parses is cached
            with self._lock:
                self._manifests[version] = data
        return data

    @staticmethod
    def _parse_manifest(version: str, data: bytes) -> Manifest:
        try:
            m = Manifest.model_validate_json(data)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise DeltaFormatError(f"manifest of version {version} is invalid: {exc}") from exc
        if m.version != version:
            raise DeltaFormatError(
                f"manifest fetched for version {version} describes version {m.version}"
            )
        return m

    def forget(self, versions: Any) -> None:
        """Drop cached manifests (after a failed sync, so the retry reads them again)."""
        with self._lock:
            for v in versions:
                self._manifests.pop(str(v), None)

    def policy_config(self, version: str) -> dict[str, Any]:
        import json

        version = str(version)
        with self._lock:
            cached = self._configs.get(version)
        if cached is None:
            cached = json.loads(self._get(f"{self._root(version)}/model/artifacts/config.json"))
            assert isinstance(cached, dict), (
                f"policy config of version {version} is not a JSON object"
            )
            self._materialize_hf_files(version, cached)
            with self._lock:
                self._configs[version] = cached
        return dict(cached)

    def _materialize_hf_files(self, version: str, config: dict[str, Any]) -> None:
        """An HF policy's model files (`model/artifacts/hf/`, policy/hf_files.py) into the
        local cache, verified against the config's `files_sha256`, so build_policy finds them (a
        LoRA version's files include its base weights, downloaded once per base)."""
        import json

        from policy.hf_files import (
            HF_FILES,
            HF_REF,
            WEIGHTS_FILE,
            HFFilesError,
            files_sha256,
            materialize,
            resolve,
        )

        sha = config.get("files_sha256") if config.get("type") == "hf" else None
        if sha is None:
            return
        weights = bool(config.get("lora"))
        try:
            resolve(None, sha, weights=weights)
            return
        except HFFilesError:
            pass  # not here yet (or damaged): download
        model = f"{self._root(version)}/model"
        try:  # stored with an earlier version (a LoRA line's base): hf_files.HF_REF names it
            model = json.loads(self._get(f"{model}/artifacts/{HF_REF}"))["source"].rstrip("/")
        except FileNotFoundError:
            pass
        files = {}
        for name in HF_FILES + ((WEIGHTS_FILE,) if weights else ()):
            try:
                files[name] = self._get(f"{model}/artifacts/hf/{name}")
            except FileNotFoundError:
                continue
        got = files_sha256(files)
        if got != sha:
            raise HFFilesError(f"version {version}: model/artifacts/hf hash to {got}, config {sha}")
        materialize(files)

    def _reusable_config(self, target: str, held: dict[str, Any]) -> dict[str, Any] | None:
        """A held version's config when the deployment log gave `target`'s config hash and it matches."""
        hint = self._hints.get(target)
        if hint is None or hint.config_sha256 is None:
            return None
        for lv in held.values():
            cfg = getattr(lv, "config", None)
            if cfg is not None and config_sha256(dict(cfg)) == hint.config_sha256:
                return dict(cfg)
        return None

    # --- reconstruction -------------------------------------------------------------------------------
    def fetch(self, target: str, held: dict[str, Any]) -> Fetched:
        """Reconstruct `target` (verified) from the best held version (newest one at or below the
        target) or the nearest anchor. `held`: version -> object with `.state` and (optionally)
        `.sha256`, the held weights' verified checkpoint hash (LoadedVersion) and `.config`.
        Raises app.contracts.artifacts.ChainError when no verifiable path exists."""
        target = str(target)
        hint = self._hinted(target)
        try:
            return self._fetch(target, held)
        except Exception as exc:
            if hint is None:
                raise
            with self._lock:  # the log's word failed once: ask MLflow from now on
                self._hints.pop(target, None)
                self._configs.pop(target, None)
            try:
                root = self._lookup_root(target)
            except FileNotFoundError:
                raise exc from None
            if root == hint.root:
                raise exc  # same place: the failure is the artifacts', not the hint's
            log.warning(
                "version %s: the deployment log's artifact root %s failed (%s); MLflow names %s, retrying",
                target,
                hint.root,
                exc,
                root,
            )
            return self._fetch(target, held)

    def _fetch(self, target: str, held: dict[str, Any]) -> Fetched:
        below = sorted((v for v in held if int(v) <= int(target)), key=int)
        base = (below[-1], held[below[-1]]) if below else None
        chain: list[str] = []
        sizes: dict[str, int] = {}
        rejected: list[str] = []  # pushed deltas that failed verification
        timings: dict[str, float] = {}
        t0 = time.perf_counter()

        def fetch(version: str, filename: str) -> bytes:
            data = self.fetch_file(version, filename)
            chain.append(f"{version}/{filename}")
            sizes[_kind(filename)] = sizes.get(_kind(filename), 0) + len(data)
            return data

        try:
            self._root(
                target
            )  # the one MLflow REST call of a new version the log gave no root for (cached)
            timings["lookup"] = time.perf_counter() - t0
            reused = self._reusable_config(target, held)
            if reused is not None:
                config_future: Any = Future()
                config_future.set_result(reused)
            else:
                config_future = self._pool.submit(
                    self.policy_config, target
                )  # overlaps with the weights
            got = None
            if base is not None:
                got = self._hinted_path(target, base, fetch, timings, chain, sizes, rejected)
                if isinstance(
                    got, str
                ):  # a stale hint or a corrupt delta: the manifest path decides which
                    got = None
                if got is None:
                    got = self._fast_path(target, base, fetch, timings)
            attempts: list[str] = []
            fallbacks = 0
            if isinstance(got, str):  # the fast path was tried and failed verification
                attempts.append(got)
                fallbacks = 1
            if got is None or isinstance(got, str):
                got = self._general_path(
                    target, base if not attempts else None, fetch, attempts, timings
                )
            state, digests, checkpoint_sha = got
            config = config_future.result()
        except Exception:
            self.forget({c.split("/", 1)[0] for c in chain} | {target})
            raise
        data_files = [c for c in chain if _kind(c) in ("delta", "anchor")]
        anchor_at = next((i for i, c in enumerate(data_files) if _kind(c) == "anchor"), None)
        path = "anchor" if anchor_at is not None else "delta"
        fallbacks = max(
            fallbacks, int(anchor_at is not None and base is not None and anchor_at > 0)
        )
        timings["total"] = time.perf_counter() - t0
        return Fetched(
            version=target,
            state=state,
            config=config,
            sha256=checkpoint_sha,
            path=path,
            chain=chain,
            bytes_by_kind=sizes,
            fallbacks=fallbacks,
            digests=digests,
            timings=timings,
            config_reused=reused is not None,
            pushed_rejected=len(rejected),
        )

    def _hinted_path(
        self,
        target: str,
        base: tuple[str, Any],
        fetch: Any,
        timings: dict[str, float],
        chain: list[str],
        sizes: dict[str, int],
        rejected: list[str],
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], str] | str | None:
        """The delta alone (one GET, or none when it was pushed on `<ns>.deltas`), verified against
        what the deployment log published for the target (app/contracts/hints.py): the file's size and
        SHA-256, the held weights' checkpoint hash (by the codec, against the delta's base), every
        decoded tensor hashed and their checkpoint SHA-256 equal to the published one (it commits to
        every tensor's name and digest). Pushed bytes that fail are dropped and the file downloaded.
        None: no usable hint for this held version; a string: it failed (the caller reads the manifest)."""
        base_version, base_lv = base
        with self._lock:
            hint = self._hints.get(target)
        if (
            hint is None
            or getattr(base_lv, "sha256", None) is None
            or base_version == target
            or not hint.delta_from(base_version)
        ):
            return None
        pushed = self.pushed.get(target, hint.delta_file)
        if pushed is not None:  # received on `<ns>.deltas`: the same file, checked the same way
            got = self._decode_checked(
                target,
                base,
                pushed,
                hint.delta_file,
                hint.delta_bytes,
                hint.delta_sha256,
                hint.checkpoint_sha256,
                None,
                f"pushed delta from v{base_version}",
                timings,
            )
            if not isinstance(got, str):
                chain.append(f"kafka:{target}/{hint.delta_file}")
                sizes["pushed"] = sizes.get("pushed", 0) + len(pushed)
                timings["download"] = 0.0
                return got
            self.pushed.drop(target, hint.delta_file)  # then download the original from MLflow
            rejected.append(f"{target}/{hint.delta_file}")
        t0 = time.perf_counter()
        try:
            blob = fetch(target, hint.delta_file)
        except FileNotFoundError as exc:
            return f"hinted delta: {exc}"
        timings["download"] = time.perf_counter() - t0
        return self._decode_checked(
            target,
            base,
            blob,
            hint.delta_file,
            hint.delta_bytes,
            hint.delta_sha256,
            hint.checkpoint_sha256,
            None,
            f"hinted delta from v{base_version}",
            timings,
        )

    def _fast_path(
        self,
        target: str,
        base: tuple[str, Any],
        fetch: Any,
        timings: dict[str, float],
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], str] | str | None:
        """One delta forward from the held version. None: not applicable (the target's parent is
        not the held version); a string: it was applicable and failed verification (why)."""
        t0 = time.perf_counter()
        base_version, base_lv = base
        if base_version == target:
            return None
        manifest_f = self._pool.submit(fetch, target, MANIFEST_FILE)
        delta_f = self._pool.submit(
            fetch, target, delta_file(base_version)
        )  # speculative: the usual parent
        try:
            manifest = self._parse_manifest(target, manifest_f.result())
        except (FileNotFoundError, DeltaFormatError):
            delta_f.cancel()
            return None  # the general path reports it (ChainError)
        if manifest.parent_version != base_version or manifest.delta is None:
            delta_f.cancel()
            return None
        try:
            blob = delta_f.result()
        except FileNotFoundError as exc:
            return f"fast path: {exc}"
        timings["download"] = time.perf_counter() - t0
        ref = manifest.delta
        return self._decode_checked(
            target,
            base,
            blob,
            ref.file,
            ref.bytes,
            ref.sha256,
            manifest.checkpoint_sha256,
            {t.name: t.sha256 for t in manifest.tensors},
            f"fast path (delta from v{base_version})",
            timings,
        )

    def _decode_checked(
        self,
        target: str,
        base: tuple[str, Any],
        blob: bytes,
        file: str,
        nbytes: int,
        sha256: str,
        checkpoint_sha256: str,
        digests_want: dict[str, str] | None,
        path: str,
        timings: dict[str, float],
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], str] | str:
        """Decode `blob` (a delta from the held `base`) after checking the file against its published
        size and SHA-256; the decoded checkpoint SHA-256 (which the codec derives from every tensor's
        digest) must be `checkpoint_sha256`, and the digests `digests_want` when given. Returns the
        verified (state, digests, checkpoint SHA-256), or why it failed."""
        from kernels.delta.codec import decode_delta_verified

        base_version, base_lv = base
        t0 = time.perf_counter()
        try:
            if len(blob) != nbytes or hashlib.sha256(blob).hexdigest() != sha256:
                raise DeltaFormatError(
                    f"{file} of version {target} does not match its published size/SHA-256"
                )
            state, digests, sha = decode_delta_verified(
                base_lv.state,
                blob,
                threads=self.decode_threads,
                base_checkpoint_sha256=getattr(base_lv, "sha256", None),
            )
            if (digests_want is not None and digests != digests_want) or sha != checkpoint_sha256:
                bad = (
                    sorted(set(digests_want.items()) ^ set(digests.items()))[:3]
                    if digests_want is not None
                    else []
                )
                raise DeltaFormatError(
                    f"version {target} decoded from v{base_version} has checkpoint {sha[:12]}…, "
                    f"published {checkpoint_sha256[:12]}…"
                    + (f" (tensors e.g. {bad})" if bad else "")
                )
        except (DeltaFormatError, ValueError) as exc:
            log.warning("version %s via the %s failed: %s", target, path, exc)
            return f"{path}: {exc}"
        timings["decode"] = time.perf_counter() - t0
        return dict(state), digests, sha

    def _general_path(
        self,
        target: str,
        base: tuple[str, Any] | None,
        fetch: Any,
        attempts: list[str],
        timings: dict[str, float],
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
        from app.contracts.artifacts import ChainError, apply_chain

        t0 = time.perf_counter()
        try:
            state, manifest = apply_chain(
                target, fetch, held=(base[0], base[1].state) if base else None
            )
        except ChainError as exc:
            raise ChainError(target, attempts + exc.attempts) from exc
        timings["chain"] = time.perf_counter() - t0
        # apply_chain verified every tensor's SHA-256 against the manifest: those are its digests
        return state, {t.name: t.sha256 for t in manifest.tensors}, manifest.checkpoint_sha256

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.http.close()
