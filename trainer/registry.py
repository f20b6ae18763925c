"""MLflow registration of trainer versions: pyfunc model, lineage tags, aliases, reconciliation.

A shipped version is one MLflow model version of `settings.model_name` whose source is a
pyfunc model directory logged under the trainer's run (`ships/<ship_id>/model`):

    model/MLmodel, python_model.pkl, code/{trainer,kernels}/   (mlflow.pyfunc format)
    model/artifacts/weights.safetensors   bf16 serving weights (Policy.serving_state_dict)
    model/artifacts/config.json           Policy.config_dict() -> policy.build_policy
    model/artifacts/tokenizer.json        tokenizer name / vocab_size / eos_id
    model/artifacts/hf/                   HF policies only: config.json, generation_config.json and
                                          the tokenizer files (policy/hf_files.py); the
                                          policy config records their `files_sha256`
    model/artifacts/hf_ref.json           instead of hf/ when the files carry weights (a LoRA
                                          base) that the parent version already stores: the
                                          source of the version holding them

plus, next to it, `ships/<ship_id>/lineage/request_ids.json` (the rollouts trained on since the
parent) and `ships/<ship_id>/delta/` (app/contracts/artifacts.py output, when that module exists).

All artifacts are uploaded BEFORE `create_model_version`, and every tag is passed in that one
call, so a version never exists in the registry without its artifacts and tags. The
`ship_id` tag lets a restarted trainer find out whether its last ship got registered
(docs/TRAINER.md, "Crash safety").

    from trainer.registry import Registry
    reg = Registry("http://127.0.0.1:5000", "flywheel-policy")
    mlflow.pyfunc.load_model("models:/flywheel-policy@champion").predict(["def add(a, b):\\n"])
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from app.contracts.aliases import read_snapshot

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
CHAMPION = "champion"
CANDIDATE = "candidate"  # the version in its canary (app/contracts/aliases.py)
GATE_STATUS = "flywheel.gate.status"  # the gate's verdict on a version: passed / failed
TAG_SHIP_ID = "ship_id"


class PolicyPyfunc(mlflow.pyfunc.PythonModel):
    """Generates text with a registered policy: predict(["prompt", ...]) -> ["completion", ...].

    Input: a str, a list of str, a dict {"prompt": str | [str]} or a DataFrame with a `prompt`
    column. Params: max_tokens (default 64, at most half the context), temperature (default 1.0),
    seed (default -1 = random). Prompts longer than the context keep their end.
    """

    def load_context(self, context):
        from safetensors.torch import load_file

        from policy import build_policy

        cfg = json.loads(Path(context.artifacts["config"]).read_text())
        if cfg.get("type") == "hf" and "hf" in context.artifacts:
            cfg["model_dir"] = context.artifacts["hf"]  # verified against files_sha256 on build
        elif cfg.get("type") == "hf" and "hf_ref" in context.artifacts:
            from policy.hf_files import ensure_from_artifacts

            ref = json.loads(Path(context.artifacts["hf_ref"]).read_text())
            # the files are stored with an earlier version: into the local cache, verified
            ensure_from_artifacts(cfg, ref["source"], mlflow.get_tracking_uri())
        self.policy = build_policy(cfg)
        self.policy.load_serving_state_dict(load_file(context.artifacts["weights"]))
        self.policy.eval()

    def predict(self, context, model_input, params=None):
        import torch

        params = params or {}
        if hasattr(model_input, "columns"):  # pandas DataFrame
            col = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
            prompts = [str(p) for p in model_input[col].tolist()]
        elif isinstance(model_input, dict):
            p = model_input["prompt"]
            prompts = [p] if isinstance(p, str) else list(p)
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = [str(p) for p in model_input]
        tok = self.policy.tokenizer
        max_tokens = int(params.get("max_tokens", 64))
        seed = int(params.get("seed", -1))
        ctx = self.policy.config_dict().get("max_context")
        encoded = [tok.encode(p) for p in prompts]
        if ctx is not None:  # keep the end of long prompts, like an editor's context window
            max_tokens = max(1, min(max_tokens, ctx // 2))
            encoded = [e[-(ctx - 1 - max_tokens) :] for e in encoded]
        with torch.no_grad():
            samples = self.policy.generate(
                encoded,
                max_tokens=max_tokens,
                temperature=float(params.get("temperature", 1.0)),
                seed=None if seed < 0 else seed,
            )
        return [s.text or tok.decode([t for t in s.tokens if t != tok.eos_id]) for s in samples]


class Registry:
    """The trainer's view of the MLflow registry (one registered model, one experiment)."""

    def __init__(self, uri: str, model_name: str, experiment: str = "flywheel-trainer"):
        self.uri, self.name, self.experiment = uri, model_name, experiment
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)

    # --- model and versions ----------------------------------------------------------------------
    def ensure_model(self) -> None:
        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            try:
                self.client.create_registered_model(
                    self.name, description="Flywheel policy, shipped by `flywheel trainer`."
                )
            except MlflowException:
                self.client.get_registered_model(self.name)  # created concurrently: fine

    def versions(self) -> list[Any]:
        """All versions of the model, oldest first."""
        found = self.client.search_model_versions(f"name='{self.name}'")
        return sorted(found, key=lambda mv: int(mv.version))

    def find_ship(self, ship_id: str) -> Any | None:
        """The version created by ship `ship_id`, or None."""
        for mv in self.versions():
            if mv.tags.get(TAG_SHIP_ID) == ship_id:
                return mv
        return None

    def alias_version(self, alias: str) -> int | None:
        try:
            return int(self.client.get_model_version_by_alias(self.name, alias).version)
        except MlflowException:
            return None

    def standing(self, version: int) -> tuple[int | None, int | None, dict[str, str]]:
        """(champion, candidate, `version`'s tags): where a version stands in its rollout."""
        aliases = read_snapshot(self.client, self.name).aliases
        mv = self.client.get_model_version(self.name, str(version))

        def as_int(alias: str) -> int | None:
            return int(aliases[alias]) if aliases.get(alias) is not None else None

        return as_int(CHAMPION), as_int(CANDIDATE), dict(mv.tags or {})

    def set_alias(self, alias: str, version: int) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def delete_version(self, version: int) -> None:
        self.client.delete_model_version(self.name, str(version))

    # --- runs and metrics --------------------------------------------------------------------------
    def start_run(self, run_id: str | None = None) -> str:
        """Reuse `run_id` when it still exists (curves continue across restarts), else a new run."""
        if run_id:
            try:
                run = self.client.get_run(run_id)
                if run.info.lifecycle_stage == "active":
                    if run.info.status != "RUNNING":
                        self.client.update_run(run_id, status="RUNNING")
                    return run_id
            except MlflowException:
                log.warning("MLflow run %s is gone; starting a new one", run_id)
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.experiment)
        run = self.client.create_run(
            exp_id,
            tags={
                "mlflow.runName": f"trainer-{time.strftime('%Y%m%d-%H%M%S')}",
                "model_name": self.name,
            },
        )
        return run.info.run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(
            run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()]
        )

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    # --- shipping ------------------------------------------------------------------------------------
    def upload_ship(
        self,
        run_id: str,
        ship_id: str,
        serving_state: dict[str, Any],
        policy_config: dict[str, Any],
        tokenizer: dict[str, Any],
        request_ids: list[str],
        extra_dirs: dict[str, Path] | None = None,
        parent_version: int | None = None,
    ) -> str:
        """Log the pyfunc model (+ lineage, + extra dirs) under the run; returns the model source URI.

        An HF model-file set that carries weights (a LoRA policy's base) and that `parent_version`
        already stores is not logged again: `artifacts/hf_ref.json` names the version source that
        holds it (policy/hf_files.py `HF_REF`)."""
        from safetensors.torch import save_file

        prefix = f"ships/{ship_id}"
        with tempfile.TemporaryDirectory(prefix="flywheel-ship-") as tmp:
            tmp_path = Path(tmp)
            files = tmp_path / "files"
            files.mkdir()
            weights = files / "weights.safetensors"
            save_file(
                {k: v.contiguous() for k, v in serving_state.items()},
                str(weights),
                metadata={"ship_id": ship_id, "format": "flywheel-serving-bf16"},
            )
            artifacts = {
                "weights": str(weights),
                "config": str(files / "config.json"),
                "tokenizer": str(files / "tokenizer.json"),
            }
            if policy_config.get("type") == "hf":
                policy_config = _pack_hf_files(policy_config, tmp_path / "hf")
                holder = self._hf_files_holder(policy_config, tmp_path / "hf", parent_version)
                if holder is None:
                    artifacts["hf"] = str(tmp_path / "hf")
                else:
                    from policy.hf_files import HF_REF

                    ref = files / HF_REF
                    ref.write_text(
                        json.dumps(
                            {"files_sha256": policy_config["files_sha256"], "source": holder}
                        )
                    )
                    artifacts["hf_ref"] = str(ref)
            (files / "config.json").write_text(json.dumps(policy_config, indent=1, sort_keys=True))
            (files / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1, sort_keys=True))
            code = [
                str(REPO / pkg)
                for pkg in ("trainer", "policy", "kernels")
                if (REPO / pkg / "__init__.py").exists()
            ]
            mlflow.pyfunc.save_model(
                path=str(tmp_path / "model"),
                python_model=PolicyPyfunc(),
                code_paths=code,
                artifacts=artifacts,
                pip_requirements=_pip_requirements(),
                signature=_signature(),
            )
            self.client.log_artifacts(run_id, str(tmp_path / "model"), f"{prefix}/model")
            lineage = tmp_path / "lineage"
            lineage.mkdir()
            (lineage / "request_ids.json").write_text(json.dumps(request_ids))
            self.client.log_artifacts(run_id, str(lineage), f"{prefix}/lineage")
            for name, path in (extra_dirs or {}).items():
                self.client.log_artifacts(run_id, str(path), f"{prefix}/{name}")
        run = self.client.get_run(run_id)
        return f"{run.info.artifact_uri}/{prefix}/model"

    def create_version(
        self, source: str, run_id: str, ship_id: str, tags: dict[str, str], timeout_s: float = 120.0
    ) -> int:
        """One `create_model_version` call with every tag; waits until the registry says READY."""
        self.ensure_model()
        mv = self.client.create_model_version(
            self.name,
            source,
            run_id=run_id,
            tags={**tags, TAG_SHIP_ID: ship_id},
            description=f"shipped by flywheel trainer (ship {ship_id})",
        )
        deadline = time.monotonic() + timeout_s
        while mv.status != "READY":
            assert mv.status != "FAILED_REGISTRATION", (
                f"version {mv.version} failed registration: {mv.status_message}"
            )
            assert time.monotonic() < deadline, (
                f"version {mv.version} not READY after {timeout_s}s ({mv.status})"
            )
            time.sleep(0.2)
            mv = self.client.get_model_version(self.name, mv.version)
        return int(mv.version)

    def set_tag(self, version: int, key: str, value: str) -> None:
        self.client.set_model_version_tag(self.name, str(version), key, value)

    # --- reading weights back ----------------------------------------------------------------------
    def download_serving_state(self, version: int) -> dict[str, Any]:
        """The bf16 serving weights of `version` (e.g. the champion for the KL reference)."""
        from safetensors.torch import load_file

        mv = self.client.get_model_version(self.name, str(version))
        with tempfile.TemporaryDirectory(prefix="flywheel-dl-") as tmp:
            path = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{mv.source}/artifacts/weights.safetensors",
                dst_path=tmp,
                tracking_uri=self.uri,
            )
            return load_file(path)

    def _hf_files_holder(
        self, policy_config: dict[str, Any], packed: Path, parent_version: int | None
    ) -> str | None:
        """The model source that already stores these HF files, when they carry weights and the
        parent version's config has the same `files_sha256`; else None (log them)."""
        from policy.hf_files import WEIGHTS_FILE, ref_source

        if parent_version is None or not (packed / WEIGHTS_FILE).is_file():
            return None
        source = self.client.get_model_version(self.name, str(parent_version)).source
        with tempfile.TemporaryDirectory(prefix="flywheel-dl-") as tmp:
            path = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{source}/artifacts/config.json", dst_path=tmp, tracking_uri=self.uri
            )
            parent = json.loads(Path(path).read_text())
        if parent.get("files_sha256") != policy_config.get("files_sha256"):
            return None
        return ref_source(source, self.uri)

    def policy_config(self, version: int, cache_root: str | Path | None = None) -> dict[str, Any]:
        """`version`'s policy config, ready for `build_policy` on this machine: an HF policy's model
        files are downloaded into `<cache_root>/<files_sha256>/` (policy/hf_files.py),
        verified by hash, unless that directory is already there."""
        from policy.hf_files import ensure_from_artifacts

        mv = self.client.get_model_version(self.name, str(version))
        with tempfile.TemporaryDirectory(prefix="flywheel-dl-") as tmp:
            path = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{mv.source}/artifacts/config.json",
                dst_path=tmp,
                tracking_uri=self.uri,
            )
            cfg = json.loads(Path(path).read_text())
        ensure_from_artifacts(cfg, mv.source, self.uri, cache_root)
        return cfg


def _pack_hf_files(policy_config: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write an HF policy's model files (policy/hf_files.py) into `out`; returns the config
    to register: self-contained (`files_sha256`, no machine-local `model_dir`)."""
    from policy.hf_files import pack, resolve

    weights = bool(policy_config.get("lora"))  # a LoRA policy's base weights are model files
    src = resolve(
        policy_config.get("model_dir"), policy_config.get("files_sha256"), weights=weights
    )
    files, sha = pack(src, weights=weights)
    out.mkdir()
    for name, data in files.items():
        (out / name).write_bytes(data)
    return {**policy_config, "model_dir": None, "files_sha256": sha}


def _signature():
    from mlflow.models import infer_signature

    return infer_signature(
        model_input=["def add(a, b):"],
        model_output=["    return a + b"],
        params={"max_tokens": 64, "temperature": 1.0, "seed": -1},
    )


def _pip_requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{pkg}=={version(pkg)}" for pkg in ("torch", "safetensors", "numpy", "mlflow")]
