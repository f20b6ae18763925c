"""Tool calling on a real replica (uvicorn, real HTTP, the real broker): OpenAI's `tools`,
`tool_choice` and tool messages on POST /v1/chat/completions, on the built-in policy and on a
Hugging Face model rendered by Qwen2.5's own chat template.

Both models are untrained: a `required` or named `tool_choice` must still yield calls whose
arguments validate against the function's schema (constrained decoding, policy/constrain.py).
Every response and stream chunk is validated against OpenAI's published schemas, the generation
events are read back from `<ns>.interactions`, and every bad tool request is a 400 naming the
parameter."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.integration.replica.conftest import metric, read_topic
from tests.openai_schemas import check

pytestmark = pytest.mark.integration

KEY = "serving-key-tools"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 12}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "apply_edit",
            "description": "Replace `old` by `new` in a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "maxLength": 12},
                    "old": {"type": "string", "maxLength": 12},
                    "new": {"type": "string", "maxLength": 12},
                    "count": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["path", "old", "new"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "run_tests"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
USER = [{"role": "user", "content": "The test of add() fails. Fix it."}]


def _client(srv) -> httpx.Client:
    client = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    client.model = srv.settings.model_name
    return client


@pytest.fixture()
def builtin_replica(seeded_replica):
    """Start a replica serving the tiny untrained built-in policy with a context (2048 bytes) that
    holds the tools, a call and a tool result; keyword arguments are ReplicaConfig fields."""

    def _start(**config: Any):
        config = {"id": "replica-tools", "api_key": KEY, "max_tokens": 600, "max_n": 2, **config}
        return seeded_replica(max_context=2048, **config)

    return _start


@pytest.fixture()
def srv(builtin_replica):
    return builtin_replica(max_tools=8, max_tools_bytes=4096)


@pytest.fixture()
def http(srv):
    with _client(srv) as client:
        yield client


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    body = {"model": http.model, "messages": USER, "user": "tools-1", "max_tokens": 600, **body}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    check("CreateChatCompletionResponse", r.json())
    return r.json()


def assert_valid_calls(message: dict[str, Any], names: set[str]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    assert calls, f"no tool calls in {message}"
    for call in calls:
        fn = call["function"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert fn["name"] in names, fn
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
    return calls


@pytest.mark.parametrize("parallel", [False, True])
def test_required_makes_an_untrained_model_call_a_listed_tool_with_valid_arguments(http, parallel):
    for seed in range(3):
        body = chat(
            http, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, seed=seed
        )
        choice = body["choices"][0]
        calls = assert_valid_calls(choice["message"], set(SCHEMAS))
        if parallel and choice["finish_reason"] == "length":
            # an untrained model may go on calling until max_tokens: the calls it completed are
            # returned, the one it had not closed stays content
            assert choice["message"]["content"].startswith("<tool_call>")
            continue
        assert choice["finish_reason"] == "tool_calls", choice
        assert parallel or len(calls) == 1
        assert choice["message"]["content"] is None


def test_a_named_tool_choice_calls_exactly_that_function(http):
    named = {"type": "function", "function": {"name": "apply_edit"}}
    body = chat(http, tools=TOOLS, tool_choice=named, seed=4, n=2, temperature=1.5)
    for choice in body["choices"]:
        calls = assert_valid_calls(choice["message"], {"apply_edit"})
        assert len(calls) == 1


def _stream(http: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    body = {"model": http.model, "messages": USER, "user": "tools-1", "max_tokens": 600, **body}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        resp.read()
    assert resp.status_code == 200, resp.text
    lines = [ln for ln in resp.text.split("\n") if ln.strip()]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    return chunks


def test_a_streamed_call_arrives_as_openai_deltas_and_equals_the_answer(http):
    """The same seed streamed and not: the deltas (index, id, type and name first, then the
    arguments) add up to the same calls as the JSON answer."""
    args = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "seed": 7}
    whole = chat(http, **args)["choices"][0]
    chunks = _stream(http, **args)
    calls: dict[int, dict[str, Any]] = {}
    reasons = []
    for chunk in chunks:
        for c in chunk["choices"]:
            reasons.append(c["finish_reason"])
            for d in c["delta"].get("tool_calls") or []:
                if d["index"] not in calls:
                    assert d["id"] and d["type"] == "function" and d["function"]["name"], d
                    calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
                calls[d["index"]]["arguments"] += d["function"].get("arguments", "")
    assert reasons[-1] == "tool_calls"
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    want = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in whole["message"]["tool_calls"]
    ]
    assert got == want


def two_turns(http: httpx.Client, user: str, result: str, **second: Any) -> tuple[dict, dict]:
    """Turn 0 calls a tool (required, one call); turn 1 sends `result` back as its tool message."""
    first = chat(
        http, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=3, user=user
    )
    [call] = first["choices"][0]["message"]["tool_calls"]
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ]
    return first, chat(http, tools=TOOLS, messages=history, seed=3, user=user, **second)


def turn_events(srv, first: dict, second: dict) -> tuple[dict, dict]:
    """The two turns' generation events, checked: the session, the turns, the tools' digest, the
    tool choice, the constraint and the call as the client got it."""
    ids = {first["id"], second["id"]}
    events = read_topic(srv.settings, "interactions", 2, where=lambda e: e.get("request_id") in ids)
    by_id = {e["request_id"]: e for e in events}
    e0, e1 = by_id[first["id"]], by_id[second["id"]]
    assert (e0["turn"], e1["turn"]) == (0, 1) and e0["session_id"] == e1["session_id"]
    assert e0["tools_digest"] == e1["tools_digest"] and len(e0["tools_digest"]) == 64
    assert (e0["tool_choice"], e0["constrained"]) == ("required", True)
    assert (e1["tool_choice"], e1["constrained"]) == ("auto", False)
    assert e0["finish_reason"] == "tool_calls"
    call = first["choices"][0]["message"]["tool_calls"][0]
    rec = e0["tool_calls"][0]
    assert (rec["id"], rec["name"], rec["arguments"], rec["arguments_valid"]) == (
        call["id"],
        call["function"]["name"],
        call["function"]["arguments"],
        True,
    )
    return e0, e1


def test_the_generation_events_record_the_turns_calls_and_constraint(srv, http):
    """Turn 0 calls a tool; turn 1 sends its result back: both events name the session, their
    turn, the tools' digest, the tool choice and the calls; the result is in turn 1's prompt."""
    first, second = two_turns(http, "tools-session", "RESULT-OF-THE-TOOL")
    e0, e1 = turn_events(srv, first, second)
    assert e0["session_id"] == "tools-session"
    # the call sent back renders exactly what was generated: turn 1's prompt extends turn 0's
    # prompt and completion (its eos aside), as the next issue's session ledger needs
    done = e0["prompt_tokens"] + e0["completion_tokens"][:-1]
    assert e1["prompt_tokens"][: len(done)] == done
    prompt = bytes(t for t in e1["prompt_tokens"] if t < 256).decode()
    assert "tool: RESULT-OF-THE-TOOL\n" in prompt and prompt.startswith("tools: read_file(path); ")
    assert metric(srv, "flywheel_replica_tool_calls_total", outcome="valid") >= 1
    assert metric(srv, "flywheel_replica_constrained_total", choice="required") >= 1


def test_auto_on_an_untrained_model_answers_with_text_and_records_no_constraint(srv, http):
    body = chat(http, tools=TOOLS, seed=5, max_tokens=24)
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert isinstance(choice["message"]["content"], str)
    assert "tool_calls" not in choice["message"]
    [event] = read_topic(
        srv.settings, "interactions", 1, where=lambda e: e.get("request_id") == body["id"]
    )
    assert (event["tool_choice"], event["constrained"], event["tool_calls"]) == ("auto", False, [])


ANSWERED = {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown named function",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}},
        "tool_choice",
    ),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("too many tools", {"tools": [TOOLS[2]] * 9}, "tools"),
    (
        "tools too large",
        {"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "x" * 5000}}]},
        "tools",
    ),
    (
        "a function offered twice",
        {"tools": [TOOLS[0], TOOLS[0]]},
        "tools.[1].function.name",
    ),
    (
        "not a JSON Schema",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "tools.[0].function.parameters",
    ),
    (
        "parameters that are not an object schema",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools.[0].function.parameters",
    ),
    (
        "a schema the constraint engine cannot compile",
        {
            "tools": [
                TOOLS[0],
                {
                    "type": "function",
                    "function": {
                        "name": "g",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"$ref": "#/$defs/missing"}},
                        },
                    },
                },
            ],
            "tool_choice": "required",
        },
        "tools.[1].function.parameters",
    ),
    (
        "a bad function name",
        {"tools": [{"type": "function", "function": {"name": "rm -rf"}}]},
        "tools.[0].function.name",
    ),
    (
        "a tool message answering no call",
        {"messages": [*USER, {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
        "messages.[1].tool_call_id",
    ),
    (
        "a tool call answered twice",
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [ANSWERED]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                {"role": "tool", "tool_call_id": "c1", "content": "again"},
            ]
        },
        "messages.[3].tool_call_id",
    ),
    (
        "arguments in the history that are not JSON",
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {**ANSWERED, "function": {"name": "run_tests", "arguments": "{oops"}}
                    ],
                },
            ]
        },
        "messages.[1].tool_calls.[0].function.arguments",
    ),
    (
        "an assistant message with neither content nor calls",
        {"messages": [*USER, {"role": "assistant"}]},
        "messages.[1].content",
    ),
    (
        "an image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages.[0].content",
    ),
]


@pytest.mark.parametrize("why, extra, param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_tool_request_is_a_400_naming_the_parameter(http, why, extra, param):
    body = {"model": http.model, "messages": USER, "user": "tools-1", "max_tokens": 8, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, (why, r.status_code, r.text)
    check("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param, (why, r.json())


def test_a_grammar_over_the_compile_bound_is_a_400_not_a_pinned_cpu(builtin_replica):
    srv = builtin_replica(id="replica-tools-fuel", grammar_compile_fuel=1000)
    with _client(srv) as http:
        ids = {"type": "string", "enum": [f"value-{i}" for i in range(200)]}
        params = {"type": "object", "properties": {"id": ids}, "required": ["id"]}
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": params}}]
        body = {"model": http.model, "messages": USER, "user": "s", "tools": tools}
        r = http.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
        assert r.status_code == 400, r.text
        check("ErrorResponse", r.json())
        assert r.json()["error"]["param"] == "tools.[0].function.parameters", r.json()
        assert "constrained decoding cannot enforce the tools" in r.json()["error"]["message"]
        chat(http, tools=TOOLS, max_tokens=8)  # auto needs no grammar


def test_a_chat_with_tools_that_does_not_fit_the_context_is_refused_not_cut(http):
    long = [{"role": "user", "content": "x" * 1900}]
    body = {"model": http.model, "messages": long, "user": "s", "max_tokens": 100}
    r = http.post("/v1/chat/completions", json={**body, "tools": TOOLS})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded"), err
    assert "tool definitions would be lost" in err["message"]
    assert http.post("/v1/chat/completions", json=body).status_code == 200  # no tools: its end


def test_a_model_without_a_tool_format_refuses_tools(hf_replica):
    srv = hf_replica("plain")
    with _client(srv) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": http.model, "messages": USER, "user": "s", "tools": TOOLS},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert "no tool-call format" in r.json()["error"]["message"]
        chat(http)  # without tools it still chats


def test_a_hugging_face_model_calls_tools_in_its_own_template_format(hf_replica):
    """A tiny Llama with Qwen2.5's chat template: the prompt is that template rendered with the
    tools (and the history's calls and results), and required / named choices yield valid calls
    through its BPE tokenizer."""
    srv = hf_replica("qwen2.5")
    with _client(srv) as http:
        first = chat(http, tools=TOOLS, tool_choice="required", seed=1, user="hf-tools")
        [call] = assert_valid_calls(first["choices"][0]["message"], set(SCHEMAS))[:1]
        named = {"type": "function", "function": {"name": "read_file"}}
        assert_valid_calls(
            chat(http, tools=TOOLS, tool_choice=named, seed=2)["choices"][0]["message"],
            {"read_file"},
        )
        history = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "HF-TOOL-RESULT"},
        ]
        second = chat(http, tools=TOOLS, messages=history, seed=3, user="hf-tools")
    [event] = read_topic(
        srv.settings, "interactions", 1, where=lambda e: e.get("request_id") == second["id"]
    )
    tok = srv.replica.store.snapshot().champion.policy.tokenizer
    prompt = tok.decode(event["prompt_tokens"])
    assert "<tools>" in prompt and '"name": "read_file"' in prompt
    assert "<tool_response>\nHF-TOOL-RESULT\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and event["turn"] == 1


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Any]:
    """Tiny Llama directories (tests/hf_models.py): one whose tokenizer has Qwen2.5's template
    (tools), one with a plain template (no tool format)."""
    from tests.hf_models import QWEN25_TEMPLATE, tiny_llama_dir, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("hf-tools")
    out = {}
    for name, template in (("qwen2.5", QWEN25_TEMPLATE), ("plain", None)):
        kw = {} if template is None else {"chat_template": template}
        tok = train_bpe_tokenizer(root / f"tok-{name}", **kw)
        out[name] = tiny_llama_dir(root / f"llama-{name}", tok, max_positions=2048)
    return out


@pytest.fixture()
def hf_replica(replica_factory, make_settings, tmp_path, hf_dirs):
    """Start a replica (no sync agent) that serves a tiny HF Llama as version 1 from its verified
    cache."""
    from app.replica.weights import WeightCache, load_verified
    from kernels.delta.hashing import checkpoint_sha256
    from policy import build_policy

    def _start(which: str):
        cfg = {"type": "hf", "model_dir": str(hf_dirs[which]), "max_context": 2048}
        state = build_policy(cfg).serving_state_dict()
        cache = WeightCache(tmp_path / f"hf-{which}")
        cache.put(load_verified("1", state, cfg, checkpoint_sha256(state)))
        cache.set_serving(cache.restore())
        return replica_factory(
            make_settings(),
            start_sync=False,
            cache_dir=tmp_path / f"hf-{which}",
            id=f"replica-hf-{which}",
            api_key=KEY,
            max_tokens=600,
            max_n=2,
        )

    return _start
