"""The non-weight files of a Hugging Face model directory, content-addressed, so a registry version is
self-contained: any machine rebuilds the HF policy from the version's artifacts alone.

Writer (the registry, at registration time):

    files, sha = pack(model_dir)          # {name: bytes} of config.json, generation_config.json,
                                          # the tokenizer files; sha = files_sha256(files)
    # logged as model/artifacts/hf/<name>; the policy config records {"files_sha256": sha}

Reader (trainer registry load, replica fetch, gate, pyfunc):

    path = materialize(files, cache_root)  # <cache_root>/<sha>/, written once, atomically
    policy = build_policy({"type": "hf", "files_sha256": sha})   # resolves the same directory

A LoRA policy's file set also carries its frozen base weights (`model.safetensors`, `pack(...,
weights=True)`; policy/lora.py), so its `files_sha256` covers the base.

`resolve(model_dir, files_sha256, cache_root, weights)` is how `HFPolicy` finds its directory: `model_dir`
when given (a user's directory, or a downloaded artifact directory), else
`<cache_root>/<files_sha256>/`; with `files_sha256` set, the directory's files must hash to it, so
an edited or half-written cache is never used. The hash covers each file's name, length and bytes
in sorted name order. The cache root defaults to `<FLYWHEEL_DATA_DIR>/hf-models`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

TOKENIZER_FILES = (
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
)
"""The files that define a tokenizer; those present are hashed into its id."""

MODEL_FILES = ("config.json", "generation_config.json")
HF_FILES = tuple(sorted(MODEL_FILES + TOKENIZER_FILES))
"""Every file `pack` carries (those present); weights are not among them."""
WEIGHTS_FILE = "model.safetensors"
"""The base weights a LoRA policy's file set carries (`pack(..., weights=True)`): the frozen base is
part of the model's files, so `files_sha256` covers it (policy/lora.py)."""
CACHE_DIR = "hf-models"
HF_REF = "hf_ref.json"
"""Written instead of `hf/` when a file set carrying weights is already stored with an earlier
version: `{"files_sha256": ..., "source": <that version's model source URI>}`, so a LoRA line
stores its base once (`ref_source` follows it)."""


class HFFilesError(ValueError):
    """A directory or file set that does not hash to what the policy config records."""


def files_sha256(files: Mapping[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def pack(model_dir: str | Path, weights: bool = False) -> tuple[dict[str, bytes], str]:
    """The non-weight files of `model_dir` ({name: bytes}) and their `files_sha256`; with `weights`
    (a LoRA policy's base) `model.safetensors` too, which must then be there."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d / 'config.json'}: missing (not a model directory)")
    names = HF_FILES + ((WEIGHTS_FILE,) if weights else ())
    if weights and not (d / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{d / WEIGHTS_FILE}: missing (the base weights of a LoRA policy)")
    files = {n: (d / n).read_bytes() for n in names if (d / n).is_file()}
    return files, files_sha256(files)


def default_cache_root() -> Path:
    """`<FLYWHEEL_DATA_DIR>/hf-models` (FLYWHEEL_DATA_DIR defaults to `.flywheel`, app/settings.py)."""
    return Path(os.environ.get("FLYWHEEL_DATA_DIR") or ".flywheel") / CACHE_DIR


def materialize(files: Mapping[str, bytes], cache_root: str | Path | None = None) -> Path:
    """`<cache_root>/<sha>/` holding `files`; written into a temporary directory and renamed, so a
    reader never sees it half-written. An existing directory with the right hash is reused."""
    unknown = sorted(set(files) - set(HF_FILES) - {WEIGHTS_FILE})
    if unknown or "config.json" not in files:
        raise HFFilesError(
            f"not an HF model file set: unknown {unknown}, config.json "
            f"{'present' if 'config.json' in files else 'missing'}"
        )
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    sha = files_sha256(files)
    final = root / sha
    if final.is_dir():
        if pack(final, WEIGHTS_FILE in files)[1] == sha:
            return final
        shutil.rmtree(final)  # a damaged cache entry: write it again
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", dir=root))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (
            final.is_dir() and pack(final, WEIGHTS_FILE in files)[1] == sha
        ):  # another won: fine
            raise
    return final


def resolve(
    model_dir: str | None,
    sha: str | None,
    cache_root: str | Path | None = None,
    weights: bool = False,
) -> Path:
    """The directory an HF policy config names (module docstring); verified when `sha` is set
    (`weights`: the hash covers `model.safetensors` too, as a LoRA policy's does)."""
    if model_dir is None and sha is None:
        raise HFFilesError("an HF policy config needs model_dir or files_sha256")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    path = Path(model_dir) if model_dir is not None else root / str(sha)
    if sha is not None:
        if not path.is_dir():
            raise HFFilesError(
                f"{path}: no such directory; the model files with files_sha256 {sha} are not "
                "materialized here (the registry reader writes them from the version's artifacts)"
            )
        got = pack(path, weights)[1]
        if got != sha:
            raise HFFilesError(f"{path}: model files hash to {got}, the policy config says {sha}")
    return path


def ensure_from_artifacts(
    config: dict, source: str, tracking_uri: str, cache_root: str | Path | None = None
) -> None:
    """Make `config` buildable here: for an HF config with `files_sha256`, download the model
    version's `<source>/artifacts/hf/` (source = the version's MLflow model URI) into the cache,
    verified, unless it is there already. Other configs: nothing to do."""
    sha = config.get("files_sha256") if config.get("type") == "hf" else None
    if sha is None:
        return
    try:
        resolve(None, sha, cache_root, weights=bool(config.get("lora")))
        return
    except HFFilesError:
        pass  # not here yet (or damaged): download
    import mlflow

    source = ref_source(source, tracking_uri)
    with tempfile.TemporaryDirectory(prefix="flywheel-hf-") as tmp:
        hf_dir = mlflow.artifacts.download_artifacts(
            artifact_uri=f"{source}/artifacts/hf", dst_path=tmp, tracking_uri=tracking_uri
        )
        files = {f.name: f.read_bytes() for f in Path(hf_dir).iterdir() if f.is_file()}
    got = files_sha256(files)
    if got != sha:
        raise HFFilesError(f"{source}/artifacts/hf: files hash to {got}, the config says {sha}")
    materialize(files, cache_root)


def ref_source(source: str, tracking_uri: str) -> str:
    """The model source whose `artifacts/hf/` holds the files of the version at `source`: its own,
    or the one its `artifacts/hf_ref.json` names (`HF_REF`)."""
    import json

    import mlflow

    names = {
        Path(f.path).name
        for f in mlflow.artifacts.list_artifacts(
            artifact_uri=f"{source}/artifacts", tracking_uri=tracking_uri
        )
    }
    if HF_REF not in names:
        return source
    with tempfile.TemporaryDirectory(prefix="flywheel-hf-ref-") as tmp:
        path = mlflow.artifacts.download_artifacts(
            artifact_uri=f"{source}/artifacts/{HF_REF}", dst_path=tmp, tracking_uri=tracking_uri
        )
        return str(json.loads(Path(path).read_text())["source"])
