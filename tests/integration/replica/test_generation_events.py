"""POST /v1/complete on a real replica: the response contract, the generation events it writes
to the real broker (valid against the ingest schema, acked before the answer), and the trainer-side
contract that `logprobs()` with replayed routes reproduces the logged log-probs bit for bit."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from app.contracts.events import decode_routes, parse_event_bytes
from app.replica.weights import WeightCache, load_verified
from kernels.delta.hashing import checkpoint_sha256
from tests.integration.replica.conftest import read_topic, tiny_state

pytestmark = pytest.mark.integration


@pytest.fixture()
def seeded(seeded_replica):
    """A replica (no sync agent) serving tiny version 7 from its verified cache."""
    cfg, state = tiny_state(7)
    return seeded_replica(id="replica-gen"), cfg, state


def test_n_candidates_share_a_group_and_their_events_validate_and_replay_bit_exactly(seeded):
    srv, cfg, state = seeded
    body = {
        "session_id": "sess-1",
        "prompt": "def add(a, b):",
        "max_tokens": 12,
        "temperature": 1.0,
        "n": 3,
    }
    r = httpx.post(f"{srv.url}/v1/complete", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model_version"] == "7" and len(out["completions"]) == 3
    ids = [c["request_id"] for c in out["completions"]]
    assert len(set(ids)) == 3 and out["request_id"] not in ids
    for c in out["completions"]:
        assert (
            c["finish_reason"] in ("stop", "length")
            and 1 <= c["tokens"] <= 12
            and isinstance(c["text"], str)
        )

    events = read_topic(srv.settings, "interactions", 3, where=lambda e: e.get("request_id") in ids)
    assert sorted(e["request_id"] for e in events) == sorted(ids), (
        "one event per candidate, acked before the answer"
    )
    parsed = [
        parse_event_bytes(json.dumps(e).encode()) for e in events
    ]  # as the ingest path reads them
    assert {p.group_id for p in parsed} == {out["request_id"]}
    assert all(
        p.model_version == "7" and p.tokenizer == "byte-v1" and p.session_id == "sess-1"
        for p in parsed
    )
    assert all(p.prompt_tokens == list(b"def add(a, b):") for p in parsed)

    from policy import build_policy

    trainer_side = build_policy(cfg)  # what the trainer does: load the version's serving weights
    trainer_side.load_serving_state_dict(state)
    for p in parsed:
        routes = decode_routes(p.routes, p.route_shape)
        assert routes.shape == (len(p.completion_tokens), cfg["n_layers"], cfg["top_k"])
        with torch.no_grad():
            lp = trainer_side.logprobs(
                [p.prompt_tokens], [p.completion_tokens], routes=[routes], temperature=p.temperature
            )[0, : len(p.completion_tokens)]
        logged = torch.tensor(p.logprobs, dtype=torch.float32)
        assert torch.equal(lp.view(torch.int32), logged.view(torch.int32)), (
            f"recomputed {lp.tolist()} != logged {p.logprobs}"
        )
        assert np.all(np.asarray(p.logprobs) <= 0)


def test_single_completion_reuses_the_request_id_and_has_no_group(seeded):
    srv, _, _ = seeded
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "s", "prompt": "x = ", "max_tokens": 4, "temperature": 0.0, "n": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["completions"][0]["request_id"] == out["request_id"]
    (ev,) = read_topic(
        srv.settings, "interactions", 1, where=lambda e: e.get("request_id") == out["request_id"]
    )
    assert "group_id" not in ev and ev["temperature"] == 0.0 and ev["latency_ms"] >= 0


def test_long_prompts_keep_their_end_and_the_event_records_what_the_model_saw(seeded):
    srv, cfg, _ = seeded
    prompt = "a" * 500 + "tail"
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "s", "prompt": prompt, "max_tokens": 8, "n": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    (ev,) = read_topic(srv.settings, "interactions", 1, where=lambda e: e.get("request_id") == rid)
    assert len(ev["prompt_tokens"]) == cfg["max_context"] - 1 - 8
    assert bytes(ev["prompt_tokens"]).endswith(b"tail")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x"}, "session_id"),
        ({"session_id": "s", "prompt": "x", "n": 0}, "n"),
        ({"session_id": "s", "prompt": "x", "n": 99}, "n"),
        ({"session_id": "s", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        (
            {"session_id": "s", "prompt": "x", "max_tokens": 100},
            "max_tokens",
        ),  # > the tiny model's context
        ({"session_id": "s", "prompt": "x", "temperature": -1}, "temperature"),
        ({"session_id": "s", "prompt": "x", "surprise": 1}, "surprise"),
    ],
)
def test_invalid_requests_get_422_naming_the_field(seeded, body, field):
    srv, _, _ = seeded
    r = httpx.post(f"{srv.url}/v1/complete", json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert any(field in map(str, d["loc"]) for d in r.json()["detail"]), r.json()


def test_health_ready_and_metrics(seeded):
    srv, _, _ = seeded
    assert httpx.get(f"{srv.url}/healthz").status_code == 200
    ready = httpx.get(f"{srv.url}/readyz")
    assert ready.status_code == 200 and ready.json()["champion"] == "7"
    httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "s", "prompt": "x", "max_tokens": 2},
        timeout=60,
    )
    text = httpx.get(f"{srv.url}/metrics").text
    assert 'flywheel_replica_serving_version{replica_id="replica-gen",slot="champion"} 7.0' in text
    assert (
        'flywheel_replica_requests_total{outcome="ok",replica_id="replica-gen",slot="champion"}'
        in text
    )


def test_not_ready_without_weights_and_503_when_kafka_cannot_ack(
    replica_factory, make_settings, tmp_path
):
    from tests.conftest import free_port

    empty = replica_factory(make_settings(), start_sync=False, id="replica-empty")
    assert httpx.get(f"{empty.url}/readyz").status_code == 503
    assert (
        httpx.post(f"{empty.url}/v1/complete", json={"session_id": "s", "prompt": "x"}).status_code
        == 503
    )

    cfg, state = tiny_state(3)
    cache = WeightCache(tmp_path / "c503")
    lv = load_verified("3", state, cfg, checkpoint_sha256(state))
    cache.put(lv)
    dead = make_settings(
        create_topics=False, kafka_bootstrap=f"127.0.0.1:{free_port()}", kafka_produce_timeout=1.0
    )
    srv = replica_factory(dead, start_sync=False, cache_dir=tmp_path / "c503", id="replica-nokafka")
    r = httpx.post(
        f"{srv.url}/v1/complete",
        json={"session_id": "s", "prompt": "x", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 503 and "Retry-After" in r.headers, r.text
