"""A user's Hugging Face MoE model through the whole loop: `flywheel run --model DIR`.

A tiny Qwen2-MoE directory is built offline (tests/hf_models.py: random weights, a BPE tokenizer
trained on this repo's text) and saved with `save_pretrained`, as a user hands one over. `flywheel
run --model DIR` runs as a subprocess with a short cadence (the built-in policy's e2e,
tests/e2e/test_local_stack.py, runs the same stack): real Kafka, MLflow server, API, streams
worker, trainer, controller, two replicas and the simulated editor population.

Two stacks, one per way of training the model (each stack costs minutes, so each checks all it
can on its way):

- **Full fine-tuning on both engines** (`test_an_hf_moe_model_trains_on_both_engines`):
  replica-0 runs the built-in engine, replica-1 vLLM (`vllm serve` from deploy/vllm/ensure.sh's
  environment; the model has head_dim 64, which vLLM's CPU attention needs). Asserted through the
  registry, the status API, the replicas and the topics: v1 is DIR itself (kind `import`, its
  model files' hash) and was champion; a trained version's lineage counts consumed rollouts; it
  was gated, canaried, then promoted or rolled back, and both replicas took it forward from the
  version they held (the built-in engine by the `delta` path); generation events carry DIR's
  tokenizer id, the built-in engine's its MoE routes [T, 2 layers, top-2] (vLLM returns routed
  experts only on GPU); a version was trained on rollouts of vLLM's generations; the held-out
  simulation scores v1 and the trained version; every replica serves the status API's champion;
  the import step that `flywheel run` takes on every start resumes on a registry of the same
  model and refuses another model with one line: tested on that step itself
  (tests/integration/trainer/test_model_import.py), so this stack starts once.
- **LoRA** (`test_an_hf_moe_model_trains_a_lora_adapter_through_the_whole_loop`,
  `FLYWHEEL_TRAINER_LORA` on the q/v projections and the fused experts): the first trained version
  is an adapter anchor (v1 holds full weights) and a later version ships as an adapter delta,
  smaller than a twentieth of the model's file, that both replicas apply by the `delta` path.
"""

from __future__ import annotations

import base64
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.stack import stack_env, start_run, stop_run, wait_for
from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer

pytestmark = pytest.mark.e2e

MOE_LAYERS, TOP_K = 2, 2  # tiny_qwen2_moe_dir

# LoRA on the attention projections and the fused experts (peft `target_parameters`)
LORA = {
    "r": 4,
    "alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


def _env(data_dir: Path) -> tuple[dict[str, str], dict[str, int]]:
    return stack_env(
        data_dir,
        # a random tiny model: lr 1e-6 (the HF default) moves no bf16 serving weight, and the
        # delta would be empty; 1e-3 makes every version a real change
        FLYWHEEL_TRAINER_LR="1e-3",
        FLYWHEEL_TRAINER_PLANT_BAD_VERSION="0",  # the planted version has its own unit tests
        FLYWHEEL_CONTROLLER_GATE_ROLLOUTS="16",
    )


def _start(env: dict[str, str], ports: dict[str, int], model_dir: Path, log: Path, *args: str):
    return start_run(env, ports, log, "--model", str(model_dir), *args)


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


def _imported(proc, log: Path) -> None:
    wait_for(
        "the import of the model directory",
        lambda: "(imported; flywheel-policy" in log.read_text(errors="replace"),
        300,
        proc,
        log,
    )


def _synced_paths(history, version: str, replica_ids: list[str]) -> dict[str, list[str]]:
    """The sync paths (`delta`, `held`, ...) each replica published for `version` (None for
    each until every replica has one)."""
    paths: dict[str, list[str]] = {r: [] for r in replica_ids}
    for e in history(type="replica_synced", version=version):
        if e["version"] == version and e["details"]["replica_id"] in paths:
            paths[e["details"]["replica_id"]].append(e["details"]["path"])
    return paths if all(paths.values()) else {}


def _serving_v1(history, replica_ids: list[str]) -> bool:
    """Every replica published `replica_synced` for v1 in the champion slot."""
    synced = {
        e["details"]["replica_id"]
        for e in history(type="replica_synced", version="1")
        if e["version"] == "1" and e["details"].get("slot") == "champion"
    }
    return synced == set(replica_ids)


def _check_import(mlflow, model_dir: Path, history, http: httpx.Client) -> None:
    """v1 is the user's directory, registered by the import, and champion (once the replicas
    serve it, the projector has folded the import's events)."""
    from policy.hf_files import pack

    v1 = mlflow.get_model_version("flywheel-policy", "1")
    assert v1.tags["kind"] == "import", v1.tags
    assert v1.tags["hf_files_sha256"] == pack(model_dir)[1]
    # the filter also matches events that name v1 as their parent (a trained v2 may be out by now)
    registered = [e for e in history(type="version_registered", version="1") if e["version"] == "1"]
    assert [(e["source"], e["actor"]) for e in registered] == [
        ("import", "flywheel-model-import")
    ], registered
    assert any(e["version"] == "1" for e in history(type="alias_changed", version="1"))
    lineage = http.get("/v1/models/1").json()["lineage"]
    assert lineage["parent_version"] is None and not lineage["rollouts_consumed"], lineage


def _check_trained_on_feedback(http: httpx.Client, version: str) -> None:
    body = http.get(f"/v1/models/{version}").json()
    consumed = body.get("rollouts_consumed") or body.get("lineage", {}).get("rollouts_consumed")
    assert consumed and int(consumed) > 0, f"v{version} must train on feedback: {body}"


def _delta_tag(mlflow, version: str) -> dict:
    return json.loads(mlflow.get_model_version("flywheel-policy", version).tags["delta"])


@dataclass
class _Run:
    """What the checks on one running `flywheel run` share: the process and its log, its
    environment and ports, the status API (`http`, `history`), the registry and the replicas."""

    proc: subprocess.Popen
    log: Path
    env: dict[str, str]
    ports: dict[str, int]
    http: httpx.Client
    history: Any  # _status_api's history(**params)
    mlflow: Any  # mlflow.MlflowClient
    replica_ids: list[str]


def _both_replicas_serve_the_import(run: _Run, moe_dir: Path) -> None:
    """Both replicas, one on vLLM, serve v1: the user's directory as imported."""
    wait_for(
        "both replicas (one on vLLM) serving v1 as champion",
        lambda: _serving_v1(run.history, run.replica_ids),
        600,
        run.proc,
        run.log,
    )
    _check_import(run.mlflow, moe_dir, run.history, run.http)
    engine = httpx.get(f"http://127.0.0.1:{run.ports['replicas'] + 1}/v1/status").json()["engine"]
    # v1 served is what the history above showed; by now the loop may have taken it further
    assert engine["engine"] == "vllm" and int(engine["engines"][0]["version"]) >= 1, engine


def _a_trained_version_taken_forward(run: _Run) -> str:
    """A version trained on feedback, gated, canaried and decided, that both replicas took
    forward from the version they held. Returns it."""

    def decided_and_synced() -> str | None:
        version = _decided(run.history())
        return version if version and _synced_paths(run.history, version, run.replica_ids) else None

    version = wait_for(
        "a trained version decided and synced to both replicas",
        decided_and_synced,
        1200,
        run.proc,
        run.log,
        interval=5,
    )
    _check_trained_on_feedback(run.http, version)
    # both replicas took it forward from the version they held: the built-in engine by a
    # delta, vLLM by a delta applied in place (or it already held those weights)
    paths = _synced_paths(run.history, version, run.replica_ids)
    assert "delta" in paths["replica-0"], paths
    assert "delta" in paths["replica-1"] or "held" in paths["replica-1"], paths
    delta = _delta_tag(run.mlflow, version)
    assert delta["anchor"] is False and delta["delta_bytes"] > 0, delta
    return version


def _trained_on_vllm_generations(run: _Run, moe_dir: Path) -> None:
    """Generations: the model's tokenizer on both engines; the built-in engine's carry the MoE
    routes, vLLM's none. The trainer learned from vLLM's: their rollouts lie in a trained
    version's Kafka ranges (vLLM starts later, so the first versions may hold none yet)."""
    from policy.hf import HFTokenizer

    expected_tok = HFTokenizer(moe_dir, vocab_size=10**6).name
    bootstrap = run.env["FLYWHEEL_KAFKA_BOOTSTRAP"]
    seen: dict[str, int] = {}

    def trained_on_vllm() -> list[tuple[int, int]]:
        gens = [
            r
            for _, _, r in _records(bootstrap, "flywheel.interactions")
            if r.get("type") == "generation"
        ]
        assert all(g["tokenizer"] == expected_tok for g in gens)
        routed = [g for g in gens if "route_shape" in g]
        for g in routed:
            t = len(g["completion_tokens"])
            assert g["route_shape"] == [t, MOE_LAYERS, TOP_K], g["route_shape"]
            assert len(base64.b64decode(g["routes"])) == 4 * t * MOE_LAYERS * TOP_K
        from_vllm = {g["request_id"] for g in gens if "route_shape" not in g}
        seen.update(vllm=len(from_vllm), torch=len(routed))
        ranges = []
        for mv in run.mlflow.search_model_versions("name='flywheel-policy'"):
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
        run.proc,
        run.log,
        interval=10,
    )
    assert seen["vllm"] > 0 and seen["torch"] > 0, seen  # generations from both engines


def _scored_and_served(run: _Run, version: str) -> None:
    """The held-out simulation (app/simulate/evaluate.py) scores the imported and the trained
    version; every replica serves the status API's champion."""

    def scored() -> bool:
        return all(
            "heldout_acceptance" in run.mlflow.get_model_version("flywheel-policy", v).tags
            for v in ("1", version)
        )

    wait_for("held-out acceptance of v1 and the trained version", scored, 300, run.proc, run.log)
    wait_for(
        "the replicas to serve the API's champion",
        lambda: _replicas_agree(run.http, run.ports, len(run.replica_ids)),
        180,
        run.proc,
        run.log,
    )


def _run_on_both_engines(
    env: dict[str, str], ports: dict[str, int], moe_dir: Path, data_dir: Path, log: Path
) -> None:
    """`flywheel run --model DIR` with replica-0 on the built-in engine and replica-1 on vLLM,
    through every check above; stopped (exit 0) at the end."""
    from mlflow import MlflowClient

    api = f"http://127.0.0.1:{ports['api']}"
    replica_ids = ["replica-0", "replica-1"]
    engines = ("--replica-engine", "torch", "--replica-engine", "vllm")
    proc = _start(env, ports, moe_dir, log, *engines)
    try:
        _imported(proc, log)
        http, history = _status_api(api, data_dir)
        mlflow = MlflowClient(env["FLYWHEEL_MLFLOW_URI"])
        run = _Run(proc, log, env, ports, http, history, mlflow, replica_ids)
        _both_replicas_serve_the_import(run, moe_dir)
        version = _a_trained_version_taken_forward(run)
        _trained_on_vllm_generations(run, moe_dir)
        _scored_and_served(run, version)
    finally:
        rc = stop_run(proc, log=log)
    assert rc == 0, log.read_text(errors="replace")[-3000:]


@pytest.mark.timeout(1800)
def test_an_hf_moe_model_trains_on_both_engines(tmp_path: Path):
    """`flywheel run --model DIR --replica-engine torch --replica-engine vllm`, full fine-tuning
    (the module docstring lists what is asserted). Needs minutes: one whole stack on the user's
    model, two `vllm serve` processes starting on 2 shared cores, a ship interval, a gate and a
    canary."""
    root = tmp_path / "user-model"
    moe_dir = tiny_qwen2_moe_dir(root / "my-moe", train_bpe_tokenizer(root / "tok"), head_dim=64)
    data_dir = tmp_path / "data"
    env, ports = _env(data_dir)
    log = tmp_path / "run.log"
    # v1 imported and served, a version trained (on vLLM's generations too), gated, canaried,
    # decided, taken forward by both replicas and scored
    _run_on_both_engines(env, ports, moe_dir, data_dir, log)


@pytest.mark.timeout(1800)
def test_an_hf_moe_model_trains_a_lora_adapter_through_the_whole_loop(tmp_path: Path):
    """`flywheel run --model DIR` with FLYWHEEL_TRAINER_LORA (the module docstring lists what is
    asserted). Needs minutes: one whole stack on the user's model, a ship interval, a gate and a
    canary, then a second ship for the adapter delta."""
    from mlflow import MlflowClient
    from mlflow import artifacts as mlflow_artifacts

    from policy.hf import HFTokenizer

    root = tmp_path / "user-model"
    moe_dir = tiny_qwen2_moe_dir(root / "my-moe", train_bpe_tokenizer(root / "tok"))
    data_dir = tmp_path / "data"
    env, ports = _env(data_dir)
    env["FLYWHEEL_TRAINER_LORA"] = json.dumps(LORA)
    log = tmp_path / "run.log"
    api = f"http://127.0.0.1:{ports['api']}"
    replica_ids = ["replica-0", "replica-1"]
    proc = _start(env, ports, moe_dir, log)
    try:
        _imported(proc, log)
        http, history = _status_api(api, data_dir)
        mlflow = MlflowClient(env["FLYWHEEL_MLFLOW_URI"])
        wait_for(
            "both replicas serving the imported v1 as champion",
            lambda: _serving_v1(history, replica_ids),
            300,
            proc,
            log,
        )
        _check_import(mlflow, moe_dir, history, http)

        version = wait_for(
            "a trained version that was gated, canaried and promoted or rolled back",
            lambda: _decided(history()),
            900,
            proc,
            log,
            interval=5,
        )
        _check_trained_on_feedback(http, version)
        # the first LoRA version is an adapter anchor (its parent v1 holds the full weights);
        # a later one is an adapter delta, which both replicas apply forward
        assert _delta_tag(mlflow, "2")["anchor"] is True, _delta_tag(mlflow, "2")

        def adapter_delta_synced() -> str | None:
            for mv in mlflow.search_model_versions("name='flywheel-policy'"):
                tag = json.loads(mv.tags.get("delta") or "{}")
                if int(mv.version) > 2 and tag.get("anchor") is False:
                    paths = _synced_paths(history, str(mv.version), replica_ids)
                    if paths and all(any("delta" in p for p in ps) for ps in paths.values()):
                        return str(mv.version)
            return None

        adapter_v = wait_for(
            "an adapter delta synced to both replicas", adapter_delta_synced, 900, proc, log
        )
        full_bytes = (moe_dir / "model.safetensors").stat().st_size  # fp32 base
        tag = _delta_tag(mlflow, adapter_v)
        assert 0 < tag["delta_bytes"] < full_bytes // 20, tag
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

        wait_for(
            "the replicas to serve the API's champion",
            lambda: _replicas_agree(http, ports, len(replica_ids)),
            120,
            proc,
            log,
        )
    finally:
        rc = stop_run(proc, log=log)
    assert rc == 0, log.read_text(errors="replace")[-3000:]


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
