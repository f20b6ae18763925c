"""The trainer on torchrun: two ranks (gloo, CPU) keep every guarantee of the one-process trainer.

1. Numerics (tests/integration/trainer/ddp_worker.py, no Kafka): each rank's log-probs of logged
   generations equal their behaviour log-probs exactly; one step on 2 ranks leaves identical
   weights on both; a rank without rollouts changes nothing (bitwise equal to one process on the
   same global batch); an even 4/4 split gives the one-process gradient up to float summation
   order (the per-rank sums are added by the all-reduce instead of inside one matmul).
2. Crash safety on the real broker and MLflow server (`python -m torch.distributed.run
   --max-restarts 2 -m trainer.launch`): SIGKILL of rank 1 right after an optimizer step, of
   rank 1 while rank 0 holds a saved ship intent before registering, and of rank 0 after it
   registered a version but before any offset was committed; torchrun restarts both ranks each
   time. At the end every produced rollout was trained exactly once (the
   lineage of all versions), the offset ranges tile each partition, every offset is committed,
   the crashed ship was finished, not redone, and both ranks read partitions.

Run: .venv/bin/pytest tests/integration/trainer/test_distributed.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from app.infra.kafka import dumps
from policy import build_policy
from tests.integration.trainer.conftest import (
    REPO,
    TINY_POLICY,
    check_lineage,
    committed_offsets,
    listed_skipped_offsets,
    model_versions,
    produce,
    produce_closers,
    produce_raw,
    rollout_records,
    trainer_env_vars,
    wait_all_committed,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.ranks, pytest.mark.timeout(1200)]

# --max-restarts: every run here survives a rank's death (on a loaded machine gloo's first
# connection can fail too; a restart redoes the same deterministic work)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
TORCHRUN += ["--max-restarts=2"]
WORKER = str(REPO / "tests/integration/trainer/ddp_worker.py")


def _run(argv: list[str], log: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        rc = subprocess.run(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600
        ).returncode
    assert rc == 0, log.read_text()[-4000:]


def test_two_rank_step_is_the_one_process_step(tmp_path):
    """One optimizer step on 8 rollouts, in one process and on two gloo ranks (4 + 4, and 8 + 0:
    an idle rank), ends with the same weights. Needs about a minute on 2 shared cores: five
    worker processes, each importing torch, two of them pairs joining gloo."""
    _run(
        [sys.executable, WORKER, "--out", str(tmp_path / "one"), "--split", "8"],
        tmp_path / "one.log",
    )
    _run(
        [*TORCHRUN, WORKER, "--out", str(tmp_path / "even"), "--split", "4,4"],
        tmp_path / "even.log",
    )
    _run(
        [*TORCHRUN, WORKER, "--out", str(tmp_path / "idle"), "--split", "8,0"],
        tmp_path / "idle.log",
    )
    one = torch.load(tmp_path / "one/rank0.pt")
    for case in ("even", "idle"):
        r0, r1 = (torch.load(tmp_path / case / f"rank{r}.pt") for r in range(2))
        for r in range(2):
            info = json.loads((tmp_path / case / f"rank{r}.json").read_text())
            assert info["exact_logprobs"], f"{case} rank {r}: log-probs differ from behaviour"
        for k in one["weights"]:
            assert torch.equal(r0["weights"][k], r1["weights"][k]), f"{case}: ranks disagree on {k}"
        m0 = json.loads((tmp_path / case / "rank0.json").read_text())["metrics"]
        m1 = json.loads((tmp_path / case / "rank1.json").read_text())["metrics"]
        assert m0 == m1, "every rank logs the same combined step metrics"
        assert m0["batch_rollouts"] == 8 and m0["logprob_gap"] == 0.0
    idle = torch.load(tmp_path / "idle/rank0.pt")
    for k in one["weights"]:  # adding a zero gradient is exact
        assert torch.equal(idle["weights"][k], one["weights"][k]), f"idle rank changed {k}"
    even = torch.load(tmp_path / "even/rank0.pt")
    grad_rel = max(
        float(
            (even["grads"][k] - one["grads"][k]).abs().max()
            / one["grads"][k].abs().max().clamp(min=1e-30)
        )
        for k in one["grads"]
    )
    w_diff = max(
        float((even["weights"][k] - one["weights"][k]).abs().max()) for k in one["weights"]
    )
    print(
        f"4/4 split vs one process: max relative gradient difference {grad_rel:.2e}, max |dw| {w_diff:.2e} (lr 1e-2)"
    )
    assert grad_rel < 1e-5, (
        f"gradients differ by {grad_rel:.2e} relative (summation order alone gives ~1e-7)"
    )
    assert w_diff < 1e-4, f"weights differ by {w_diff:.2e} after one step"


class Torchrun:
    """`python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 2 -m
    trainer.launch`, or `argv` that starts torchrun (`flywheel trainer --nproc 2`)."""

    def __init__(self, env: dict[str, str], log: Path, argv: list[str] | None = None):
        self.log, self.out = log, open(log, "ab")
        self.proc = subprocess.Popen(
            argv or [*TORCHRUN, "--monitor-interval=1", "-m", "trainer.launch"],
            env=dict(env, OMP_NUM_THREADS="1"),
            cwd=REPO,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(180)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.out.close()
        return rc


def _stop(p: Torchrun, log: Path) -> None:
    """SIGTERM torchrun (it forwards it to the ranks): both ranks stop together and save
    (torchrun itself then exits non-zero with the traceback of its SignalException)."""
    before = log.read_text().count("trainer closed at step")
    p.terminate()
    text = log.read_text()
    assert text.count("trainer closed at step") == before + 2, text[-4000:]


def _other_rank_pid(p: Torchrun, marker: Path) -> int:
    """The pid of the rank that did not pause (torchrun's other child)."""
    paused = int(marker.read_text().split("pid=")[1].split()[0])
    out = subprocess.run(["pgrep", "-P", str(p.proc.pid)], capture_output=True, text=True).stdout
    others = [int(x) for x in out.split() if int(x) != paused]
    assert len(others) == 1, f"torchrun's children: {out.split()}, paused {paused}"
    return others[0]


def _kill_paused(marker: Path) -> str:
    """SIGKILL the rank that paused at the test hook (its pid is in the marker); returns the marker."""
    text = marker.read_text()
    pid = int(text.split("pid=")[1].split()[0])
    os.kill(pid, signal.SIGKILL)
    return text


def test_sigkill_of_either_rank_then_elastic_restart_loses_nothing_and_trains_nothing_twice(
    trainer_env, tmp_path
):
    """A rank SIGKILLed after a step, before a registration and after one (numbered below), each
    time restarted by torchrun's elastic agent; every rollout trained exactly once. Needs over a
    minute: the two ranks (each importing torch and joining gloo) start four times."""
    settings, cfg = trainer_env
    cfg.update(checkpoint_every=2, batch_size=4, max_wait_s=1.0)
    state_dir = Path(cfg["state_dir"])
    marker = state_dir / "paused-at"
    client = MlflowClient(settings.mlflow_uri)
    log = tmp_path / "torchrun.log"

    def start(ship_interval: float, pause_at: str) -> Torchrun:
        marker.unlink(missing_ok=True)
        env = trainer_env_vars(settings.model_copy(update={"ship_interval": ship_interval}), cfg)
        env["FLYWHEEL_TRAINER_PAUSE_AT"] = pause_at
        return Torchrun(env, log)

    def versions():
        return model_versions(client, settings.model_name)

    policy = build_policy(TINY_POLICY)
    records = rollout_records(policy, 1, 24, lambda text: 1.0 if "\n" in text else 0.0, seed=3)
    produce(settings, records)

    # 1. rank 1 killed right after optimizer step 3 (state saved at step 2); torchrun restarts both ranks
    p = start(3600, "after_optimizer_step:3@1")
    wait_for(marker.exists, 600, "rank 1 paused after step 3", p.proc, log)
    assert "rank=1" in _kill_paused(marker)
    # the restarted ranks pass step 3 again (the hook fires once per marker) and train the rest
    wait_for(
        lambda: log.read_text().count("resumed trainer state") >= 4,
        600,
        "both ranks restarted",
        p.proc,
        log,
    )
    _stop(p, log)
    assert [mv.version for mv in versions()] == ["1"], "no ship yet: only the base version"

    # 2. rank 1 killed while rank 0 holds the saved ship intent, before registering: torchrun restarts
    # both and the resumed intent registers v2 once
    p = start(2, "before_register@0")
    wait_for(marker.exists, 600, "rank 0 paused before_register", p.proc, log)
    assert "rank=0" in marker.read_text()
    assert [mv.version for mv in versions()] == ["1"], "nothing registered before the pause"
    os.kill(_other_rank_pid(p, marker), signal.SIGKILL)
    ends = wait_all_committed(
        settings, cfg, p.proc, log, 600, "the restarted ranks ship and commit everything"
    )
    _stop(p, log)
    assert len(versions()) >= 2

    # fresh rollouts, duplicates of trained ones and garbage arrive between runs
    newest = int(versions()[-1].version)  # labelled with it, so they are not stale
    extra = rollout_records(policy, newest, 8, lambda t: float("(" in t), seed=5, prefix="x-")
    *_, dup0, dup1 = produce(settings, extra + [records[0], records[1]])
    untrained = [dup0, dup1, *produce_raw(settings, [("garbage", b'{"request_id": "x"}')])]
    # a trained tail behind the skipped records, whatever partition they landed on
    closers = rollout_records(policy, newest, settings.rollouts_partitions, lambda t: 0.5, seed=6)
    produce_closers(settings, closers)

    # 3. rank 0 killed after registering a version, before any rank committed its offsets
    before = versions()
    committed_before = committed_offsets(settings, cfg["consumer_group"])
    p = start(2, "after_register@0")
    wait_for(marker.exists, 600, "rank 0 paused after_register", p.proc, log)
    registered = versions()
    assert len(registered) == len(before) + 1
    assert committed_offsets(settings, cfg["consumer_group"]) == committed_before, (
        "no rank commits before the version is registered and rank 0 says so"
    )
    assert "rank=0" in _kill_paused(marker)
    ends = wait_all_committed(
        settings, cfg, p.proc, log, 600, "every offset committed by the restarted ranks"
    )
    _stop(p, log)
    text = log.read_text()
    assert (
        "[rank 1]" in text
        and "reading partitions [1]" in text
        and "reading partitions [0, 2]" in text
    )

    final = versions()
    assert len(final) >= 3, [mv.version for mv in final]
    crashed = registered[-1]
    assert final[int(crashed.version) - 1].tags["ship_id"] == crashed.tags["ship_id"], (
        "the crashed ship was finished, not redone"
    )
    produced = [r["request_id"] for r in records + extra + closers]
    skipped = check_lineage(client, final, produced, ends, tmp_path)
    assert skipped["duplicate"] == 2 and skipped["invalid"] == 1 and skipped["stale"] == 0, skipped
    # the ranks' skipped offsets, merged into the versions' events: exactly those three records'
    assert listed_skipped_offsets(settings, final) == sorted(untrained)


def test_flywheel_trainer_nproc_starts_the_ranks_with_torchrun(trainer_env, tmp_path):
    """`flywheel trainer --nproc 2` replaces itself with torchrun: two ranks read disjoint
    partitions, rank 0 registers the base version, and SIGTERM stops both cleanly."""
    settings, cfg = trainer_env
    client = MlflowClient(settings.mlflow_uri)
    log = tmp_path / "cli.log"
    cli = [sys.executable, "-m", "app.cli", "trainer", "--nproc", "2"]
    p = Torchrun(trainer_env_vars(settings, cfg), log, cli)
    try:
        wait_for(
            lambda: (
                "reading partitions [1]" in log.read_text()
                and client.search_model_versions(f"name='{settings.model_name}'")
            ),
            300,
            "two ranks and the base version",
            p.proc,
            log,
        )
    finally:
        _stop(p, log)
    text = log.read_text()
    assert "starting 2 trainer ranks" in text and "reading partitions [0, 2]" in text
    versions = client.search_model_versions(f"name='{settings.model_name}'")
    assert [mv.version for mv in versions] == ["1"] and versions[0].tags["kind"] == "base"


@pytest.mark.parametrize("mode", ["fsdp", "ddp-lora"])
def test_hf_ranks_ship_a_version_a_replica_loads(trainer_env, tmp_path, mode):
    """A tiny Hugging Face MoE model on 2 gloo ranks, sharded with FSDP (full fine-tuning) or
    replicated with DDP (a LoRA adapter): the ranks train the champion's rollouts (mismatch
    exactly 0: the ranks' forward is the replica's), rank 0 ships v2 (FSDP: the gathered bf16
    weights as a delta; LoRA: the adapter), and v2 from the registry loads verified in a
    replica and generates; a restart resumes the saved state. Needs over a minute on 2 shared
    cores: two gloo ranks start twice, each importing torch and transformers."""
    from app.contracts.artifacts import apply_chain, fetch_manifest
    from app.replica.fetch import VersionFetcher
    from app.replica.weights import load_verified
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer
    from tests.integration.trainer.conftest import PROMPTS

    settings, cfg = trainer_env
    model_dir = tiny_qwen2_moe_dir(tmp_path / "moe", train_bpe_tokenizer(tmp_path / "tok"))
    cfg.update(policy={"type": "hf", "model_dir": str(model_dir)}, lr=1e-3)
    if mode == "fsdp":
        cfg.update(parallel="fsdp")
    else:
        cfg.update(
            parallel="ddp", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
        )
    cfg.update(checkpoint_every=2, batch_size=4, max_wait_s=1.0)
    client = MlflowClient(settings.mlflow_uri)
    log = tmp_path / "torchrun.log"

    def versions():
        return model_versions(client, settings.model_name)

    # the champion v1 is the directory's weights: sample rollouts from them as a replica would
    champion = build_policy({"type": "hf", "model_dir": str(model_dir)})
    champion.eval()
    records = rollout_records(champion, 1, 12, lambda text: 0.0, group_size=2)
    # each group on one partition with one success and one failure: whichever batches the ranks
    # form, every step has a group whose advantages are +-1 (a parity reward left some splits of
    # the groups over partitions with no advantage at all, and v2 equal to v1)
    for i, r in enumerate(records):
        r["tokenizer"] = champion.tokenizer.name
        r["reward"] = r["components"]["decision"] = float(i % 2)
    produce_raw(
        settings,
        [(r["request_id"], dumps(r)) for r in records],
        partitions=[(i // 2) % settings.rollouts_partitions for i in range(len(records))],
    )

    env = trainer_env_vars(settings.model_copy(update={"ship_interval": 5}), cfg)
    p = Torchrun(env, log)
    try:
        wait_for(lambda: len(versions()) >= 2, 600, "v2 shipped by the sharded ranks", p.proc, log)
        wait_for(
            lambda: sum(int(mv.tags["rollouts_consumed"]) for mv in versions()[1:]) == 12,
            600,
            "all 12 rollouts trained and shipped",
            p.proc,
            log,
        )
    finally:
        _stop(p, log)
    text = log.read_text()
    assert "reading partitions [1]" in text

    # a restart loads the state rank 0 saved (sharded: full model + optimizer, broadcast to the shards)
    sharded = mode == "fsdp"
    before = text.count("resumed trainer state")
    kl_refs = text.count("KL reference: champion")
    p = Torchrun(env, log)
    try:
        wait_for(
            lambda: (
                log.read_text().count("resumed trainer state") >= before + 2
                and log.read_text().count("fully_shard over 2 ranks") >= (4 if sharded else 0)
                and log.read_text().count("KL reference: champion") >= kl_refs + 2
            ),
            300,
            "both ranks resumed and sharded again",
            p.proc,
            log,
        )
    finally:
        _stop(p, log)
    restarted = log.read_text()[len(text) :]
    assert "resumed trainer state: step 0" not in restarted, "the saved steps were resumed"
    assert "fresh optimizer moments" not in restarted, "the saved optimizer state was loaded"

    final = versions()
    run = final[1].run_id
    mismatch = client.get_metric_history(run, "mismatch")
    assert mismatch and {m.value for m in mismatch} == {0.0}, "the ranks' log-probs = behaviour"
    fetcher = VersionFetcher(settings)
    try:
        fetch = fetcher.fetch_file
        held_v1, _ = apply_chain("1", fetch)
        v2_state, manifest = apply_chain("2", fetch, held=("1", held_v1))
        if sharded:  # the full weights, as a delta from v1
            assert fetch_manifest(fetch, "2").delta is not None
            changed = [k for k in v2_state if not torch.equal(v2_state[k], held_v1[k])]
        else:  # the first LoRA version: the adapter alone, as an anchor
            assert v2_state and all("lora" in k for k in v2_state), sorted(v2_state)[:4]
            changed = [k for k in v2_state if "lora_B" in k and bool(v2_state[k].any())]
        assert changed, "the ranks' steps changed no weight"
        lv = load_verified(
            "2",
            v2_state,
            fetcher.policy_config("2"),
            manifest.checkpoint_sha256,
            digests={t.name: t.sha256 for t in manifest.tensors},
        )
        tok = lv.policy.tokenizer
        samples = lv.policy.generate(
            [tok.encode(q) for q in PROMPTS[:2]], max_tokens=6, temperature=1.0, seed=1
        )
        assert all(len(s.tokens) > 0 and s.routes is not None for s in samples)
    finally:
        fetcher.close()
