"""Relabelled rollouts through the real trainer: trained as new data once, counted per spec in the lineage.

Real broker and MLflow server, a tiny real policy (tests/integration/trainer/conftest.py). The
live v1 rollouts and their relabelled v2 copies (what `flywheel streams relabel` writes: same
request_id, key '<request_id>|v2', `relabel_run` set, another reward) go to `<ns>.rollouts`
with a repeated v2; the shipped version's tags and its `version_registered` event carry the
counts per spec, and the event lists the repeat's offset as skipped.
Run: .venv/bin/pytest tests/integration/trainer/test_relabelled_lineage.py -q
"""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from app.infra.kafka import dumps
from tests.integration.trainer.conftest import (
    drain,
    produce,
    produce_raw,
    registered_event,
    rollout_records,
)
from trainer.config import TrainerConfig
from trainer.loop import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_relabelled_rollouts_are_trained_once_and_counted_per_spec_in_the_lineage(trainer_env):
    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**cfg_kw))
    try:
        live = rollout_records(trainer.policy, 1, 8, lambda text: 0.75 if len(text) < 6 else -0.25)
        relabelled = [
            dict(r, reward_spec="v2", reward=-r["reward"], relabel_run="run-test") for r in live
        ]
        produce(settings, live)
        *_, (dup_part, dup_offset) = produce_raw(
            settings, [(f"{r['request_id']}|v2", dumps(r)) for r in relabelled + relabelled[:1]]
        )
        drain(trainer, 17)
        assert trainer.pending.rollouts == 16 and trainer.pending.skipped["duplicate"] == 1, (
            trainer.pending
        )
        assert sorted(trainer.pending.request_ids) == sorted([r["request_id"] for r in live] * 2)
        version = trainer.maybe_ship(force=True)
        tags = (
            MlflowClient(settings.mlflow_uri)
            .get_model_version(settings.model_name, str(version))
            .tags
        )
        assert (
            json.loads(tags["reward_specs"]) == {"v1": 8, "v2": 8}
            and tags["rollouts_relabelled"] == "8"
        )
        assert tags["reward_spec"] == "v1,v2" and tags["rollouts_consumed"] == "16"
        details = registered_event(settings, str(version))["details"]
        assert (
            details["reward_specs"],
            details["rollouts_relabelled"],
            details["reward_spec"],
        ) == ({"v1": 8, "v2": 8}, 8, "v1,v2")
        # the repeated relabelled copy is the one offset of its ranges the version did not train on
        assert details["skipped_offsets"] == {str(dup_part): [dup_offset]}
    finally:
        trainer.close()
