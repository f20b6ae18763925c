"""SIGKILL the trainer during training and at both edges of a ship; restart; nothing lost or doubled.

A real trainer subprocess (`python -m trainer.launch`) on the real broker and MLflow server.
The test hook FLYWHEEL_TRAINER_PAUSE_AT stops the process at a precise point and writes
`<state_dir>/paused-at`; the test then SIGKILLs it (a real kill -9, nothing flushed):

1. after optimizer step 3 (state saved at step 2: step 3's work must be redone, not doubled);
2. before_register: artifacts uploaded, no version yet;
3. after_register: version created, offsets NOT yet committed (checked);
4. a clean run finishes the pending ship, trains the rest, ships, and is stopped with SIGTERM.

A second test does the same to multi-turn records (sessions assembled by the session ledger)
beside one-call ones, killed after an optimizer step: each trajectory is trained exactly once, and
the versions' `sessions_trained` and `turns_trained` add up to the sessions and calls produced.

A third test gives the trainer a rollout its forward raises on (a fault injected by the test
launcher tests/integration/trainer/fault_trainer.py) and out-of-vocabulary garbage: the
trainer keeps running, dead-letters them, is SIGKILLed right after and restarted; no version
counts as trained a rollout no optimizer step consumed.

Checked at the end: every record of the topic is accounted for exactly once — the lineage
artifacts (request ids) of all versions are exactly the produced rollouts with no repeats,
`rollouts_consumed` sums to their number, skipped counts match the duplicates and the invalid
record, the offset ranges tile [0, end) per partition, the committed offsets equal the ends —
and every visible version is READY with its tags and loadable weights, one per ship_id.

Run: .venv/bin/pytest tests/integration/trainer/test_crash.py -q
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from mlflow import MlflowClient

from app.infra.kafka import dumps
from policy import build_policy
from tests.integration.trainer.conftest import (
    TINY_POLICY,
    TrainerProcess,
    check_lineage,
    committed_offsets,
    listed_skipped_offsets,
    model_versions,
    produce,
    produce_closers,
    produce_raw,
    read_dlq,
    rollout_records,
    session_records,
    trainer_env_vars,
    wait_all_committed,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _starter(settings, cfg: dict, log: Path, marker: Path):
    """`start(ship_interval, pause_at)`: a trainer process with that ship interval, paused at
    `pause_at` (FLYWHEEL_TRAINER_PAUSE_AT, which writes `marker`; a stale marker is removed)."""

    def start(ship_interval: float, pause_at: str | None) -> TrainerProcess:
        marker.unlink(missing_ok=True)
        env = trainer_env_vars(settings.model_copy(update={"ship_interval": ship_interval}), cfg)
        if pause_at:
            env["FLYWHEEL_TRAINER_PAUSE_AT"] = pause_at
        return TrainerProcess(env, log)

    return start


def test_sigkill_during_training_and_ship_loses_no_rollout_and_trains_none_twice(
    trainer_env, tmp_path
):
    """Steps 1-4 of the module docstring. Needs about two minutes: four trainer processes in a
    row (each imports torch and MLflow and joins its consumer group, about 20 s on 2 shared
    cores) and two ships through the real registry."""
    settings, cfg = trainer_env
    cfg.update(checkpoint_every=2, batch_size=4, max_wait_s=1.0)
    state_dir = Path(cfg["state_dir"])
    marker = state_dir / "paused-at"
    client = MlflowClient(settings.mlflow_uri)
    log = tmp_path / "trainer.log"

    start = _starter(settings, cfg, log, marker)

    def versions():
        return model_versions(client, settings.model_name)

    # the base policy of an empty registry is v1 (tiny config, init_seed 0, no pretraining): sample from it
    policy = build_policy(TINY_POLICY)
    records = rollout_records(policy, 1, 24, lambda text: 1.0 if "\n" in text else 0.0, seed=3)
    produce(settings, records)

    # 1. kill during training: after optimizer step 3, the last saved state is step 2
    p = start(3600, "after_optimizer_step:3")
    wait_for(marker.exists, 300, "pause after step 3", p.proc, log)
    assert "after_optimizer_step step=3" in marker.read_text()
    p.kill9()
    assert [mv.version for mv in versions()] == ["1"], "only the base version exists"

    # 2. kill during a ship, after the upload and before the version is created
    p = start(2, "before_register")
    wait_for(marker.exists, 300, "pause before_register", p.proc, log)
    p.kill9()
    assert [mv.version for mv in versions()] == ["1"], (
        "a ship killed before registering leaves no version"
    )

    # 3. kill after the version is created, before the offsets are committed
    p = start(2, "after_register")
    wait_for(marker.exists, 300, "pause after_register", p.proc, log)
    p.kill9()
    registered = versions()
    assert [mv.version for mv in registered] == ["1", "2"]
    assert set(committed_offsets(settings, cfg["consumer_group"]).values()) == {None}, (
        "offsets must not be committed before the registration is finished"
    )

    # records arriving between crashes: two re-emitted rollouts (trained before the first kill) and garbage
    untrained = produce(settings, [records[0], records[1]])
    from app.infra.kafka import make_producer

    prod = make_producer(settings)
    meta = prod.send(settings.topic("rollouts"), key="garbage", value=b'{"request_id": "x"}').get(
        30
    )
    untrained.append((meta.partition, meta.offset))
    prod.close(5)
    closers = rollout_records(policy, 1, settings.rollouts_partitions, lambda t: 0.5, seed=4)
    produce_closers(settings, closers)  # a trained tail behind the skipped records
    records += closers

    # 4. a clean run: finishes ship 2 (commit), trains the rest, ships again
    p = start(2, None)
    ends = wait_all_committed(settings, cfg, p.proc, log)
    assert p.terminate() == 0, log.read_text()[-3000:]

    final = versions()
    assert len(final) >= 3, [mv.version for mv in final]
    assert final[1].tags["ship_id"] == registered[1].tags["ship_id"], (
        "the crashed ship was finished, not redone"
    )
    skipped = check_lineage(client, final, [r["request_id"] for r in records], ends, tmp_path)
    assert sum(int(mv.tags["rollouts_consumed"]) for mv in final) == 24 + len(closers)
    assert skipped["duplicate"] == 2 and skipped["invalid"] == 1 and skipped["stale"] == 0
    # the finished crashed ship and the next list exactly the three skipped records' offsets
    assert listed_skipped_offsets(settings, final) == sorted(untrained)


def test_sigkill_while_training_on_trajectories_trains_each_once(trainer_env, tmp_path):
    """8 two-call sessions (one multi-turn record each) among 8 one-call rollouts, batches of 4;
    SIGKILL after optimizer step 3 (saved at step 2), a session re-delivered, a clean restart
    ships. Two trainer processes: about 30 s."""
    settings, cfg = trainer_env
    cfg.update(checkpoint_every=2, batch_size=4, max_wait_s=1.0)
    marker = Path(cfg["state_dir"]) / "paused-at"
    client = MlflowClient(settings.mlflow_uri)
    log = tmp_path / "trainer.log"

    start = _starter(settings, cfg, log, marker)

    policy = build_policy(TINY_POLICY)  # the base v1 of the empty registry
    sessions = session_records(policy, 1, 8, seed=5)
    one_call = rollout_records(policy, 1, 8, lambda text: float("\n" in text), seed=9)
    records = [r for pair in zip(sessions, one_call) for r in pair]  # interleaved
    produce(settings, records)

    p = start(3600, "after_optimizer_step:3")
    wait_for(marker.exists, 300, "pause after step 3", p.proc, log)
    p.kill9()
    assert [mv.version for mv in model_versions(client, settings.model_name)] == ["1"]

    produce(settings, [sessions[0]])  # a trajectory trained before the kill, delivered again
    closers = rollout_records(policy, 1, settings.rollouts_partitions, lambda t: 0.5, seed=4)
    produce_closers(settings, closers)  # a trained tail behind the duplicate
    records += closers
    p = start(2, None)
    ends = wait_all_committed(settings, cfg, p.proc, log)
    assert p.terminate() == 0, log.read_text()[-3000:]

    final = model_versions(client, settings.model_name)
    skipped = check_lineage(client, final, [r["request_id"] for r in records], ends, tmp_path)
    assert skipped["duplicate"] == 1 and skipped["invalid"] == 0 and skipped["stale"] == 0
    trained = final[1:]
    assert sum(int(mv.tags["rollouts_consumed"]) for mv in trained) == 16 + len(closers)
    assert sum(int(mv.tags["sessions_trained"]) for mv in trained) == 8, "each session once"
    assert sum(int(mv.tags["turns_trained"]) for mv in trained) == 8 * 2 + 8 + len(closers)


def test_a_step_that_raises_does_not_stop_the_trainer_and_nothing_untrained_counts_after_sigkill(
    trainer_env, tmp_path
):
    """A step that raises is logged and skipped, the trainer keeps running, and after a SIGKILL
    the restarted trainer counts no rollout it did not train on. Needs about a minute: two
    trainer processes in a row, each importing torch and MLflow."""
    settings, cfg = trainer_env
    cfg.update(checkpoint_every=1, batch_size=4, max_wait_s=1.0)
    client = MlflowClient(settings.mlflow_uri)
    log = tmp_path / "trainer.log"
    env = dict(trainer_env_vars(settings, cfg), FLYWHEEL_TEST_FAULT_MARK="#STEP-FAULT#")

    def start(ship_interval: float) -> TrainerProcess:
        e = dict(env, FLYWHEEL_SHIP_INTERVAL=str(ship_interval))
        return TrainerProcess(e, log, module="tests.integration.trainer.fault_trainer")

    policy = build_policy(TINY_POLICY)
    good = rollout_records(
        policy, 1, 16, lambda text: 1.0 if "x" in text else 0.0, seed=7, prefix="ok-"
    )
    culprit = dict(
        good[0],
        request_id="culprit",
        prompt_tokens=policy.tokenizer.encode("#STEP-FAULT#") + good[0]["prompt_tokens"],
    )
    oov = dict(
        good[1], request_id="oov", completion_tokens=[999] + good[1]["completion_tokens"][1:]
    )
    produce(settings, good[:3] + [culprit] + good[3:6])
    produce_raw(settings, [("oov", dumps(oov))])

    # 1. the culprit's step raises inside the trainer: it keeps running; SIGKILL it right after the dead letter
    p = start(3600)
    wait_for(
        lambda: any(
            d["reason"] == "step_failed" for d in read_dlq(settings, 1, timeout=2, settle=0)
        ),
        300,
        "the culprit's dead letter",
        p.proc,
        log,
    )
    wait_for(
        lambda: any(
            d["reason"] == "token_out_of_vocab" for d in read_dlq(settings, 2, timeout=2, settle=0)
        ),
        300,
        "the out-of-vocabulary dead letter",
        p.proc,
        log,
    )
    assert p.proc.poll() is None, "the trainer is still running after a step raised"
    p.kill9()

    # 2. restart (the culprit may be re-read and raise again), more rollouts, ship, SIGTERM
    produce(settings, good[6:])
    # the out-of-vocabulary record may sit at its partition's tail, re-read after the restart:
    # a trained tail behind it makes its offset committable (produce_closers)
    closers = rollout_records(policy, 1, settings.rollouts_partitions, lambda t: 0.5, seed=4)
    produce_closers(settings, closers)
    p = start(2)
    wait_all_committed(settings, cfg, p.proc, log)
    assert p.terminate() == 0, log.read_text()[-3000:]

    versions = sorted(
        client.search_model_versions(f"name='{settings.model_name}'"),
        key=lambda mv: int(mv.version),
    )
    trained: list[str] = []
    skipped: Counter = Counter()
    for mv in versions:
        ids = json.loads(
            Path(
                client.download_artifacts(
                    mv.run_id, f"ships/{mv.tags['ship_id']}/lineage/request_ids.json", str(tmp_path)
                )
            ).read_text()
        )
        assert len(ids) == int(mv.tags["rollouts_consumed"])
        trained += ids
        skipped.update(json.loads(mv.tags["rollouts_skipped"]))
    assert "culprit" not in trained and "oov" not in trained, (
        "a rollout no step consumed is counted as trained"
    )
    assert sorted(trained) == sorted(r["request_id"] for r in good + closers), (
        f"trained twice or lost: {Counter(trained)}"
    )
    assert sum(int(mv.tags["rollouts_consumed"]) for mv in versions) == 16 + len(closers)
    assert skipped["failed"] == 1 and skipped["invalid"] == 1 and skipped["duplicate"] == 0
    letters = read_dlq(settings, 2, timeout=10)
    reasons = {(d["key_b64"], d["reason"]) for d in letters}
    import base64

    assert {(base64.b64decode(k).decode(), r) for k, r in reasons} == {
        ("culprit", "step_failed"),
        ("oov", "token_out_of_vocab"),
    }
    assert all(
        "injected fault" in d["errors"][0]["exception"]
        for d in letters
        if d["reason"] == "step_failed"
    )
    # the versions' events list exactly the offsets of the two records no step trained on, once
    listed = listed_skipped_offsets(settings, versions)
    assert listed == sorted({(d["partition"], d["offset"]) for d in letters}), letters


def test_an_exception_escaping_a_step_is_not_saved_as_trained_by_the_shutdown(
    trainer_env, monkeypatch
):
    """In-process: an exception between taking a batch and accounting it (injected) reaches
    `close()`, which must not save positions and lineage that no optimizer step stands behind."""
    from tests.integration.trainer.conftest import drain
    from trainer.checkpoint import load_state
    from trainer.config import TrainerConfig
    from trainer.loop import Trainer

    settings, cfg_kw = trainer_env
    trainer = Trainer(settings, TrainerConfig(**cfg_kw))  # checkpoint_every=1: every step saved
    records = rollout_records(trainer.policy, 1, 8, lambda text: float(len(text) % 2), seed=11)
    produce(settings, records[:4])
    drain(trainer, 4)
    saved = load_state(cfg_kw["state_dir"])
    assert len(saved["pending"]["request_ids"]) == 4

    produce(settings, records[4:])

    def dies(batch):
        raise RuntimeError("injected: the process fails after taking a batch, before accounting it")

    monkeypatch.setattr(trainer, "_account", dies)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(400):
            trainer.train_step()
    trainer.close()  # what the launcher's `finally` does
    after = load_state(cfg_kw["state_dir"])
    assert after["positions"] == saved["positions"] and after["step"] == saved["step"]
    assert after["pending"]["request_ids"] == saved["pending"]["request_ids"], (
        "nothing untrained saved as trained"
    )

    again = Trainer(settings, TrainerConfig(**cfg_kw))
    try:
        drain(again, 8)
        ids = again.pending.request_ids
        assert sorted(ids) == sorted(r["request_id"] for r in records), (
            f"lost or doubled: {Counter(ids)}"
        )
    finally:
        again.close()
