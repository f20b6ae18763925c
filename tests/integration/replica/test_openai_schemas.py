"""The replica's OpenAI-compatible responses, stream chunks and errors, as raw JSON from a real
replica (uvicorn, real HTTP), validated against OpenAI's published schemas
(tests/data/openai/openai_schemas.json, with its source; tests/openai_schemas.py)."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.openai_schemas import check, violations

pytestmark = pytest.mark.integration

KEY = "serving-key-schemas"


@pytest.fixture()
def http(seeded_replica):
    srv = seeded_replica(id="replica-schemas", api_key=KEY)
    with httpx.Client(
        base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as client:
        client.model = srv.settings.model_name
        yield client


def _sse(resp: httpx.Response) -> list[dict]:
    """The JSON chunks of a server-sent event stream, which must end with `data: [DONE]`."""
    lines = [ln for ln in resp.text.split("\n") if ln.strip()]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert all(ln.startswith("data: ") for ln in lines), lines
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


def test_the_checker_finds_a_violation():
    """The validation has teeth: a known deviation is reported, with its path."""
    body = {"id": "x", "object": "text_completion", "created": 1, "model": "m"}
    body["choices"] = [
        {
            "index": 0,
            "text": "a",
            "finish_reason": "length",
            "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": None},
        }
    ]
    assert violations("CreateCompletionResponse", body) == [
        "choices/0/logprobs/top_logprobs: None is not of type 'array'"
    ]


def test_models_conform(http):
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    check("ListModelsResponse", r.json())
    r = http.get(f"/v1/models/{http.model}")
    assert r.status_code == 200, r.text
    check("Model", r.json())


@pytest.mark.parametrize("logprobs", [None, 0])
def test_completions_conform(http, logprobs):
    body = {"model": http.model, "prompt": "def add(a, b):", "max_tokens": 8, "n": 2, "seed": 1}
    body["user"] = "schemas-1"
    if logprobs is not None:
        body["logprobs"] = logprobs
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    check("CreateCompletionResponse", r.json())
    assert all((c["logprobs"] is None) == (logprobs is None) for c in r.json()["choices"])


def test_completion_stream_chunks_conform(http):
    """Streamed and whole completions share one schema, whose `finish_reason` is a string. A
    chunk before a choice's last carries `finish_reason: null`, as OpenAI's own API streams it
    (and its clients read it): that one field is checked apart, and the rest of every chunk
    against the schema."""
    body = {"model": http.model, "prompt": "def add(a, b):", "max_tokens": 8, "n": 2, "seed": 1}
    body.update(user="schemas-1", stream=True)
    with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.read()
    assert resp.status_code == 200, resp.text
    chunks = _sse(resp)
    last: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            assert c["index"] not in last, f"a chunk of choice {c['index']} after its last"
            if c["finish_reason"] is None:
                c["finish_reason"] = "length"  # a placeholder: the null is checked apart, here
            else:
                last[c["index"]] = c["finish_reason"]
        check("CreateCompletionResponse", chunk)
    assert sorted(last) == [0, 1], "every choice ends with its finish_reason"


@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_completions_conform(http, logprobs):
    body = {
        "model": http.model,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "def f("},
        ],
        "max_completion_tokens": 8,
        "n": 2,
        "seed": 3,
        "logprobs": logprobs,
        "user": "schemas-2",
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    check("CreateChatCompletionResponse", r.json())


def test_chat_stream_chunks_conform(http):
    body = {
        "model": http.model,
        "messages": [{"role": "user", "content": "def f("}],
        "max_tokens": 8,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "schemas-3",
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.read()
    assert resp.status_code == 200, resp.text
    chunks = _sse(resp)
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "top_p": 0.5}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "bogus": 1}, 400),
        ("POST", "/v1/chat/completions", {"messages": []}, 400),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
        ),
        ("GET", "/v1/models/nope", None, 404),
    ],
)
def test_errors_conform(http, method, path, body, status):
    r = http.request(method, path, json=body)
    assert r.status_code == status, r.text
    check("ErrorResponse", r.json())


def test_a_refused_key_conforms(http):
    r = http.post(
        "/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": "Bearer wrong-key"},
    )
    assert r.status_code == 401, r.text
    check("ErrorResponse", r.json())


def test_top_logprobs_conform_and_rank_the_distribution_sampled_from(http):
    """Completions `logprobs: 3` map the 3 most likely tokens and the sampled one; chat
    `top_logprobs: 5` lists 5, most likely first; the sampled token's log-prob is the same in
    both places; asking for alternatives changes nothing that is sampled."""
    common = {"model": http.model, "max_tokens": 6, "seed": 11, "user": "schemas-top"}
    plain = http.post("/v1/completions", json={**common, "prompt": "def f(", "logprobs": 0})
    rich = http.post("/v1/completions", json={**common, "prompt": "def f(", "logprobs": 3})
    assert plain.status_code == rich.status_code == 200, rich.text
    check("CreateCompletionResponse", rich.json())
    p, r = plain.json()["choices"][0], rich.json()["choices"][0]
    assert (
        p["text"] == r["text"]
        and p["logprobs"]["token_logprobs"] == r["logprobs"]["token_logprobs"]
    )
    lp = r["logprobs"]
    for token, token_lp, top, alone in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], p["logprobs"]["top_logprobs"]
    ):
        assert alone == {token: token_lp}  # logprobs 0: the sampled token alone
        # keyed by text, as OpenAI keys them: byte tokens of a partial UTF-8 character all read
        # as U+FFFD and share one key (the likelier one's log-prob)
        assert len(top) <= 4 and top[token] >= token_lp
        if token != "\ufffd":
            assert top[token] == token_lp
        assert len(top) >= 3 or "\ufffd" in top, top
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5

    messages = [{"role": "user", "content": "def f("}]
    chat = http.post(
        "/v1/chat/completions",
        json={**common, "messages": messages, "logprobs": True, "top_logprobs": 5},
    )
    assert chat.status_code == 200, chat.text
    check("CreateChatCompletionResponse", chat.json())
    for item in chat.json()["choices"][0]["logprobs"]["content"]:
        alts = [a["logprob"] for a in item["top_logprobs"]]
        assert len(alts) == 5 and alts == sorted(alts, reverse=True)
        assert item["logprob"] <= alts[0]
