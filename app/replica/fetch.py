"""Reconstruct a registered version's weights from its MLflow artifacts, verified.

    fetcher = VersionFetcher(settings)
    got = fetcher.fetch("9", held={"7": loaded_v7})   # -> Fetched(state, config, sha256, path, ...)

Layout (trainer/registry.py + trainer/publish.py): a version's model source is
`<run artifacts>/ships/<ship_id>/model`; its sync artifacts (`manifest.json`,
`delta-from-<parent>.fwd`, `anchor.safetensors` when due) lie next to it in
`ships/<ship_id>/<artifacts_dir>` (default `delta`), and the policy architecture in
`model/artifacts/config.json`.

The chain logic is `trainer.publish.apply_chain`: it walks the manifests back from the target,
tries the cheaper of "deltas forward from the held version" and "nearest anchor + deltas",
falls back to the other on any hash mismatch or corrupt file, and verifies every file, every
delta's base/target hashes and the result's per-tensor and checkpoint SHA-256s against the
target's manifest. This module supplies its `fetch(version, filename) -> bytes` callback:
artifacts behind the MLflow server's artifact proxy (`mlflow-artifacts:` URIs, the default of
`mlflow server`) are read with one plain HTTP GET each (no temp files), any other scheme goes
through `mlflow.artifacts.download_artifacts`.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import httpx
import torch

from app.settings import Settings

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
    bytes_by_kind: dict[str, int] = field(default_factory=dict)  # delta / anchor / manifest / config
    fallbacks: int = 0  # 1 when the first path failed verification and the other one was used


def _kind(filename: str) -> str:
    if filename.endswith(".fwd"):
        return "delta"
    if filename.endswith(".safetensors"):
        return "anchor"
    return "manifest" if filename == "manifest.json" else "other"


class VersionFetcher:
    """MLflow-backed `fetch(version, filename)` plus the verified reconstruction of a version."""

    def __init__(self, settings: Settings, artifacts_dir: str = "delta", timeout_s: float = 120.0):
        from mlflow import MlflowClient

        self.uri, self.model = settings.mlflow_uri.rstrip("/"), settings.model_name
        self.artifacts_dir = artifacts_dir
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.http = httpx.Client(timeout=timeout_s)
        self._roots: dict[str, str] = {}  # version -> artifact URI of ships/<ship_id> (immutable per version)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch-config")

    # --- MLflow ---------------------------------------------------------------------------------------
    def champion_alias(self) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(self.model, "champion").version)
        except MlflowException:
            return None

    def _root(self, version: str) -> str:
        with self._lock:
            if version not in self._roots:
                from mlflow.exceptions import MlflowException

                try:
                    mv = self.client.get_model_version(self.model, str(version))
                except MlflowException as exc:
                    raise FileNotFoundError(f"model version {self.model}/{version} not found: {exc}") from exc
                source = mv.source.rstrip("/")
                assert source.endswith("/model"), \
                    f"version {version}'s source {source} is not a trainer ship (…/ships/<ship_id>/model)"
                self._roots[version] = source[: -len("/model")]
            return self._roots[version]

    def _get(self, uri: str) -> bytes:
        """Bytes of one artifact URI; FileNotFoundError when it does not exist."""
        parsed = urlparse(uri)
        if parsed.scheme == "mlflow-artifacts":
            host = f"http://{parsed.netloc}" if parsed.netloc else self.uri
            r = self.http.get(f"{host}/api/2.0/mlflow-artifacts/artifacts/{quote(parsed.path.lstrip('/'))}")
            if r.status_code == 404:
                raise FileNotFoundError(uri)
            r.raise_for_status()
            return r.content
        import mlflow
        from mlflow.exceptions import MlflowException

        with tempfile.TemporaryDirectory(prefix="flywheel-fetch-") as tmp:
            try:
                path = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp, tracking_uri=self.uri)
            except (MlflowException, OSError) as exc:
                raise FileNotFoundError(f"{uri}: {exc}") from exc
            return Path(path).read_bytes()

    def fetch_file(self, version: str, filename: str) -> bytes:
        """The `fetch` callback of trainer.publish: one sync artifact of `version`."""
        return self._get(f"{self._root(str(version))}/{self.artifacts_dir}/{filename}")

    def policy_config(self, version: str) -> dict[str, Any]:
        import json

        return json.loads(self._get(f"{self._root(str(version))}/model/artifacts/config.json"))

    # --- reconstruction -------------------------------------------------------------------------------
    def fetch(self, target: str, held: dict[str, Any]) -> Fetched:
        """Reconstruct `target` (verified) from the best held version (newest one at or below the
        target) or the nearest anchor. `held`: version -> object with `.state` (LoadedVersion).
        Raises trainer.publish.ChainError when no verifiable path exists."""
        from trainer.publish import apply_chain

        target = str(target)
        below = sorted((v for v in held if int(v) <= int(target)), key=int)
        base = (below[-1], held[below[-1]].state) if below else None
        chain: list[str] = []
        sizes: dict[str, int] = {}

        def fetch(version: str, filename: str) -> bytes:
            data = self.fetch_file(version, filename)
            chain.append(f"{version}/{filename}")
            sizes[_kind(filename)] = sizes.get(_kind(filename), 0) + len(data)
            return data

        config_future = self._pool.submit(self.policy_config, target)  # overlaps with the chain
        state, manifest = apply_chain(target, fetch, held=base)
        config = config_future.result()
        data_files = [c for c in chain if _kind(c) in ("delta", "anchor")]
        anchor_at = next((i for i, c in enumerate(data_files) if _kind(c) == "anchor"), None)
        path = "anchor" if anchor_at is not None else "delta"
        fallbacks = int(anchor_at is not None and base is not None and anchor_at > 0)
        return Fetched(version=target, state=state, config=config, sha256=manifest.checkpoint_sha256, path=path,
                       chain=chain, bytes_by_kind=sizes, fallbacks=fallbacks)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.http.close()
