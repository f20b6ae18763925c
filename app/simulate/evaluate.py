"""Held-out acceptance per registered version: is the loop actually learning what users want?

For every version of the registered model, load its serving weights from MLflow, sample
completions for held-out prompts (a prompt pool the training population never sees) with a
fixed seed, and average the acceptance probability of held-out simulated users (new draws
from the same population). The result goes to MLflow as `heldout_acceptance` with the
version number as the step, so the MLflow UI plots acceptance per version, and onto the
version itself as the tag `heldout_acceptance`.

    from app.simulate.evaluate import HeldOutEvaluator
    HeldOutEvaluator(mlflow_uri, "flywheel-policy").evaluate_new()  # -> {version: acceptance}
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from app.simulate.prompts import prompts
from app.simulate.users import expected_acceptance, population

log = logging.getLogger(__name__)

EXPERIMENT = "flywheel-heldout"
RUN_NAME = "heldout-acceptance"
METRIC = "heldout_acceptance"


class HeldOutEvaluator:
    def __init__(self, mlflow_uri: str, model_name: str, n_prompts: int = 48, samples_per_prompt: int = 2,
                 max_tokens: int = 48, n_users: int = 32, seed: int = 10_001):
        from mlflow import MlflowClient

        self.uri, self.model_name = mlflow_uri, model_name
        self.client = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
        self.prompts = prompts(n_prompts, seed=seed, held_out=True)
        self.users = population(n_users, seed=seed, prefix="heldout")
        self.samples_per_prompt, self.max_tokens, self.seed = samples_per_prompt, max_tokens, seed
        self.results: dict[int, float] = {}

    def _load_policy(self, version: int) -> Any:
        import mlflow
        from safetensors.torch import load_file

        from trainer.policy import build_policy

        mv = self.client.get_model_version(self.model_name, str(version))
        with tempfile.TemporaryDirectory(prefix="flywheel-eval-") as tmp:
            cfg = mlflow.artifacts.download_artifacts(artifact_uri=f"{mv.source}/artifacts/config.json", dst_path=tmp,
                                                      tracking_uri=self.uri)
            weights = mlflow.artifacts.download_artifacts(artifact_uri=f"{mv.source}/artifacts/weights.safetensors",
                                                          dst_path=tmp, tracking_uri=self.uri)
            policy = build_policy(json.loads(Path(cfg).read_text()))
            policy.load_serving_state_dict(load_file(weights))
        return policy.eval()

    def completions(self, policy: Any) -> list[str]:
        import torch

        tok = policy.tokenizer
        batch = [tok.encode(p) for p in self.prompts for _ in range(self.samples_per_prompt)]
        with torch.no_grad():
            samples = policy.generate(batch, max_tokens=self.max_tokens, temperature=1.0, seed=self.seed)
        return [s.text for s in samples]

    def acceptance(self, policy: Any) -> float:
        return expected_acceptance(self.users, self.completions(policy))

    def _run_id(self) -> str:
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(EXPERIMENT)
        runs = self.client.search_runs([exp_id], filter_string=f"tags.mlflow.runName = '{RUN_NAME}'", max_results=1)
        if runs:
            return runs[0].info.run_id
        return self.client.create_run(exp_id, run_name=RUN_NAME, tags={"model": self.model_name}).info.run_id

    def evaluate_new(self) -> dict[int, float]:
        """Evaluate every version not evaluated yet (by this evaluator or a tag); returns all results."""
        versions = sorted(int(mv.version) for mv in self.client.search_model_versions(f"name='{self.model_name}'"))
        run_id = None
        for v in versions:
            if v in self.results:
                continue
            mv = self.client.get_model_version(self.model_name, str(v))
            if METRIC in (mv.tags or {}):
                self.results[v] = float(mv.tags[METRIC])
                continue
            acc = self.acceptance(self._load_policy(v))
            self.results[v] = acc
            run_id = run_id or self._run_id()
            self.client.log_metric(run_id, METRIC, acc, step=v)
            self.client.set_model_version_tag(self.model_name, str(v), METRIC, f"{acc:.4f}")
            log.info("version %s: held-out acceptance %.3f", v, acc)
        return dict(sorted(self.results.items()))
