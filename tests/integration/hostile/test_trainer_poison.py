"""Poison rollouts on the trainer's topic: refused, counted, dead-lettered; the trainer keeps training.

Real broker and real MLflow server (tests/integration/trainer/conftest.py's `trainer_env`), a
real (tiny) policy in this process. Among 12 good rollouts sampled from the policy, the
rollouts topic gets one record of each kind the model cannot train on: out-of-vocabulary
token ids, a sequence longer than the context, routes of the wrong shape, a foreign tokenizer,
a NaN log-prob (raw JSON), bytes that are not JSON and a tombstone. One more record is valid
but makes the forward raise (the policy's `logprobs` is wrapped to raise on a marker prompt:
a fault injected in this test, standing in for a bug no validation foresaw).

Checked: the trainer never raises and ships a version whose lineage is exactly the 12 good
ones (`rollouts_skipped`: 7 invalid, 1 failed), every bad record is on `<ns>.dlq` with its
reason and its original bytes, and `flywheel_trainer_rollouts_refused_total{reason}` counted
each one. A second test runs the role itself (`python -m trainer.launch`) on the same bad
records: the process is still running after them, commits past them, serves the counts on
its Prometheus endpoint and stops cleanly.

Run: .venv/bin/pytest tests/integration/hostile/test_trainer_poison.py -q
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from app.contracts.events import encode_routes
from app.infra.kafka import dumps
from policy import build_policy
from tests.conftest import free_port
from tests.integration.trainer.conftest import (
    TINY_POLICY,
    TrainerProcess,
    drain,
    produce_closers,
    produce_raw,
    read_dlq,
    refused_count,
    rollout_records,
    trainer_env,  # noqa: F401 (a fixture)
    trainer_env_vars,
    wait_all_committed,
)
from trainer.config import TrainerConfig
from trainer.loop import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

FAULT_MARK = "#STEP-FAULT#"


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def poison_records(good: list[dict], mark: list[int]) -> list[tuple[str, str | None, bytes | None]]:
    """(expected reason, key, value) of the bad records, built from a good one."""
    g = good[0]
    n = len(g["completion_tokens"])
    oov = dict(g, request_id="bad-oov", completion_tokens=[300] + g["completion_tokens"][1:])
    long = dict(g, request_id="bad-long", prompt_tokens=[65] * 70)
    routes, shape = encode_routes(np.zeros((n, 2, 1), dtype=np.int32))  # the tiny model has 1 layer
    route = dict(g, request_id="bad-route", routes=routes, route_shape=list(shape))
    foreign = dict(g, request_id="bad-tokenizer", tokenizer="gpt2")
    nan_lp = json.dumps(
        dict(g, request_id="bad-nan", logprobs=[float("nan")] + g["logprobs"][1:])
    ).encode()
    step = dict(g, request_id="bad-step", prompt_tokens=mark + g["prompt_tokens"])
    return [
        ("token_out_of_vocab", "bad-oov", dumps(oov)),
        ("sequence_too_long", "bad-long", dumps(long)),
        ("route_mismatch", "bad-route", dumps(route)),
        ("tokenizer_mismatch", "bad-tokenizer", dumps(foreign)),
        ("invalid_logprobs", "bad-nan", nan_lp),
        ("invalid_json", "bad-bytes", b"\x00\xff{not json"),
        ("invalid_json", "bad-tombstone", None),
        ("step_failed", "bad-step", dumps(step)),
    ]


def test_poison_rollouts_are_dead_lettered_and_the_trainer_ships_only_the_good_ones(
    trainer_env, tmp_path
):
    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**cfg_kw))
    client = MlflowClient(settings.mlflow_uri)
    try:
        mark = trainer.policy.tokenizer.encode(FAULT_MARK)
        real_logprobs = trainer.policy.logprobs

        def faulty_logprobs(prompts, completions, routes=None, temperature=1.0):
            if any(_contains(list(p), mark) for p in prompts):
                raise RuntimeError("injected fault: the forward cannot take this rollout")
            return real_logprobs(prompts, completions, routes, temperature)

        trainer.policy.logprobs = faulty_logprobs  # instance attribute: only this trainer's policy
        good = rollout_records(
            trainer.policy, 1, 12, lambda text: 1.0 if "\n" in text else 0.0, seed=5, prefix="good-"
        )
        for r in good:
            r["tokenizer"], r["temperature"] = "byte-v1", 1.0
        bad = poison_records(good, mark)
        before = {reason: refused_count(reason) for reason, _, _ in bad}
        records = (
            [(r["request_id"], dumps(r)) for r in good[:4]]
            + [(k, v) for _, k, v in bad[:4]]
            + [(r["request_id"], dumps(r)) for r in good[4:8]]
            + [(k, v) for _, k, v in bad[4:]]
            + [(r["request_id"], dumps(r)) for r in good[8:]]
        )
        produce_raw(settings, records)

        drain(trainer, expected=len(records))  # raises if a step raised
        assert trainer.pending.rollouts == 12 and trainer.step >= 3
        assert trainer.pending.skipped == {"duplicate": 0, "stale": 0, "invalid": 7, "failed": 1}
        version = trainer.maybe_ship(force=True)
        assert version == 2

        mv = client.get_model_version(settings.model_name, "2")
        assert mv.tags["rollouts_consumed"] == "12"
        assert json.loads(mv.tags["rollouts_skipped"]) == {
            "duplicate": 0,
            "failed": 1,
            "invalid": 7,
            "stale": 0,
        }
        ids = json.loads(
            Path(
                client.download_artifacts(
                    mv.run_id, f"ships/{mv.tags['ship_id']}/lineage/request_ids.json", str(tmp_path)
                )
            ).read_text()
        )
        assert sorted(ids) == sorted(r["request_id"] for r in good)

        letters = read_dlq(settings, expect=len(bad))
        by_key = {base64.b64decode(d["key_b64"]).decode(): d for d in letters}
        assert len(letters) == len(bad), [(d["reason"], d["key_b64"]) for d in letters]
        for reason, key, value in bad:
            d = by_key[key]
            assert d["reason"] == reason, (key, d)
            assert d["value"] == value, f"{key}: the dead letter holds the original bytes"
            assert d["errors"][0]["message"], d
        assert "injected fault" in by_key["bad-step"]["errors"][0]["exception"]
        assert "300" in by_key["bad-oov"]["errors"][0]["message"]
        after = {reason: refused_count(reason) for reason, _, _ in bad}
        expected = {}
        for reason, _, _ in bad:
            expected[reason] = expected.get(reason, 0) + 1
        assert {r: after[r] - before[r] for r in after} == expected
    finally:
        trainer.close()


def test_the_trainer_process_keeps_running_and_exports_the_refusals(trainer_env, tmp_path):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    settings, cfg = trainer_env
    cfg.update(metrics_port=free_port(), max_wait_s=1.0)
    policy = build_policy(TINY_POLICY)  # the subprocess's base version v1 (no pretraining, seed 0)
    good = rollout_records(
        policy, 1, 4, lambda text: 1.0 if "(" in text else 0.0, seed=9, prefix="fine-"
    )
    bad = [
        b
        for b in poison_records(good, policy.tokenizer.encode(FAULT_MARK))
        if b[0] != "step_failed"
    ]
    produce_raw(settings, [(k, v) for _, k, v in bad] + [(r["request_id"], dumps(r)) for r in good])
    # a trained tail behind the bad records, whatever partition they landed on
    closers = rollout_records(policy, 1, settings.rollouts_partitions, lambda t: 0.5, seed=4)
    produce_closers(settings, closers)

    log = tmp_path / "trainer.log"
    env = trainer_env_vars(settings.model_copy(update={"ship_interval": 2}), cfg)
    p = TrainerProcess(env, log)
    try:
        wait_all_committed(
            settings, cfg, p.proc, log, 300, "offsets committed past the bad records"
        )
        assert p.proc.poll() is None, "the trainer role is still running"
        text = httpx.get(f"http://127.0.0.1:{cfg['metrics_port']}/metrics", timeout=10).text
        refused = {
            s.labels["reason"]: s.value
            for fam in text_string_to_metric_families(text)
            if fam.name == "flywheel_trainer_rollouts_refused"
            for s in fam.samples
            if s.name.endswith("_total")
        }
        expected = {}
        for reason, _, _ in bad:
            expected[reason] = expected.get(reason, 0) + 1
        assert {r: v for r, v in refused.items() if v} == expected, refused
        assert refused["step_failed"] == 0 and refused["invalid_reward"] == 0, (
            "every reason is exported, at 0"
        )
    finally:
        rc = p.terminate()
    assert rc == 0, log.read_text()[-3000:]
    letters = read_dlq(settings, expect=len(bad))
    assert sorted(
        (base64.b64decode(d["key_b64"]).decode(), d["reason"]) for d in letters
    ) == sorted((k, r) for r, k, _ in bad)
    client = MlflowClient(settings.mlflow_uri)
    trained = []
    for mv in client.search_model_versions(f"name='{settings.model_name}'"):
        trained += json.loads(
            Path(
                client.download_artifacts(
                    mv.run_id, f"ships/{mv.tags['ship_id']}/lineage/request_ids.json", str(tmp_path)
                )
            ).read_text()
        )
    assert sorted(trained) == sorted(r["request_id"] for r in good + closers)
