"""The OpenAI-compatible API of a real replica (uvicorn, real HTTP) on the real broker, driven by the
official `openai` Python package: completions and chat, n > 1, stop strings, log-probs, streaming
(chunks reassembled and compared with the generation events read back from Kafka, and with a
non-streamed generation of the same seed, bit for bit), errors as the client's exceptions with
`.param`, and a client that disconnects mid-stream (one event, `finish_reason: "cancelled"`)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.integration.replica.conftest import HeldThread, metric, read_topic, wait_for

pytestmark = pytest.mark.integration

KEY = "serving-key-1"


@pytest.fixture()
def srv(seeded_replica):
    """A replica (no sync agent) serving tiny version 7, with a serving key."""
    return seeded_replica(id="replica-oai", api_key=KEY)


def _client(srv, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=60, **kw)


def _events(srv, ids: list[str]) -> dict[str, dict]:
    got = read_topic(
        srv.settings, "interactions", len(ids), where=lambda e: e.get("request_id") in ids
    )
    by_id = {e["request_id"]: e for e in got}
    assert sorted(by_id) == sorted(ids) and len(got) == len(ids), "one event per choice"
    return by_id


def _decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def test_models_completions_and_chat_with_the_python_client(srv):
    client = _client(srv)
    name = srv.settings.model_name
    assert [m.id for m in client.models.list()] == [name]
    assert client.models.retrieve(name).id == name

    raw = client.completions.with_raw_response.create(
        model=name, prompt="def add(a, b):", max_tokens=10, n=3, user="sess-oai-1", logprobs=0
    )
    assert (
        raw.headers["x-flywheel-model-version"] == "7"
        and raw.headers["x-flywheel-slot"] == "champion"
    )
    out = raw.parse()
    assert out.object == "text_completion" and out.system_fingerprint == "flywheel-v7"
    ids = [c.model_extra["request_id"] for c in out.choices]
    assert len(set(ids)) == 3 and out.id not in ids
    events = _events(srv, ids)
    for c, rid in zip(out.choices, ids):
        e = events[rid]
        assert (
            e["group_id"] == out.id
            and e["session_id"] == "sess-oai-1"
            and e["model_version"] == "7"
        )
        assert e["stream"] is False and e["finish_reason"] == c.finish_reason in ("stop", "length")
        assert e["prompt_tokens"] == list(b"def add(a, b):")
        assert _decode(e["completion_tokens"]) == c.text
        assert c.logprobs.token_logprobs == e["logprobs"]  # the behaviour log-probs, exactly
    assert out.usage.completion_tokens == sum(len(e["completion_tokens"]) for e in events.values())

    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        max_tokens=8,
        user="sess-oai-2",
        logprobs=True,
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    e = _events(srv, [chat.id])[chat.id]
    assert e["prompt_tokens"] == list(b"system: Be brief.\nuser: hi\nassistant: ")
    assert _decode(e["completion_tokens"]) == chat.choices[0].message.content
    assert [t.logprob for t in chat.choices[0].logprobs.content] == e["logprobs"]

    # the session may come as a header instead of `user`
    hdr = _client(srv, default_headers={"X-Flywheel-Session": "sess-hdr"})
    got = hdr.completions.create(model=name, prompt="x", max_tokens=2)
    assert _events(srv, [got.id])[got.id]["session_id"] == "sess-hdr"


def test_the_group_header_groups_parallel_sessions_and_pins_their_slot(srv):
    """X-Flywheel-Group: attempts at one task in parallel sessions share a `group_id` (the
    trainer's group baseline) and one slot, whatever their sessions hash to; n > 1 without it
    stays grouped by the top-level id; a bad header is a 400 naming it."""
    name = srv.settings.model_name
    champion = srv.replica.store.snapshot().champion
    srv.replica.store.swap(candidate=champion, traffic_pct=50.0)  # a canary, same weights
    client = _client(srv)
    users = [f"sess-par-{i}" for i in range(12)]

    def ask(user: str, **kw):
        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, user=user, **kw
        )
        return raw.headers["x-flywheel-slot"], raw.parse()

    alone = {ask(u)[0] for u in users}
    assert alone == {"champion", "candidate"}, "ungrouped, the sessions split over both slots"
    grouped = [ask(u, extra_headers={"X-Flywheel-Group": "task-17"}) for u in users]
    assert len({slot for slot, _ in grouped}) == 1, "a group meets one slot"
    events = _events(srv, [out.id for _, out in grouped])
    assert {e["group_id"] for e in events.values()} == {"task-17"}
    assert sorted(e["session_id"] for e in events.values()) == sorted(users)

    _, two = ask("sess-par-n", n=2, extra_headers={"X-Flywheel-Group": "task-18"})
    ids = [c.model_extra["request_id"] for c in two.choices]
    assert {e["group_id"] for e in _events(srv, ids).values()} == {"task-18"}
    _, plain = ask("sess-par-n", n=2)
    ids = [c.model_extra["request_id"] for c in plain.choices]
    assert {e["group_id"] for e in _events(srv, ids).values()} == {plain.id}

    with pytest.raises(openai.BadRequestError) as bad:
        ask("sess-par-x", extra_headers={"X-Flywheel-Group": "g" * 129})
    assert "x-flywheel-group header must be 1..128 characters" in str(bad.value)
    assert "group id" in str(bad.value)


def test_a_stop_string_ends_the_text_before_it_and_the_event_keeps_the_tokens_generated(srv):
    client = _client(srv)
    name = srv.settings.model_name
    for seed in range(40):  # find a seeded completion with an ASCII letter to stop at
        full = client.completions.create(
            model=name, prompt="def f(", max_tokens=20, seed=seed, user="s-stop", temperature=1.0
        )
        text = full.choices[0].text
        k = next((i for i, ch in enumerate(text) if i >= 2 and ch.isascii() and ch.isalnum()), None)
        if k is not None and text.find(text[k]) == k:
            break
    else:
        raise AssertionError("no seeded completion had a character to stop at")
    stop = text[k]
    got = client.completions.create(
        model=name,
        prompt="def f(",
        max_tokens=20,
        seed=seed,
        user="s-stop",
        stop=[stop, "\x00never"],
    )
    c = got.choices[0]
    assert c.text == text[:k] and c.finish_reason == "stop"
    e = _events(srv, [got.id])[got.id]
    full_e = _events(srv, [full.id])[full.id]
    n = len(e["completion_tokens"])
    assert n < len(full_e["completion_tokens"]) and e["finish_reason"] == "stop"
    assert e["completion_tokens"] == full_e["completion_tokens"][:n]  # same seed: a prefix
    assert e["logprobs"] == full_e["logprobs"][:n]
    assert _decode(e["completion_tokens"]).endswith(stop)

    # streamed, the stop string is held back and never sent; the event is the same
    chunks = list(
        client.completions.create(
            model=name,
            prompt="def f(",
            max_tokens=20,
            seed=seed,
            user="s-stop",
            stop=stop,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"
    se = _events(srv, [chunks[0].id])[chunks[0].id]
    assert se["completion_tokens"] == e["completion_tokens"] and se["logprobs"] == e["logprobs"]
    assert se["stream"] is True and se["finish_reason"] == "stop"


def test_streams_reassemble_to_the_events_and_equal_an_unstreamed_generation_bit_for_bit(srv):
    client = _client(srv)
    name = srv.settings.model_name
    kw = {
        "model": name,
        "prompt": "class A:",
        "max_tokens": 24,
        "n": 2,
        "seed": 1234,
        "user": "s-stream",
    }
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    texts, reasons, rids = ["", ""], [None, None], [None, None]
    for ch in chunks[:-1]:
        assert ch.object == "text_completion" and ch.id == chunks[0].id
        for c in ch.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
            rids[c.index] = c.model_extra["request_id"]
    plain = client.completions.create(**kw)
    streamed_e = _events(srv, rids)
    plain_e = _events(srv, [c.model_extra["request_id"] for c in plain.choices])
    for i, c in enumerate(plain.choices):
        s, p = streamed_e[rids[i]], plain_e[c.model_extra["request_id"]]
        assert s["stream"] is True and p["stream"] is False
        assert s["group_id"] == chunks[0].id
        assert texts[i] == c.text == _decode(s["completion_tokens"])
        assert reasons[i] == c.finish_reason == s["finish_reason"] == p["finish_reason"]
        assert s["completion_tokens"] == p["completion_tokens"] and s["logprobs"] == p["logprobs"]
        assert s["routes"] == p["routes"]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens

    chat_chunks = list(
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=12,
            user="s-stream",
            stream=True,
        )
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chat_chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chat_chunks)
    final = chat_chunks[-1].choices[0]
    assert final.finish_reason in ("stop", "length")
    e = _events(srv, [chat_chunks[0].id])[chat_chunks[0].id]
    assert e["stream"] is True and e["finish_reason"] == final.finish_reason
    assert _decode(e["completion_tokens"]) == content


def test_refusals_are_openai_errors_naming_the_parameter(srv):
    client = _client(srv)
    name = srv.settings.model_name
    base = {"model": name, "prompt": "x", "max_tokens": 4, "user": "s-err"}
    cases = [
        ({"top_p": 0.5}, "top_p"),
        ({"logit_bias": {"65": 3}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"echo": True}, "echo"),
        ({"presence_penalty": 0.3}, "presence_penalty"),
        ({"logprobs": 6}, "logprobs"),  # at most 5 alternatives, as OpenAI
        ({"n": 9}, "n"),
        ({"max_tokens": 257}, "max_tokens"),
        ({"max_tokens": 64}, "max_tokens"),  # over the model's context
        ({"temperature": 0.001}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"user": None}, "user"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(**{**base, **extra})
        assert exc.value.param == param, (extra, exc.value.body)
        assert exc.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "x"}],
            user="s",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
        )
    assert exc.value.param == "tools.[0].function.parameters"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=name, messages=[{"role": "tool", "content": "x", "tool_call_id": "c"}], user="s"
        )
    assert exc.value.param == "messages.[0].tool_call_id"
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(**{**base, "model": "gpt-4o"})
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    with pytest.raises(openai.AuthenticationError) as exc:
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).completions.create(
            **base
        )
    assert exc.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
    # nothing refused was generated; the replica still serves
    ok = client.completions.create(**base)
    assert len(_events(srv, [ok.id])) == 1
    assert metric(
        srv, "flywheel_replica_openai_requests_total", endpoint="completions", outcome="invalid"
    ) >= len(cases)


def _gate_generation(srv) -> threading.Event:
    """Hold the replica's real generation at its first step until the returned event is set (the
    model still generates; only its pace is the test's), so a disconnect lands mid-generation."""
    gate = threading.Event()
    replica = srv.replica
    real = type(replica)._generate.__get__(replica)

    def gated(lv, prompt, n, max_tokens, temperature, seed=None, on_step=None, *rest):
        def step(i, tokens):
            if i == 0:
                assert gate.wait(60), "the test never released the generation"
            return on_step(i, tokens)

        return real(lv, prompt, n, max_tokens, temperature, seed, step, *rest)

    replica._generate = gated
    return gate


def _cancelled(srv, recorded: str) -> float:
    return metric(
        srv, "flywheel_replica_streams_cancelled_total", replica_id=srv.config.id, recorded=recorded
    )


def test_a_client_that_disconnects_mid_stream_gets_one_cancelled_event(srv):
    gate = _gate_generation(srv)
    before = _cancelled(srv, "yes")
    body = {
        "model": srv.settings.model_name,
        "messages": [{"role": "user", "content": "write a long story"}],
        "max_tokens": 40,
        "user": "s-cancel",
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{srv.url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
            first = next(r.iter_lines())
            assert first.startswith("data: ") and '"role":"assistant"' in first
            import json

            group = json.loads(first[len("data: ") :])["id"]
        # the response is closed: the replica notices, then the generation may go on
    wait_for(
        lambda: metric(srv, "flywheel_replica_streams_open", replica_id=srv.config.id) == 0,
        30,
        "the stream to close",
    )
    gate.set()
    events = read_topic(
        srv.settings, "interactions", 1, where=lambda e: e.get("session_id") == "s-cancel"
    )
    assert len(events) == 1 and events[0]["request_id"] == group
    e = events[0]
    assert e["finish_reason"] == "cancelled" and e["stream"] is True
    assert 1 <= len(e["completion_tokens"]) < 40
    wait_for(lambda: _cancelled(srv, "yes") == before + 1, 30, "the cancelled stream to be counted")


def test_a_stream_cancelled_before_its_first_token_writes_no_event(srv):
    body = {
        "model": srv.settings.model_name,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8,
        "user": "s-cancel-early",
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    before = _cancelled(srv, "no")
    with HeldThread(srv):  # the generation thread is busy: the stream waits in the queue
        with httpx.Client(timeout=60) as http:
            with http.stream(
                "POST", f"{srv.url}/v1/chat/completions", json=body, headers=headers
            ) as r:
                assert r.status_code == 200
                assert '"role":"assistant"' in next(r.iter_lines())
        wait_for(
            lambda: metric(srv, "flywheel_replica_streams_open", replica_id=srv.config.id) == 0,
            30,
            "the stream to close",
        )
    wait_for(
        lambda: _cancelled(srv, "no") == before + 1,
        30,
        "the stream cancelled before generating to be counted",
    )
    # a later request's event arrives, the cancelled one never does
    ok = _client(srv).completions.create(
        model=srv.settings.model_name, prompt="y", max_tokens=2, user="s-after"
    )
    seen = read_topic(srv.settings, "interactions", 1, where=lambda e: e.get("request_id") == ok.id)
    assert len(seen) == 1
    early = read_topic(
        srv.settings,
        "interactions",
        1,
        timeout_s=3,
        where=lambda e: e["session_id"] == "s-cancel-early",
    )
    assert early == []


def test_kafka_not_acknowledging_is_a_503_or_an_error_chunk_in_place_of_done(
    replica_factory, make_settings, tmp_path
):
    from app.replica.weights import WeightCache, load_verified
    from kernels.delta.hashing import checkpoint_sha256
    from tests.conftest import free_port
    from tests.integration.replica.conftest import tiny_state

    cfg, state = tiny_state(3)
    cache = WeightCache(tmp_path / "c-nokafka")
    cache.put(load_verified("3", state, cfg, checkpoint_sha256(state)))
    dead = make_settings(
        create_topics=False, kafka_bootstrap=f"127.0.0.1:{free_port()}", kafka_produce_timeout=1.0
    )
    srv = replica_factory(
        dead, start_sync=False, cache_dir=tmp_path / "c-nokafka", id="replica-oai-nokafka"
    )
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="any", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model=dead.model_name, prompt="x", max_tokens=2, user="s")
    assert exc.value.status_code == 503 and exc.value.code == "kafka_unavailable"
    assert int(exc.value.response.headers["retry-after"]) >= 1
    chunks = []
    with pytest.raises(openai.APIError) as exc:
        for ch in client.completions.create(
            model=dead.model_name, prompt="x", max_tokens=3, user="s", stream=True
        ):
            chunks.append(ch)
    assert "could not record the generation" in exc.value.message
    assert exc.value.body["code"] == "kafka_unavailable"


def test_a_full_queue_and_too_many_streams_are_503_with_retry_after_before_any_stream_starts(
    seeded_replica,
):
    srv = seeded_replica(id="replica-oai-full", max_queued=1, max_open_streams=1)
    client = _client(srv)
    name = srv.settings.model_name
    body = {"model": name, "prompt": "x", "max_tokens": 2, "user": "s-full", "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with HeldThread(srv), httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{srv.url}/v1/completions", json=body, headers=headers) as first:
            assert first.status_code == 200  # admitted: it waits in the queue, its stream is open
            with pytest.raises(openai.InternalServerError) as exc:  # a second stream
                client.completions.create(**{**body, "stream": True})
            assert exc.value.status_code == 503 and exc.value.code == "too_many_streams"
            with pytest.raises(openai.InternalServerError) as exc:  # the queue holds one
                client.completions.create(**{**body, "stream": False})
            assert exc.value.status_code == 503 and exc.value.code == "queue_full"
            assert int(exc.value.response.headers["retry-after"]) >= 1
            first.close()
    assert (
        metric(
            srv,
            "flywheel_replica_openai_requests_total",
            replica_id=srv.config.id,
            outcome="rejected",
        )
        == 2
    )
