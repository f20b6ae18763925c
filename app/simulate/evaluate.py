"""Held-out acceptance per registered version: is the loop actually learning what users want?

For every version of the registered model, load its serving weights from MLflow, sample
completions for held-out prompts (a prompt pool the training population never sees) with a
fixed seed, and average the acceptance probability of held-out simulated users (new draws
from the same population). The result goes to MLflow as `heldout_acceptance` with the
version number as the step, so the MLflow UI plots acceptance per version, and onto the
version itself as the tag `heldout_acceptance`.

Beside it, each under the same name as tag and metric:
- `heldout_acceptance_ci_low` / `_ci_high`: a 95% normal confidence interval of the
  acceptance on these prompts (the sampling error of the completions; `scores`);
- `heldout_satisfaction`: the users' true satisfaction (app/simulate/users.py), which no
  editor event carries: a reward hack raises the reward, not this;
- `heldout_valid_rate`, `heldout_no_edit_rate`: shares of completions whose tool call parses
  and of completions with no edit (app/edits.py, as the gate's monitors count them).
Hard requests (`FLYWHEEL_SIMULATE_HARD_FRACTION`) are judged as hard, as in the simulation.

    from app.simulate.evaluate import HeldOutEvaluator
    HeldOutEvaluator(mlflow_uri, "flywheel-policy").evaluate_new()  # -> {version: acceptance}
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from pathlib import Path
from statistics import NormalDist
from typing import Any

from app.edits import is_no_edit, is_valid
from app.simulate.prompts import is_hard, prompts
from app.simulate.users import SimulatedUser, expected_acceptance, population

log = logging.getLogger(__name__)

EXPERIMENT = "flywheel-heldout"
RUN_NAME = "heldout-acceptance"
METRIC = "heldout_acceptance"
METRICS = (
    METRIC,
    "heldout_acceptance_ci_low",
    "heldout_acceptance_ci_high",
    "heldout_satisfaction",
    "heldout_valid_rate",
    "heldout_no_edit_rate",
)


def scores(
    users: list[SimulatedUser],
    prompt_list: list[str],
    completions: list[str],
    hard: list[bool],
    level: float = 0.95,
) -> dict[str, float]:
    """The held-out figures of `completions` (samples_per_prompt >= 2 consecutive ones per prompt).

    The interval is the sampling error of the completions on these prompts: per prompt, the
    sample variance of its completions' acceptance (each averaged over the users) over k
    samples, summed: var(mean) = sum_i s_i^2 / (k P^2). The prompts are fixed (the same for
    every version), so that is the variance that separates two versions' estimates.
    """
    assert (
        prompt_list and len(hard) == len(prompt_list) and len(completions) % len(prompt_list) == 0
    ), f"{len(completions)} completions, {len(hard)} hard flags for {len(prompt_list)} prompts"
    k = len(completions) // len(prompt_list)
    assert k >= 2, f"the interval needs at least 2 samples per prompt, got {k}"
    flags = [h for h in hard for _ in range(k)]
    acc = [
        sum(u.acceptance_probability(c, h) for u in users) / len(users)
        for c, h in zip(completions, flags)
    ]
    mean = sum(acc) / len(acc)
    var = 0.0
    for i in range(len(prompt_list)):
        a = acc[i * k : (i + 1) * k]
        m = sum(a) / k
        var += sum((x - m) ** 2 for x in a) / (k - 1) / k
    half = NormalDist().inv_cdf(0.5 + level / 2) * math.sqrt(var) / len(prompt_list)
    return {
        METRIC: mean,
        "heldout_acceptance_ci_low": max(0.0, mean - half),
        "heldout_acceptance_ci_high": min(1.0, mean + half),
        "heldout_satisfaction": sum(
            u.satisfaction(c, h) for u in users for c, h in zip(completions, flags)
        )
        / (len(users) * len(completions)),
        "heldout_valid_rate": sum(map(is_valid, completions)) / len(completions),
        "heldout_no_edit_rate": sum(map(is_no_edit, completions)) / len(completions),
    }


class HeldOutEvaluator:
    # what it logs: the agent evaluator (app/simulate/agent_eval.py) reuses the plumbing with its own
    RUN_NAME, METRIC, METRICS = RUN_NAME, METRIC, METRICS

    def __init__(
        self,
        mlflow_uri: str,
        model_name: str,
        n_prompts: int = 64,
        samples_per_prompt: int = 4,
        max_tokens: int = 48,
        n_users: int = 32,
        seed: int = 10_001,
        hard_fraction: float | None = None,
    ):
        from mlflow import MlflowClient

        from app.simulate.config import SimulateConfig

        self.uri, self.model_name = mlflow_uri, model_name
        self.client = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
        self.prompts = prompts(n_prompts, seed=seed, held_out=True)
        fraction = SimulateConfig().hard_fraction if hard_fraction is None else hard_fraction
        self.hard = [is_hard(p, fraction) for p in self.prompts]
        self.users = population(n_users, seed=seed, prefix="heldout")
        self.samples_per_prompt, self.max_tokens, self.seed = samples_per_prompt, max_tokens, seed
        self.results: dict[int, float] = {}
        self.details: dict[
            int, dict[str, float]
        ] = {}  # version -> every figure of METRICS that is known

    def _load_policy(self, version: int) -> Any:
        import mlflow
        from safetensors.torch import load_file

        from policy import build_policy
        from policy.hf_files import ensure_from_artifacts

        mv = self.client.get_model_version(self.model_name, str(version))
        with tempfile.TemporaryDirectory(prefix="flywheel-eval-") as tmp:
            cfg = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{mv.source}/artifacts/config.json",
                dst_path=tmp,
                tracking_uri=self.uri,
            )
            weights = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{mv.source}/artifacts/weights.safetensors",
                dst_path=tmp,
                tracking_uri=self.uri,
            )
            config = json.loads(Path(cfg).read_text())
            ensure_from_artifacts(config, mv.source, self.uri)  # an HF version's model files
            policy = build_policy(config)
            policy.load_serving_state_dict(load_file(weights))
        return policy.eval()

    def completions(self, policy: Any) -> list[str]:
        import torch

        tok = policy.tokenizer
        batch = [tok.encode(p) for p in self.prompts for _ in range(self.samples_per_prompt)]
        with torch.no_grad():
            samples = policy.generate(
                batch, max_tokens=self.max_tokens, temperature=1.0, seed=self.seed
            )
        return [s.text for s in samples]

    def acceptance(self, policy: Any) -> float:
        flags = [h for h in self.hard for _ in range(self.samples_per_prompt)]
        return expected_acceptance(self.users, self.completions(policy), flags)

    def scores(self, policy: Any) -> dict[str, float]:
        return scores(self.users, self.prompts, self.completions(policy), self.hard)

    def _run_id(self) -> str:
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(EXPERIMENT)
        # one run per registered model: two models on one server must not share metric steps (= versions)
        runs = self.client.search_runs(
            [exp_id],
            filter_string=f"tags.mlflow.runName = '{self.RUN_NAME}' and "
            f"tags.model = '{self.model_name}'",
            max_results=1,
        )
        if runs:
            return runs[0].info.run_id
        return self.client.create_run(
            exp_id, run_name=self.RUN_NAME, tags={"model": self.model_name}
        ).info.run_id

    def evaluate_new(self) -> dict[int, float]:
        """Evaluate every version not evaluated yet (by this evaluator or a tag); returns all results."""
        versions = sorted(
            int(mv.version) for mv in self.client.search_model_versions(f"name='{self.model_name}'")
        )
        run_id = None
        for v in versions:
            if v in self.results:
                continue
            mv = self.client.get_model_version(self.model_name, str(v))
            tags = mv.tags or {}
            if self.METRIC in tags:
                self.results[v] = float(tags[self.METRIC])
                self.details[v] = {m: float(tags[m]) for m in self.METRICS if m in tags}
                continue
            figures = self.scores(self._load_policy(v))
            self.results[v], self.details[v] = figures[self.METRIC], figures
            run_id = run_id or self._run_id()
            for name, value in figures.items():
                self.client.log_metric(run_id, name, value, step=v)
            for name in self.METRICS[1:] + (self.METRIC,):  # last: its tag marks v as evaluated
                self.client.set_model_version_tag(
                    self.model_name, str(v), name, f"{figures[name]:.4f}"
                )
            log.info(
                "version %s: %s",
                v,
                ", ".join(f"{m} {figures[m]:.3f}" for m in self.METRICS),
            )
        return dict(sorted(self.results.items()))
