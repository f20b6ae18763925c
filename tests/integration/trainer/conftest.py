"""Fixtures of the trainer integration tests: a tiny policy, rollout records, Kafka helpers.

The rollouts are produced straight to `<ns>.rollouts` (no streams worker in between), from samples of
the real policy so behaviour log-probs and routes are the replica's numbers.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.contracts.events import encode_routes
from app.infra.kafka import dumps, make_consumer, make_producer
from tests.waiting import poll

REPO = Path(__file__).resolve().parents[3]
TINY_POLICY = {
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "d_ff": 32,
    "n_experts": 2,
    "top_k": 1,
    "max_context": 64,
}
PROMPTS = [
    "def add(a, b):\n    ",
    "def f(x):\n    ",
    "x = [",
    "for i in range(",
    "class A:\n    ",
    "if x > 0:\n    ",
]


def rollout_records(
    policy,
    version: int,
    n: int,
    reward_fn: Callable[[str], float],
    *,
    seed: int = 0,
    max_tokens: int = 12,
    prefix: str = "",
    group_size: int = 1,
    tool_error_every: int = 0,
) -> list[dict[str, Any]]:
    """`n` rollout records (docs/DESIGN.md §Rollout record) sampled from `policy`, rewarded by `reward_fn(text)`."""
    tok = policy.tokenizer
    prompts = [tok.encode(PROMPTS[(i // group_size) % len(PROMPTS)]) for i in range(n)]
    samples = policy.generate(prompts, max_tokens=max_tokens, temperature=1.0, seed=seed)
    out = []
    for i, (p, s) in enumerate(zip(prompts, samples)):
        routes, shape = encode_routes(s.routes) if s.routes is not None else (None, None)
        reward = float(reward_fn(s.text))
        errors = []
        if tool_error_every and i % tool_error_every == 0:
            errors = [
                {
                    "message": "SyntaxError: unexpected EOF",
                    "hint": "close the bracket",
                    "token_index": len(s.tokens) // 2,
                }
            ]
        out.append(
            {
                "request_id": f"{prefix}r{i}-{uuid.uuid4().hex[:8]}",
                "session_id": f"s{i % 3}",
                "group_id": f"{prefix}g{i // group_size}" if group_size > 1 else None,
                "model_version": str(version),
                "prompt_tokens": p,
                "completion_tokens": s.tokens,
                "logprobs": s.logprobs,
                "routes": routes,
                "route_shape": list(shape) if shape is not None else None,
                "reward": reward,
                "components": {
                    "decision": reward,
                    "persistence": None,
                    "rating": None,
                    "followup": None,
                    "tool_errors": -0.5 if errors else None,
                },
                "tool_errors": errors,
                "reward_spec": "v1",
                "generated_at": "2026-01-01T00:00:00Z",
                "labelled_at": "2026-01-01T00:15:00Z",
                "closed_by": "window",
            }
        )
    return out


TOOL_RESULT = list(b"\ntool: 42\n")  # what the tool answered between two calls: context


def session_records(
    policy, version: int, n: int, *, seed: int = 0, prefix: str = "", max_tokens: int = 6
) -> list[dict[str, Any]]:
    """`n` two-call agent sessions sampled from `policy`, each one multi-turn rollout record
    assembled by the session ledger (streams/ledger.py) from the label join's two turn records
    (tests/unit/streams/test_ledger.py `turn_rec`): turn 0 from a prompt of PROMPTS, the tool's
    result, turn 1 from all of that (the first completion's eos left out of the history, as the
    built-in template renders it). The record's request_id is its first call's."""
    from streams.ledger import Ledger, LedgerConfig
    from tests.unit.streams.test_ledger import turn_rec

    tok, ledger, out = policy.tokenizer, Ledger(LedgerConfig(), {}), []
    for i in range(n):
        sid = f"{prefix}session-{i}-{uuid.uuid4().hex[:6]}"
        prompt = tok.encode(PROMPTS[i % len(PROMPTS)])
        [s0] = policy.generate([prompt], max_tokens=max_tokens, temperature=1.0, seed=seed + 2 * i)
        history = s0.tokens[:-1] if s0.tokens[-1] == tok.eos_id else s0.tokens
        p1 = [*prompt, *history, *TOOL_RESULT]
        [s1] = policy.generate([p1], max_tokens=max_tokens, temperature=1.0, seed=seed + 2 * i + 1)
        for rec in (
            turn_rec(sid, 0, prompt, s0.tokens, logprobs=s0.logprobs, model_version=str(version)),
            turn_rec(
                sid,
                1,
                p1,
                s1.tokens,
                logprobs=s1.logprobs,
                model_version=str(version),
                reward=i % 2,
            ),
        ):
            out += [e.value for e in ledger.on_rollout(rec, now=0.0) if e.topic == "rollouts"]
        out += [e.value for e in ledger.end_session(sid, now=1.0) if e.topic == "rollouts"]
    assert len(out) == n and all(len(r["turns"]) == 2 for r in out), out
    return out


def drain(trainer, expected: int, max_polls: int = 400) -> None:
    """Run train steps until `expected` records were processed (trained on or skipped) since the last ship."""
    for _ in range(max_polls):
        trainer.train_step()
        p = trainer.pending
        if p.rollouts + sum(p.skipped.values()) >= expected:
            return
    raise AssertionError(
        f"only {trainer.pending.rollouts} trained + {trainer.pending.skipped} of {expected} records"
    )


def produce(settings, records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The records on `<ns>.rollouts` keyed by request_id; their (partition, offset), in order."""
    return produce_raw(settings, [(r["request_id"], dumps(r)) for r in records])


def produce_closers(settings, records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """`records[i]` on partition i of `<ns>.rollouts`, one per partition: rollouts the trainer
    trains on, after everything produced before them. A record the trainer skips (a duplicate,
    garbage) has its offset committed by the first ship whose positions pass it, and no ship comes
    without a trained rollout; a skipped record at a partition's tail would wait for one (the
    ship due logs "waiting for rollouts"). A closer behind it makes every partition's end
    committable, whatever the order the trainer reads the partitions in."""
    assert len(records) == settings.rollouts_partitions, "one closer per partition"
    return produce_raw(
        settings,
        [(r["request_id"], dumps(r)) for r in records],
        partitions=list(range(len(records))),
    )


def produce_raw(
    settings,
    records: list[tuple[str | None, bytes | None]],
    partitions: list[int] | None = None,
) -> list[tuple[int, int]]:
    """(key, value) records as they are, bytes that are not JSON and tombstones included, on
    `partitions[i]` (default: by key); their (partition, offset), in order."""
    producer = make_producer(settings)
    try:
        sent = [
            producer.send(
                settings.topic("rollouts"),
                key=key,
                value=value,
                partition=None if partitions is None else partitions[i],
            )
            for i, (key, value) in enumerate(records)
        ]
        producer.flush(30)
        return [(m.partition, m.offset) for m in (f.get(timeout=30) for f in sent)]
    finally:
        producer.close(5)


def read_dlq(
    settings, expect: int, timeout: float = 60.0, settle: float = 1.0
) -> list[dict[str, Any]]:
    """The dead letters about `<ns>.rollouts` (streams' DlqRecord, value decoded to `value` bytes), once
    at least `expect` arrived (then `settle` s more), or what arrived by `timeout`."""
    from app.contracts.rollouts import DlqRecord

    cons = make_consumer(settings, settings.topic("dlq"), group_id=None, consumer_timeout_ms=200)
    out: list[dict[str, Any]] = []
    deadline, settle_until = time.monotonic() + timeout, None
    try:
        while time.monotonic() < deadline:
            for rec in cons:
                d = DlqRecord.model_validate_json(rec.value).model_dump()
                if d["topic"] == settings.topic("rollouts"):
                    d["value"] = (
                        base64.b64decode(d["value_b64"]) if d["value_b64"] is not None else None
                    )
                    out.append(d)
            if len(out) >= expect and settle_until is None:
                settle_until = time.monotonic() + settle
            if settle_until is not None and time.monotonic() >= settle_until:
                break
    finally:
        cons.close()
    return out


def registered_event(settings, version: str, timeout: float = 60.0) -> dict[str, Any]:
    """The `version_registered` event of `version` on the deployments topic, as JSON."""
    cons = make_consumer(
        settings, settings.topic("deployments"), group_id=None, consumer_timeout_ms=500
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            for rec in cons:
                ev = json.loads(rec.value)
                if ev["type"] == "version_registered" and ev["version"] == version:
                    return ev
    finally:
        cons.close()
    raise AssertionError(f"no version_registered event for v{version} in {timeout}s")


def listed_skipped_offsets(settings, versions: list) -> list[tuple[int, int]]:
    """The (partition, offset) pairs the `version_registered` events of `versions` list as
    `skipped_offsets`, sorted (a pair listed twice stays twice); each event must list them."""
    out = []
    for mv in versions:
        details = registered_event(settings, mv.version)["details"]
        assert "skipped_offsets" in details, f"v{mv.version}: {details}"
        out += [(int(p), o) for p, offs in details["skipped_offsets"].items() for o in offs]
    return sorted(out)


def refused_count(reason: str) -> float:
    """This process's `flywheel_trainer_rollouts_refused_total{reason}`."""
    from prometheus_client import REGISTRY

    return (
        REGISTRY.get_sample_value("flywheel_trainer_rollouts_refused_total", {"reason": reason})
        or 0.0
    )


def committed_offsets(settings, group: str) -> dict[int, int | None]:
    from kafka import TopicPartition

    c = make_consumer(settings, group_id=group)
    try:
        topic = settings.topic("rollouts")
        return {
            p: c.committed(TopicPartition(topic, p)) for p in sorted(c.partitions_for_topic(topic))
        }
    finally:
        c.close()


def end_offsets(settings) -> dict[int, int]:
    from kafka import TopicPartition

    c = make_consumer(settings, group_id=None)
    try:
        topic = settings.topic("rollouts")
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic))]
        return {tp.partition: o for tp, o in c.end_offsets(tps).items()}
    finally:
        c.close()


@pytest.fixture()
def trainer_env(make_settings, mlflow_server, tmp_path: Path):
    """(settings, config-kwargs) for a trainer on the test broker and MLflow with a fresh model name."""
    settings = make_settings(
        mlflow_uri=mlflow_server.uri,
        model_name=f"policy-{uuid.uuid4().hex[:8]}",
        ship_interval=3600,
    )
    cfg = {
        "state_dir": tmp_path / "trainer-state",
        "policy": TINY_POLICY,
        "pretrain_steps": 0,
        "batch_size": 4,
        "max_wait_s": 0.5,
        "lr": 1e-3,
        "metrics_port": 0,
        "checkpoint_every": 1,
        "consumer_group": f"trainer-{uuid.uuid4().hex[:6]}",
        "experiment": f"exp-{uuid.uuid4().hex[:6]}",
    }
    return settings, cfg


def trainer_env_vars(settings, cfg: dict[str, Any]) -> dict[str, str]:
    """The same configuration as environment variables, for a trainer subprocess."""
    env = dict(os.environ)
    env.update(
        {
            "FLYWHEEL_DATA_DIR": str(settings.data_dir),
            "FLYWHEEL_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "FLYWHEEL_MLFLOW_URI": settings.mlflow_uri,
            "FLYWHEEL_MODEL_NAME": settings.model_name,
            "FLYWHEEL_TOPIC_NAMESPACE": settings.topic_namespace,
            "FLYWHEEL_SHIP_INTERVAL": str(settings.ship_interval),
            "FLYWHEEL_ROLLOUTS_PARTITIONS": str(settings.rollouts_partitions),
            "FLYWHEEL_INTERACTIONS_PARTITIONS": str(settings.interactions_partitions),
        }
    )
    for k, v in cfg.items():
        env[f"FLYWHEEL_TRAINER_{k.upper()}"] = json.dumps(v) if isinstance(v, dict) else str(v)
    return env


def wait_for(
    cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None
):
    """`cond()`'s first truthy value (tests/waiting.py `poll`); fails at once, with the log's
    tail, when the trainer process `proc` exits first, and with the tail on a timeout."""

    def ready():
        value = cond()
        if not value and proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"trainer exited {proc.returncode} while waiting for {what}:\n{log.read_text()[-4000:]}"
            )
        return value

    try:
        return poll(ready, timeout, what, every=0.2)
    except AssertionError as exc:
        if log is None or "trainer exited" in str(exc):
            raise
        raise AssertionError(f"{exc}:\n{log.read_text()[-4000:]}") from None


def wait_all_committed(
    settings,
    cfg: dict,
    proc: subprocess.Popen,
    log: Path,
    timeout: float = 300,
    what: str = "all offsets committed",
) -> dict[int, int]:
    """The rollouts topic's end offsets now, once the trainer's group committed every one of them
    (`wait_for`: fails at once if `proc` exits first)."""
    ends = end_offsets(settings)
    wait_for(
        lambda: committed_offsets(settings, cfg["consumer_group"]) == ends, timeout, what, proc, log
    )
    return ends


def model_versions(client, name: str) -> list:
    """Every version of registered model `name`, oldest first."""
    return sorted(client.search_model_versions(f"name='{name}'"), key=lambda mv: int(mv.version))


def check_lineage(client, final, produced: list[str], ends: dict[int, int], tmp: Path) -> Counter:
    """The end checks of the crash tests on `final`, every version of the model in order: one
    version per ship_id, each READY with its lineage tags and weights, parents chained; the union
    of the versions' lineage request ids is exactly `produced`, none twice; the offset ranges tile
    [0, end) of every partition. Returns the skipped counts summed over the versions."""
    ship_ids = [mv.tags.get("ship_id") for mv in final]
    assert all(ship_ids) and len(set(ship_ids)) == len(final), f"one version per ship: {ship_ids}"
    trained: list[str] = []
    skipped: Counter = Counter()
    ranges: dict[int, list[tuple[int, int]]] = {}
    for mv in final:
        assert mv.status == "READY"
        for tag in (
            "parent_version",
            "rollouts_consumed",
            "kafka_offsets",
            "reward_spec",
            "train_metrics",
            "rollout_status",
        ):
            assert tag in mv.tags, f"v{mv.version} lacks tag {tag}"
        prefix = f"ships/{mv.tags['ship_id']}"
        ids = json.loads(
            Path(
                client.download_artifacts(mv.run_id, f"{prefix}/lineage/request_ids.json", str(tmp))
            ).read_text()
        )
        assert len(ids) == int(mv.tags["rollouts_consumed"])
        trained += ids
        skipped.update(json.loads(mv.tags["rollouts_skipped"]))
        for part, (a, b) in json.loads(mv.tags["kafka_offsets"])["partitions"].items():
            ranges.setdefault(int(part), []).append((a, b))
        weights = client.download_artifacts(
            mv.run_id, f"{prefix}/model/artifacts/weights.safetensors", str(tmp)
        )
        assert os.path.getsize(weights) > 1000
    assert [mv.tags["parent_version"] for mv in final] == ["none"] + [
        mv.version for mv in final[:-1]
    ]
    dupes = [i for i, n in Counter(trained).items() if n > 1]
    assert not dupes, f"trained twice: {dupes}"
    assert sorted(trained) == sorted(produced), f"lost: {set(produced) - set(trained)}"
    for part, end in ends.items():
        spans = sorted(ranges.get(part, []))
        covered = 0
        for a, b in spans:
            assert a == covered, (
                f"partition {part}: gap or overlap at {a} (covered to {covered}): {spans}"
            )
            covered = b
        assert covered == end, f"partition {part}: lineage covers [0, {covered}) of [0, {end})"
    return skipped


class TrainerProcess:
    def __init__(self, env: dict[str, str], log: Path, module: str = "trainer.launch"):
        self.log = log
        self.out = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=env,
            cwd=REPO,
            stdout=self.out,
            stderr=subprocess.STDOUT,
        )

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.out.close()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        self.out.close()
        return rc
