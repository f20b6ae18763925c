"""A user's Hugging Face MoE model through the whole loop: `flywheel run --model DIR`.

A tiny Qwen2-MoE directory is built offline (tests/hf_models.py: random weights, a BPE tokenizer
trained on this repo's text) and saved with `save_pretrained`, as a user hands one over. `flywheel
run --model DIR` runs as a subprocess with a short cadence (the built-in policy's e2e,
tests/e2e/test_local_stack.py, runs the same stack): real Kafka, MLflow server, API, streams
worker, trainer, controller, two replicas and the simulated editor population.

Asserted through the registry, the status API, the replicas and the interactions topic:
import -> serve -> feedback -> train -> ship -> gate -> canary -> promote or roll back -> delta
sync to both replicas:

- v1 is DIR itself (kind `import`, its model files' hash) and was champion;
- generation events carry DIR's tokenizer id and MoE routes [T, 2 layers, top-2];
- a trained version's lineage counts consumed rollouts; it was gated, canaried, then promoted or
  rolled back, and each replica published `replica_synced` for it by the `delta` path (forward
  from the version it held, not rebuilt from an anchor);
- the held-out simulation scores v1 and the trained version; every replica serves the status
  API's champion;
- a second start on the same data dir resumes (nothing imported again), and a registry holding
  another model is refused with one line.

Each case of `CASES` only adds environment: the full fine-tuning case adds none, the LoRA case
`FLYWHEEL_TRAINER_LORA` (q/v projections and the fused experts). With LoRA the first trained
version is an adapter anchor (v1 holds full weights) and the test also waits for a later version
shipped as an adapter delta, smaller than a twentieth of the model's file, that both replicas apply
by the `delta` path; the resume and refusal checks run in the full case only.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.stack import stack_env, start_run, stop_run, wait_for
from tests.hf_models import tiny_llama_dir, tiny_qwen2_moe_dir, train_bpe_tokenizer

pytestmark = pytest.mark.e2e

MOE_LAYERS, TOP_K = 2, 2  # tiny_qwen2_moe_dir

# LoRA on the attention projections and the fused experts (peft `target_parameters`)
LORA = {
    "r": 4,
    "alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
# one entry per way of training the model; each only adds environment to `_env`
CASES = [
    pytest.param({}, id="full"),
    pytest.param({"FLYWHEEL_TRAINER_LORA": json.dumps(LORA)}, id="lora"),
]


def _env(data_dir: Path) -> tuple[dict[str, str], dict[str, int]]:
    return stack_env(
        data_dir,
        # a random tiny model: lr 1e-6 (the HF default) moves no bf16 serving weight, and the
        # delta would be empty; 1e-3 makes every version a real change
        FLYWHEEL_TRAINER_LR="1e-3",
        FLYWHEEL_TRAINER_PLANT_BAD_VERSION="0",  # the planted version has its own unit tests
        FLYWHEEL_CONTROLLER_GATE_ROLLOUTS="16",
    )


def _start(env: dict[str, str], ports: dict[str, int], model_dir: Path, log: Path):
    return start_run(env, ports, log, "--model", str(model_dir))


def _generations(bootstrap: str, limit: int = 50) -> list[dict]:
    """Up to `limit` generation events from the start of `flywheel.interactions`."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        "flywheel.interactions",
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=10_000,
    )
    out = []
    try:
        for rec in consumer:
            event = json.loads(rec.value)
            if event.get("type") == "generation":
                out.append(event)
                if len(out) >= limit:
                    break
    finally:
        consumer.close()
    return out


def _status_api(api: str, data_dir: Path) -> tuple[httpx.Client, Any]:
    """A client of the status API with the run's read key, and `history(**params)` of deployments."""
    keys_file = data_dir / "local-keys.json"
    http = httpx.Client(
        base_url=api,
        headers={"Authorization": f"Bearer {json.loads(keys_file.read_text())['read']}"},
        timeout=10,
    )

    def history(**params) -> list[dict]:
        r = http.get("/v1/deployments/history", params={"limit": 500, **params})
        r.raise_for_status()
        return r.json()["events"]

    return http, history


def _replicas_agree(http: httpx.Client, ports: dict[str, int], n: int) -> str | None:
    """The API's champion once every replica reports serving it (else None)."""
    champion = http.get("/v1/deployments").json()["models"][0]["champion"]
    served = {
        httpx.get(f"http://127.0.0.1:{ports['replicas'] + i}/v1/status").json()["champion"]
        for i in range(n)
    }
    return champion if champion is not None and served == {champion} else None


def _decided(events: list[dict]) -> str | None:
    """The first trained version that was gated, canaried, and promoted or rolled back."""
    by_type: dict[str, set[str]] = {}
    for e in events:
        by_type.setdefault(e["type"], set()).add(str(e.get("version")))
    trained = {v for v in by_type.get("version_registered", set()) if v not in ("1", "None")}
    for v in sorted(trained, key=int):
        gated = v in by_type.get("gate_passed", set()) | by_type.get("gate_failed", set())
        canaried = v in by_type.get("canary_started", set())
        decided = v in by_type.get("promoted", set()) | by_type.get("rolled_back", set())
        if gated and canaried and decided:
            return v
    return None


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user-model")
    return tiny_qwen2_moe_dir(root / "my-moe", train_bpe_tokenizer(root / "tok"))


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("extra_env", CASES)
def test_an_hf_moe_model_goes_through_the_whole_loop(
    tmp_path: Path, moe_dir: Path, extra_env: dict[str, str]
):
    from mlflow import MlflowClient
    from mlflow import artifacts as mlflow_artifacts

    from trainer.policy.hf import HFTokenizer
    from trainer.policy.hf_files import pack

    data_dir = tmp_path / "data"
    env, ports = _env(data_dir)
    env.update(extra_env)
    lora = "FLYWHEEL_TRAINER_LORA" in extra_env
    log = tmp_path / "run.log"
    api = f"http://127.0.0.1:{ports['api']}"
    replica_ids = ["replica-0", "replica-1"]
    proc = _start(env, ports, moe_dir, log)
    try:
        wait_for(
            "the import of the model directory",
            lambda: "(imported; flywheel-policy" in log.read_text(errors="replace"),
            300,
            proc,
            log,
        )
        http, history = _status_api(api, data_dir)

        # import: v1 is the user's directory, and champion
        mlflow = MlflowClient(env["FLYWHEEL_MLFLOW_URI"])
        v1 = mlflow.get_model_version("flywheel-policy", "1")
        assert v1.tags["kind"] == "import", v1.tags
        assert v1.tags["hf_files_sha256"] == pack(moe_dir)[1]

        def serving_v1() -> bool:
            synced = {
                e["details"]["replica_id"]
                for e in history(type="replica_synced", version="1")
                if e["version"] == "1" and e["details"].get("slot") == "champion"
            }
            return synced == set(replica_ids)

        wait_for("both replicas serving the imported v1 as champion", serving_v1, 300, proc, log)
        registered = history(type="version_registered", version="1")
        assert [(e["source"], e["actor"]) for e in registered] == [
            ("import", "flywheel-model-import")
        ], registered
        assert any(e["version"] == "1" for e in history(type="alias_changed", version="1"))
        lineage = http.get("/v1/models/1").json()["lineage"]
        assert lineage["parent_version"] is None and not lineage["rollouts_consumed"], lineage

        version = wait_for(
            "a trained version that was gated, canaried and promoted or rolled back",
            lambda: _decided(history()),
            900,
            proc,
            log,
            interval=5,
        )
        body = http.get(f"/v1/models/{version}").json()
        consumed = body.get("rollouts_consumed") or body.get("lineage", {}).get("rollouts_consumed")
        assert consumed and int(consumed) > 0, f"v{version} must train on feedback: {body}"

        # both replicas took the trained version forward from the one they held: a delta
        def synced_by_delta() -> dict[str, list[str]]:
            paths: dict[str, list[str]] = {r: [] for r in replica_ids}
            for e in history(type="replica_synced", version=version):
                if e["version"] == version:
                    paths[e["details"]["replica_id"]].append(e["details"]["path"])
            return paths if all(paths.values()) else {}

        def delta_tag(v: str) -> dict:
            return json.loads(mlflow.get_model_version("flywheel-policy", v).tags["delta"])

        if not lora:
            paths = wait_for("both replicas' replica_synced", synced_by_delta, 120, proc, log)
            assert all("delta" in p for p in paths.values()), paths
            delta = delta_tag(version)
            assert delta["anchor"] is False and delta["delta_bytes"] > 0, delta
        else:
            # the first LoRA version is an adapter anchor (its parent v1 holds the full weights);
            # a later one is an adapter delta, which both replicas apply forward
            assert delta_tag("2")["anchor"] is True, delta_tag("2")

            def adapter_delta_synced() -> str | None:
                for mv in mlflow.search_model_versions("name='flywheel-policy'"):
                    tag = json.loads(mv.tags.get("delta") or "{}")
                    if int(mv.version) > 2 and tag.get("anchor") is False:
                        version_ = str(mv.version)
                        paths: dict[str, list[str]] = {r: [] for r in replica_ids}
                        for e in history(type="replica_synced", version=version_):
                            if e["version"] == version_:
                                paths[e["details"]["replica_id"]].append(e["details"]["path"])
                        if all(any("delta" in p for p in ps) for ps in paths.values()):
                            return version_
                return None

            adapter_v = wait_for(
                "an adapter delta synced to both replicas", adapter_delta_synced, 900, proc, log
            )
            full_bytes = (moe_dir / "model.safetensors").stat().st_size  # fp32 base
            assert 0 < delta_tag(adapter_v)["delta_bytes"] < full_bytes // 20, delta_tag(adapter_v)
            source = mlflow.get_model_version("flywheel-policy", adapter_v).source
            config_file = mlflow_artifacts.download_artifacts(
                artifact_uri=f"{source}/artifacts/config.json",
                dst_path=str(tmp_path / "dl"),
                tracking_uri=env["FLYWHEEL_MLFLOW_URI"],
            )
            config = json.loads(Path(config_file).read_text())
            assert config["lora"]["r"] == LORA["r"], config

        # serve: the generations the population got carry the tokenizer id and the MoE routes
        expected_tok = HFTokenizer(moe_dir, vocab_size=10**6).name
        gens = _generations(env["FLYWHEEL_KAFKA_BOOTSTRAP"])
        assert gens, "no generation event on flywheel.interactions"
        for g in gens:
            assert g["tokenizer"] == expected_tok, (g["tokenizer"], expected_tok)
            t = len(g["completion_tokens"])
            assert g["route_shape"] == [t, MOE_LAYERS, TOP_K], g["route_shape"]
            assert len(base64.b64decode(g["routes"])) == 4 * t * MOE_LAYERS * TOP_K

        # held-out simulation (app/simulate/evaluate.py) scores the imported and the trained version
        def scored() -> bool:
            return all(
                "heldout_acceptance" in mlflow.get_model_version("flywheel-policy", v).tags
                for v in ("1", version)
            )

        wait_for("held-out acceptance of v1 and the trained version", scored, 300, proc, log)

        # status: the API's champion is what every replica reports serving
        wait_for(
            "the replicas to serve the API's champion",
            lambda: _replicas_agree(http, ports, len(replica_ids)),
            120,
            proc,
            log,
        )
    finally:
        rc = stop_run(proc)
    assert rc == 0, log.read_text(errors="replace")[-3000:]
    if lora:
        return  # resuming and refusing another model do not depend on how the model trains

    # a second start on the same registry resumes: nothing is imported again
    proc = _start(env, ports, moe_dir, log)
    try:
        wait_for(
            "the resumed start",
            lambda: "(resumed; flywheel-policy" in log.read_text(errors="replace"),
            300,
            proc,
            log,
        )
        assert not [
            mv
            for mv in mlflow.search_model_versions("name='flywheel-policy'")
            if mv.tags.get("kind") == "import" and mv.version != "1"
        ]
    finally:
        rc = stop_run(proc)
    assert rc == 0

    # a registry that holds this model is refused for another one: one line, no role starts
    other = tiny_llama_dir(moe_dir.parent / "other-model", moe_dir.parent / "tok")
    before = len(log.read_bytes())
    proc = _start(env, ports, other, log)
    try:
        rc = proc.wait(300)
    finally:
        if proc.poll() is None:
            stop_run(proc)
    text = log.read_bytes()[before:].decode(errors="replace")
    assert rc == 2, text[-3000:]
    refusal = [ln for ln in text.splitlines() if "model import refused" in ln]
    assert len(refusal) == 1, text[-3000:]
    assert "of another model" in refusal[0] and "other config or tokenizer files" in refusal[0]
    assert "✓ api" not in text and "✓ trainer" not in text, text[-3000:]


def _records(bootstrap: str, topic: str) -> list[tuple[int, int, dict]]:
    """(partition, offset, record) of every record of `topic` up to its end offsets at the call
    (bounded: a running stack keeps writing to it)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out = []
        while any(consumer.position(tp) < end[tp] for tp in tps):
            for tp, recs in consumer.poll(timeout_ms=1000).items():
                out += [
                    (tp.partition, r.offset, json.loads(r.value))
                    for r in recs
                    if r.value is not None and r.offset < end[tp]
                ]
        return out
    finally:
        consumer.close()


@pytest.mark.timeout(1800)
def test_one_replica_on_each_engine_the_trainer_learns_from_vllm_generations(tmp_path: Path):
    """`flywheel run --model DIR --replica-engine torch --replica-engine vllm`: replica-0 runs the
    built-in engine, replica-1 vLLM (two `vllm serve` processes from deploy/vllm/ensure.sh's
    environment) on a Qwen2-MoE with head_dim 64 (vLLM's CPU attention refuses 16). Both serve
    the imported v1, both take a trained version by the delta path, vLLM's generations (no routes:
    vLLM returns routed experts only on GPU) become rollouts inside a trained version's Kafka
    ranges, and every replica ends on the API's champion."""
    from mlflow import MlflowClient

    from trainer.policy.hf import HFTokenizer

    root = tmp_path / "user-model"
    moe_dir = tiny_qwen2_moe_dir(root / "my-moe", train_bpe_tokenizer(root / "tok"), head_dim=64)
    data_dir = tmp_path / "data"
    env, ports = _env(data_dir)
    log = tmp_path / "run.log"
    api = f"http://127.0.0.1:{ports['api']}"
    replica_ids = ["replica-0", "replica-1"]
    proc = start_run(
        env,
        ports,
        log,
        "--model",
        str(moe_dir),
        "--replica-engine",
        "torch",
        "--replica-engine",
        "vllm",
    )
    try:
        wait_for(
            "the import of the model directory",
            lambda: "(imported; flywheel-policy" in log.read_text(errors="replace"),
            300,
            proc,
            log,
        )
        http, history = _status_api(api, data_dir)

        def serving_v1() -> bool:
            return {
                e["details"]["replica_id"]
                for e in history(type="replica_synced", version="1")
                if e["version"] == "1"
            } == set(replica_ids)

        wait_for("both replicas (one on vLLM) serving v1", serving_v1, 600, proc, log)
        engine = httpx.get(f"http://127.0.0.1:{ports['replicas'] + 1}/v1/status").json()["engine"]
        assert engine["engine"] == "vllm" and engine["engines"][0]["version"] == "1", engine

        def decided_and_synced() -> str | None:
            events = history()
            version = _decided(events)
            if version is None:
                return None
            paths = {
                e["details"]["replica_id"]: e["details"]["path"]
                for e in events
                if e["type"] == "replica_synced" and e["version"] == version
            }
            return version if set(paths) == set(replica_ids) else None

        version = wait_for(
            "a trained version decided and synced to both replicas",
            decided_and_synced,
            1200,
            proc,
            log,
            interval=5,
        )
        paths = [
            e["details"]["path"]
            for e in history(type="replica_synced", version=version)
            if e["version"] == version and e["details"]["replica_id"] == "replica-1"
        ]
        assert "delta" in paths or "held" in paths, paths

        # vLLM's generations: the model's tokenizer, no routes; the built-in engine's carry routes.
        # The trainer learned from them: their rollouts lie in a trained version's Kafka ranges
        # (vLLM starts later than the built-in engine, so the first versions may hold none yet).
        expected_tok = HFTokenizer(moe_dir, vocab_size=10**6).name
        mlflow = MlflowClient(env["FLYWHEEL_MLFLOW_URI"])
        bootstrap = env["FLYWHEEL_KAFKA_BOOTSTRAP"]
        seen: dict[str, int] = {}

        def trained_on_vllm() -> list[tuple[int, int]]:
            gens = [
                r
                for _, _, r in _records(bootstrap, "flywheel.interactions")
                if r.get("type") == "generation"
            ]
            assert all(g["tokenizer"] == expected_tok for g in gens)
            from_vllm = {g["request_id"] for g in gens if "route_shape" not in g}
            seen.update(vllm=len(from_vllm), torch=len(gens) - len(from_vllm))
            ranges = []
            for mv in mlflow.search_model_versions("name='flywheel-policy'"):
                if mv.tags.get("kafka_offsets"):
                    parts = json.loads(mv.tags["kafka_offsets"])["partitions"]
                    ranges += [(int(p), int(a), int(b)) for p, (a, b) in parts.items()]
            return [
                (p, o)
                for p, o, r in _records(bootstrap, "flywheel.rollouts")
                if r.get("request_id") in from_vllm
                and any(p == rp and a <= o < b for rp, a, b in ranges)
            ]

        wait_for(
            "a version trained on rollouts of vLLM's generations",
            trained_on_vllm,
            900,
            proc,
            log,
            interval=10,
        )
        assert seen["vllm"] > 0 and seen["torch"] > 0, seen  # generations from both engines

        wait_for(
            "the replicas to serve the API's champion",
            lambda: _replicas_agree(http, ports, len(replica_ids)),
            180,
            proc,
            log,
        )
    finally:
        rc = stop_run(proc)
    assert rc == 0, log.read_text(errors="replace")[-3000:]
