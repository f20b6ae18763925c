"""The vLLM engine pool's decisions (app/replica/engines/vllm.py `VLLMEngines`) and the leases they
rest on (app/replica/weights.py), as logic without vLLM.

`RecordingEngine` is a `VLLMEngine` whose two methods that talk to a vLLM server, `update()` and
`generate()`, are replaced: `update()` records what it was given (and what the weight store served
at that moment) and reports the hashes of what it then holds, as the worker extension's RPC does;
`generate()` returns scripted tokens. No server is started (the pool's `engines` and `model_files`
are set directly), so this tests the pool's choices — which engine a version goes to, when it
waits, what it restores — not vLLM; tests/integration/replica/test_vllm_engine.py runs the same
pool on real vLLM servers. The model directory, its tokenizer, the hashes and the store are real.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from app.replica.config import ReplicaConfig
from app.replica.engines.base import EngineRefused, EngineUnavailable
from app.replica.engines.vllm import VLLMEngine, VLLMEngines, VLLMPolicy
from app.replica.weights import (
    Leases,
    LoadedVersion,
    Serving,
    VerificationError,
    WeightStore,
)
from app.settings import Settings
from kernels.delta.hashing import checkpoint_sha256, hash_state_dict

WAIT_S = 30.0  # generous bound on waits for another thread


class RecordingEngine(VLLMEngine):
    """A vLLM engine whose server is not started here (module docstring).

    `corrupt`: how many of the next updates leave one bit of tensor "w" wrong inside "vLLM";
    `missing`: tensor names the next update reports as not held."""

    def __init__(self, index: int, store: WeightStore) -> None:
        super().__init__(index, f"http://127.0.0.1:{8850 + index}")  # never contacted
        self.store = store
        self.calls: list[dict] = []
        self.corrupt = 0
        self.missing: list[str] = []
        self.script: tuple = ([], [], [], False)  # tokens, log-probs, finish reasons, stopped
        self.prompts: list[list[int]] = []
        self.grammar: str | None = None

    def update(self, state, transfer_dir):
        self.calls.append(
            {
                "sha256": checkpoint_sha256(state),
                "serving": self.store.snapshot(),
                "held": self.lv,
                "leases": {lv.version: lv.leases.count for lv in self.store.snapshot().held()},
            }
        )
        held = {k: v.clone() for k, v in state.items() if k not in self.missing}
        if self.corrupt:
            self.corrupt -= 1
            held["w"].view(torch.int16).view(-1)[0] ^= 1
        missing, self.missing = self.missing, []
        digests, sha = hash_state_dict(held)
        return {
            "digests": digests,
            "sha256": None if missing else sha,
            "missing": missing,
            "seconds": {"probe": 0.0, "load": 0.0, "hash": 0.0},
            "pause_s": 0.0,
            "write_s": 0.0,
        }

    def generate(
        self, prompts, *, max_tokens, temperature, seed, on_step, top_logprobs=0, grammar=None
    ):
        from app.replica.engines.vllm import Generated

        self.prompts = prompts
        self.grammar = grammar
        out = Generated(len(prompts))
        tokens, logprobs, reasons, out.stopped = self.script
        out.tokens, out.logprobs, out.reasons = list(tokens), list(logprobs), list(reasons)
        return out


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> dict:
    """An HF policy config naming a real tiny model directory (tests/hf_models.py)."""
    from policy.hf_files import pack
    from tests.hf_models import tiny_llama_dir, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("vllm-logic")
    model = tiny_llama_dir(root / "llama", train_bpe_tokenizer(root / "tok"))
    return {"type": "hf", "model_dir": str(model), "files_sha256": pack(model)[1], "name": "tiny"}


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
    }


class Pool:
    """A VLLMEngines with recording engines, a real store and versions built directly."""

    def __init__(self, tmp_path, config: dict, n: int = 2, drain_s: float = 60.0) -> None:
        self.config = config
        self.store = WeightStore()
        self.pool = VLLMEngines(
            Settings(data_dir=tmp_path), ReplicaConfig(vllm_engines=n, vllm_drain_timeout=drain_s)
        )
        self.engines = [RecordingEngine(i, self.store) for i in range(n)]
        self.pool.engines = list(self.engines)
        self.pool.model_files = config["files_sha256"]
        self._tok = self.pool._tokenizer(config)

    def held(self, engine: RecordingEngine, version: str) -> LoadedVersion:
        """A version `engine` holds (as if verified into it earlier)."""
        state = _state(int(version))
        lv = LoadedVersion(
            version=version,
            policy=VLLMPolicy(engine, version, self.config, self._tok),
            state=state,
            sha256=checkpoint_sha256(state),
            config=dict(self.config),
        )
        engine.lv = lv
        return lv

    def load(self, slot: str, version: str, **overrides) -> LoadedVersion:
        state = _state(int(version))
        return self.pool.load(
            slot,
            version,
            state,
            {**self.config, **overrides},
            checkpoint_sha256(state),
            store=self.store,
        )


def _until(cond, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < WAIT_S, f"waited {WAIT_S} s for {what}"
        time.sleep(0.01)


# --- which engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("champion_on", [0, 1])
def test_a_new_version_goes_to_the_engine_that_does_not_hold_the_champion(
    tmp_path, model_config, champion_on
):
    p = Pool(tmp_path, model_config)
    champ_engine, other = p.engines[champion_on], p.engines[1 - champion_on]
    champion = p.held(champ_engine, "1")
    p.store.swap(champion=champion)
    lv = p.load("candidate", "2")
    assert lv.policy.engine is other and other.lv is lv and lv.version == "2"
    assert champ_engine.calls == [] and champ_engine.lv is champion
    assert [c["sha256"] for c in other.calls] == [lv.sha256]
    assert p.pool.usable(lv) and p.pool.usable(champion)
    assert p.store.snapshot().champion is champion  # load verifies; the sync agent publishes


def test_the_first_version_goes_to_a_free_engine(tmp_path, model_config):
    p = Pool(tmp_path, model_config)
    lv = p.load("champion", "1")
    assert lv.policy.engine is p.engines[0] and p.engines[1].calls == []


# --- the candidate's engine: out of the store, drained, then loaded -------------------------------
def _with_candidate(p: Pool) -> tuple[LoadedVersion, LoadedVersion]:
    champion, candidate = p.held(p.engines[0], "1"), p.held(p.engines[1], "2")
    p.store.swap(champion=champion, candidate=candidate, traffic_pct=30.0)
    return champion, candidate


def test_the_candidate_leaves_the_store_and_its_requests_finish_before_the_update(
    tmp_path, model_config
):
    p = Pool(tmp_path, model_config)
    champion, old = _with_candidate(p)
    lease = p.store.hold(old)  # a request generating on v2
    assert lease is not None
    got: dict = {}
    done = threading.Event()

    def load():
        try:
            got["lv"] = p.load("candidate", "3")
        except BaseException as exc:  # reported below
            got["error"] = exc
        done.set()

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        _until(lambda: p.store.snapshot().candidate is None, "the candidate to leave the store")
        assert p.store.snapshot().champion is champion  # the champion never pauses
        assert p.store.hold(old) is None, "a request picked the candidate after it left the store"
        assert not done.wait(0.5), f"the load did not wait for the request: {got}"
        assert p.engines[1].calls == [] and p.engines[1].lv is old
    finally:
        lease.release()
    assert done.wait(WAIT_S), "the load did not proceed after the request finished"
    t.join(WAIT_S)
    assert "error" not in got, got.get("error")
    (call,) = p.engines[1].calls
    assert call["serving"].candidate is None and call["serving"].champion is champion
    assert old.leases.count == 0
    assert got["lv"].version == "3" and p.engines[1].lv is got["lv"]
    assert not p.pool.usable(old)
    assert p.engines[0].calls == []


def test_a_request_that_never_finishes_times_the_load_out_and_the_candidate_comes_back(
    tmp_path, model_config
):
    p = Pool(tmp_path, model_config, drain_s=0.2)
    _, old = _with_candidate(p)
    lease = p.store.hold(old)
    try:
        with pytest.raises(TimeoutError, match=r"1 requests on v2 did not finish .*v3 waits"):
            p.load("candidate", "3")
        serving = p.store.snapshot()
        assert serving.candidate is old and serving.traffic_pct == 30.0
        assert p.engines[1].calls == [] and p.engines[1].lv is old and p.pool.usable(old)
    finally:
        lease.release()
    assert old.leases.count == 0


# --- verification inside the engine ---------------------------------------------------------------
def test_a_hash_mismatch_reloads_the_previous_version_and_restores_the_candidate(
    tmp_path, model_config
):
    p = Pool(tmp_path, model_config)
    champion, old = _with_candidate(p)
    p.engines[1].corrupt = 1
    with pytest.raises(VerificationError, match=r"version 3: .*differing tensors: \['w'\]"):
        p.load("candidate", "3")
    e = p.engines[1]
    assert [c["sha256"] for c in e.calls] == [checkpoint_sha256(_state(3)), old.sha256]
    assert e.calls[1]["held"] is None  # nothing verified is held while the weights change
    assert e.lv is old and p.pool.usable(old)
    serving = p.store.snapshot()
    assert serving.candidate is old and serving.traffic_pct == 30.0
    assert serving.champion is champion and p.engines[0].calls == []


def test_when_the_previous_version_fails_too_the_engine_holds_nothing_and_nothing_is_restored(
    tmp_path, model_config
):
    p = Pool(tmp_path, model_config)
    _, old = _with_candidate(p)
    p.engines[1].corrupt = 2
    with pytest.raises(VerificationError, match="version 3"):
        p.load("candidate", "3")
    assert p.engines[1].lv is None and not p.pool.usable(old)
    assert p.store.snapshot().candidate is None, "a version whose weights are unverified serves"


def test_tensors_the_engine_does_not_hold_fail_verification(tmp_path, model_config):
    p = Pool(tmp_path, model_config)
    p.engines[0].missing = ["b"]
    with pytest.raises(VerificationError, match=r"vLLM holds no copy of \['b'\]"):
        p.load("champion", "1")
    assert p.engines[0].lv is None and len(p.engines[0].calls) == 1  # nothing to restore


# --- one engine -----------------------------------------------------------------------------------
def test_one_engine_refuses_a_candidate(tmp_path, model_config):
    p = Pool(tmp_path, model_config, n=1)
    champion = p.held(p.engines[0], "1")
    p.store.swap(champion=champion)
    with pytest.raises(EngineRefused, match="FLYWHEEL_REPLICA_VLLM_ENGINES=2"):
        p.load("candidate", "2")
    assert p.engines[0].calls == [] and p.engines[0].lv is champion
    assert p.store.snapshot().champion is champion


def test_one_engine_replaces_the_champion_in_place_and_restores_it_on_a_mismatch(
    tmp_path, model_config
):
    p = Pool(tmp_path, model_config, n=1)
    champion = p.held(p.engines[0], "1")
    p.store.swap(champion=champion)
    p.engines[0].corrupt = 1
    with pytest.raises(VerificationError):
        p.load("champion", "2")
    assert p.engines[0].calls[0]["serving"].champion is None  # nothing served while it changed
    assert p.store.snapshot().champion is champion and p.engines[0].lv is champion
    lv = p.load("champion", "3")
    assert p.engines[0].lv is lv and p.store.snapshot().champion is None  # the sync publishes it
    assert not p.pool.usable(champion)


# --- what the engine refuses ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"type": "moe-byte"}, "'moe-byte' policy; the vLLM engine serves Hugging Face"),
        ({"lora": {"r": 4, "alpha": 8}}, "LoRA adapter; the vLLM engine serves full weights"),
        ({"files_sha256": "0" * 64}, "other model files"),
    ],
    ids=["builtin", "lora", "other-files"],
)
def test_the_engine_refuses_what_it_cannot_serve(tmp_path, model_config, overrides, why):
    p = Pool(tmp_path, model_config)
    with pytest.raises(EngineRefused, match=why):
        p.load("champion", "1", **overrides)
    assert all(e.calls == [] and e.lv is None for e in p.engines)


# --- generation through a held version ------------------------------------------------------------
def test_a_policy_generates_through_its_engine_only_while_the_engine_holds_its_version(
    tmp_path, model_config
):
    p = Pool(tmp_path, model_config)
    lv = p.held(p.engines[0], "1")
    tok = lv.policy.tokenizer
    e = p.engines[0]
    e.script = ([[5, tok.eos_id], [6, 7]], [[-0.1, -0.2], [-1.0 / 3, -0.5]], ["stop", None], True)
    out = lv.policy.generate([[1, 2], [3]], max_tokens=4, temperature=1.0)
    assert e.prompts == [[tok.start_id, 1, 2], [tok.start_id, 3]]
    assert [s.meta["finish_reason"] for s in out] == ["eos", "stopped"]
    assert out[1].logprobs[0] == float(torch.tensor(-1.0 / 3, dtype=torch.float32))
    assert all(s.meta["kernels"] == "vllm" and s.routes is None for s in out)
    p.store.swap(champion=p.held(p.engines[1], "5"))
    p.load("candidate", "2")  # engine 0 does not hold the champion: v2 replaces v1 there
    assert e.lv.version == "2"
    with pytest.raises(EngineUnavailable, match="no longer holds v1"):
        lv.policy.generate([[1]], max_tokens=4)


# --- leases ---------------------------------------------------------------------------------------
def test_hold_gives_a_lease_while_the_store_serves_the_version_and_none_after(tmp_path):
    from tests.unit.replica.conftest import tiny_state

    _, state = tiny_state(0)
    lv = LoadedVersion("1", None, state, checkpoint_sha256(state), {})
    store = WeightStore(Serving(champion=lv))
    lease = store.hold(lv)
    assert lease is not None and lv.leases.count == 1
    lease.release()
    lease.release()  # idempotent
    assert lv.leases.count == 0
    store.swap(champion=None)
    assert store.hold(lv) is None and lv.leases.count == 0  # the lease taken to check is returned


def test_wait_idle_returns_once_every_lease_is_released():
    leases = Leases()
    assert leases.wait_idle(0)
    a, b = leases.acquire(), leases.acquire()
    assert leases.count == 2 and not leases.wait_idle(0.05)
    a.release()
    assert not leases.wait_idle(0.05)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("idle", leases.wait_idle(WAIT_S)))
    t.start()
    b.release()
    t.join(WAIT_S)
    assert result == {"idle": True} and leases.count == 0
    b.release()
    assert leases.count == 0


# --- routed experts (vLLM returns them only with Model Runner V2, i.e. on GPU) --------------------
def test_completion_routes_take_the_positions_that_produced_the_completion_tokens():
    """vLLM's `routed_experts` covers every forwarded position [prompt + completion - 1, L, k]; the
    completion token j was produced by the forward of position prompt_len - 1 + j. The payload is
    built here as vLLM's serving code does (numpy `.npy`, base64): no GPU runs here."""
    import base64
    import io

    import numpy as np

    from app.replica.engines.vllm import completion_routes

    prompt_len, n_completion, layers, k = 5, 3, 2, 2
    positions = prompt_len + n_completion - 1
    arr = np.arange(positions * layers * k, dtype=np.uint8).reshape(positions, layers, k)
    buf = io.BytesIO()
    np.save(buf, arr)
    b64 = base64.b64encode(buf.getvalue()).decode()
    got = completion_routes(b64, prompt_len, n_completion)
    assert got.dtype == np.int32 and got.shape == (n_completion, layers, k)
    assert np.array_equal(got, arr[prompt_len - 1 :].astype(np.int32))
    with pytest.raises(EngineUnavailable, match="forwarded positions expected"):
        completion_routes(b64, prompt_len, n_completion + 1)


def test_vllms_top_logprobs_become_the_k_most_likely_ids_as_the_builtin_engine_gives_them():
    """vLLM's map of one position (the k alternatives and the sampled token, keyed
    `token_id:<id>` with `return_tokens_as_token_ids`) -> k (id, log-prob), most likely first,
    ties by the lower id; a position without the map or with a text key is the engine's fault."""
    from app.replica.engines.base import EngineUnavailable
    from app.replica.engines.vllm import alternatives

    step = {"token_id:7": -0.5, "token_id:3": -1.25, "token_id:2": -1.25, "token_id:9": -3.0}
    assert alternatives(step, 3) == [(7, -0.5), (2, -1.25), (3, -1.25)]
    assert alternatives(step, 5) == [(7, -0.5), (2, -1.25), (3, -1.25), (9, -3.0)]
    for bad in (None, {}, {"hello": -1.0}):
        with pytest.raises(EngineUnavailable):
            alternatives(bad, 2)


# --- constrained decoding (tool calls) -------------------------------------------------------------
def _call_grammar() -> str:
    from policy.constrain import tool_call_grammar

    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}},
                    "required": ["path"],
                },
            },
        }
    ]
    return tool_call_grammar(tools, None, False)


def test_a_constrained_generation_sends_the_grammar_and_replays_vllms_tokens_through_it(
    tmp_path, model_config
):
    """The constraint's grammar text goes to vLLM (structured outputs); the tokens that come back
    advance the constraint's own matchers: a valid call passes, a token the grammar refuses (here
    eos before the call is complete) is the engine's fault, never a call handed to the client."""
    from policy.constrain import compile_grammar

    p = Pool(tmp_path, model_config)
    lv = p.held(p.engines[0], "1")
    tok, e = lv.policy.tokenizer, p.engines[0]
    compiled = compile_grammar(tok, _call_grammar())
    call = tok.encode(
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    )
    e.script = ([[*call, tok.eos_id]], [[-0.5] * (len(call) + 1)], ["stop"], False)
    [out] = lv.policy.generate([[1, 2]], max_tokens=200, constraint=compiled.start(1))
    assert e.grammar == compiled.grammar and out.meta["finish_reason"] == "eos"
    e.script = ([call[:5] + [tok.eos_id]], [[-0.5] * 6], ["stop"], False)
    with pytest.raises(EngineUnavailable, match="outside the tool-call grammar"):
        lv.policy.generate([[1, 2]], max_tokens=200, constraint=compiled.start(1))
    lv.policy.generate([[1, 2]], max_tokens=4)
    assert e.grammar is None  # no constraint, no grammar


def test_the_servers_run_structured_outputs_by_llguidance():
    from app.replica.engines.vllm import server_args

    args = server_args(Path("/m"), 8000, 256, [])
    at = args.index("--structured-outputs-config.backend")
    assert args[at + 1] == "guidance"


def _engine_answering(monkeypatch, handler) -> VLLMEngine:
    """A VLLMEngine whose HTTP client is answered by `handler` (httpx.MockTransport)."""
    import httpx

    e = VLLMEngine(0, "http://vllm.test")
    monkeypatch.setattr(
        e,
        "_client",
        lambda timeout=600.0: httpx.Client(
            base_url=e.url, transport=httpx.MockTransport(handler), timeout=timeout
        ),
    )
    return e


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


def test_the_grammar_travels_as_structured_outputs_and_a_refusal_says_why(monkeypatch):
    """vLLM validates a streamed request after answering 200 and puts its error in the stream: a
    400 there (or as the status) on a constrained request is GrammarRefused with vLLM's reason;
    an error chunk on any request is the engine's failure, never an empty completion."""
    import httpx

    from app.replica.engines.vllm import GrammarRefused

    sent: list[dict] = []
    reply: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(reply["status"], content=reply["body"])

    e = _engine_answering(monkeypatch, handler)
    gen = {"max_tokens": 8, "temperature": 1.0, "seed": 1, "on_step": None}
    ok = {"index": 0, "token_ids": [7], "logprobs": {"token_logprobs": [-0.25]}}
    reply.update(status=200, body=_sse({"choices": [{**ok, "finish_reason": "stop"}]}))
    got = e.generate([[0, 1]], grammar='start: "x"\n', **gen)
    assert got.tokens == [[7]] and got.logprobs == [[-0.25]]
    assert sent[-1]["structured_outputs"] == {"grammar": 'start: "x"\n'}
    e.generate([[0, 1]], **gen)
    assert "structured_outputs" not in sent[-1]

    why = 'Grammar error: at 1(8): unknown name: "foo"'
    refusal = {"error": {"message": why, "type": "BadRequestError", "param": None, "code": 400}}
    reply.update(status=200, body=_sse(refusal))
    with pytest.raises(GrammarRefused, match="unknown name"):
        e.generate([[0, 1]], grammar="start: foo\n", **gen)
    reply.update(status=400, body=json.dumps(refusal).encode())
    with pytest.raises(GrammarRefused, match="unknown name"):
        e.generate([[0, 1]], grammar="start: foo\n", **gen)
    with pytest.raises(EngineUnavailable, match="400") as info:
        e.generate([[0, 1]], **gen)  # not constrained: not a grammar refusal
    assert not isinstance(info.value, GrammarRefused)
    broken = {"error": {"message": "Internal server error", "type": "x", "code": 500}}
    reply.update(status=200, body=_sse({"choices": [ok]}, broken))
    with pytest.raises(EngineUnavailable, match="500 Internal server error") as info:
        e.generate([[0, 1]], grammar="start: foo\n", **gen)
    assert not isinstance(info.value, GrammarRefused)
