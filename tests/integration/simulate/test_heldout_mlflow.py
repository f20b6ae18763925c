"""The held-out evaluator on the real MLflow server: a registered version gets every figure as a
version tag and as an MLflow metric (step = version), and a second evaluator reads them back."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_heldout_figures_become_tags_and_metrics(mlflow_server, tmp_path: Path):
    from mlflow import MlflowClient
    from safetensors.torch import save_file

    from app.simulate.evaluate import EXPERIMENT, METRICS, RUN_NAME, HeldOutEvaluator
    from policy import build_policy

    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    model = f"heldout-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(model)
    run = client.create_run(client.create_experiment(f"exp-{model}"))
    policy = build_policy(
        {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "n_experts": 2, "top_k": 1}
    )
    files = tmp_path / "artifacts"
    files.mkdir()
    save_file(
        {k: v.contiguous() for k, v in policy.serving_state_dict().items()},
        str(files / "weights.safetensors"),
    )
    (files / "config.json").write_text(json.dumps(policy.config_dict()))
    client.log_artifacts(run.info.run_id, str(files), "model/artifacts")
    client.set_terminated(run.info.run_id)
    mv = client.create_model_version(
        model, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    )

    ev = HeldOutEvaluator(
        mlflow_server.uri,
        model,
        n_prompts=6,
        samples_per_prompt=2,
        max_tokens=8,
        n_users=4,
        hard_fraction=0.3,
    )
    assert any(ev.hard) and not all(ev.hard), ev.hard
    results = ev.evaluate_new()
    figures = ev.details[int(mv.version)]
    assert results == {int(mv.version): figures["heldout_acceptance"]} and tuple(figures) == METRICS
    assert (
        figures["heldout_acceptance_ci_low"]
        <= figures["heldout_acceptance"]
        <= figures["heldout_acceptance_ci_high"]
    )
    tags = client.get_model_version(model, mv.version).tags
    assert {m: float(tags[m]) for m in METRICS} == pytest.approx(figures, abs=1e-4)
    exp = client.get_experiment_by_name(EXPERIMENT)
    # the server is shared with other tests' models: each model has its own held-out run
    [hrun] = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.mlflow.runName = '{RUN_NAME}' and tags.model = '{model}'",
    )
    for m in METRICS:
        [point] = [
            p for p in client.get_metric_history(hrun.info.run_id, m) if p.step == int(mv.version)
        ]
        assert point.value == pytest.approx(figures[m])

    again = HeldOutEvaluator(
        mlflow_server.uri, model, n_prompts=6, samples_per_prompt=2, max_tokens=8, n_users=4
    )
    assert again.evaluate_new() == pytest.approx(results, abs=1e-4)
    assert again.details[int(mv.version)] == pytest.approx(figures, abs=1e-4), (
        "read back from the tags, not re-run"
    )
