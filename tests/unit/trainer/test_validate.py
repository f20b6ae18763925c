"""Rollouts checked against the model (trainer/validate.py), and their dead letters (trainer/dlq.py).

Every refusal reason is produced from a record as it would arrive on the rollouts topic and
parsed the way the intake parses it (`parse_rollout(value, spec)`), against the spec of a real
(tiny) MoE policy: vocabulary 259, context 64, 1 layer, top-1 of 2 experts.

Run: .venv/bin/pytest tests/unit/trainer/test_validate.py -q
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging

import numpy as np
import pytest

from app.contracts.events import encode_routes
from app.contracts.rollouts import DlqRecord
from policy import build_policy
from trainer.dlq import DeadLetters, RateLimitedLog, Source, envelope
from trainer.rollouts import parse_rollout
from trainer.validate import REFUSAL_REASONS, ModelSpec, Refusal, check_rollout

TINY = {
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "d_ff": 32,
    "n_experts": 2,
    "top_k": 1,
    "max_context": 64,
}


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return ModelSpec.of(build_policy(TINY), replay_routes=True, max_abs_reward=1e6)


def record(**overrides) -> dict:
    routes, shape = encode_routes(np.array([[[0]], [[1]], [[1]]], dtype=np.int32))
    r = {
        "request_id": "r1",
        "session_id": "s1",
        "group_id": None,
        "model_version": "3",
        "prompt_tokens": [100, 101],
        "completion_tokens": [40, 41, 257],
        "logprobs": [-0.1, -0.2, -0.3],
        "routes": routes,
        "route_shape": list(shape),
        "reward": 0.75,
        "components": None,
        "tool_errors": [],
        "reward_spec": "v1",
        "generated_at": "2026-01-01T00:00:00Z",
        "labelled_at": "2026-01-01T00:15:00Z",
        "closed_by": "window",
        "tokenizer": "byte-v1",
        "temperature": 0.8,
    }
    r.update(overrides)
    return r


def refusal_of(rec: dict | bytes, spec: ModelSpec) -> Refusal | None:
    value = rec if isinstance(rec, bytes) else json.dumps(rec).encode()
    r, refusal = parse_rollout(value, spec)
    if refusal is None:
        assert r is not None
    return refusal


def test_spec_is_read_from_the_policy(spec):
    assert (spec.tokenizer, spec.vocab_size, spec.max_context, spec.moe) == (
        "byte-v1",
        259,
        64,
        (1, 1, 2),
    )


def test_a_rollout_the_model_can_train_on_passes(spec):
    r, refusal = parse_rollout(json.dumps(record()).encode(), spec)
    assert refusal is None and r is not None and r.tokenizer == "byte-v1" and r.temperature == 0.8
    # the optional fields may be absent (records written before they existed)
    legacy = record()
    del legacy["tokenizer"], legacy["temperature"]
    assert refusal_of(legacy, spec) is None
    # routes absent with replay on: trainable with the current router's choices
    assert refusal_of(record(routes=None, route_shape=None), spec) is None
    # exactly the context: bos + 2 + 61 = 64
    assert (
        refusal_of(
            record(
                completion_tokens=[40] * 61, logprobs=[-0.1] * 61, routes=None, route_shape=None
            ),
            spec,
        )
        is None
    )


LONG = {
    "completion_tokens": [40] * 62,
    "logprobs": [-0.1] * 62,
    "routes": None,
    "route_shape": None,
}
ROUTES_2L = encode_routes(np.zeros((3, 2, 1), dtype=np.int32))
ROUTES_BAD_EXPERT = encode_routes(np.array([[[0]], [[2]], [[1]]], dtype=np.int32))
ROUTES_NEG_EXPERT = encode_routes(np.array([[[0]], [[-1]], [[1]]], dtype=np.int32))


@pytest.mark.parametrize(
    "overrides, reason, words",
    [
        ({"tokenizer": "gpt2"}, "tokenizer_mismatch", "'gpt2' is not the model's 'byte-v1'"),
        ({"constrained": True}, "constrained", "sampled under a grammar constraint"),
        ({"completion_tokens": [40, 259, 41]}, "token_out_of_vocab", "completion_tokens[1] = 259"),
        ({"prompt_tokens": [100, 2**40]}, "token_out_of_vocab", "prompt_tokens[1]"),
        (LONG, "sequence_too_long", "= 65 exceed the model's context 64"),
        ({"logprobs": [-0.1, 0.5, -0.3]}, "invalid_logprobs", "logprobs[1] = 0.5"),
        ({"reward": 1e300}, "invalid_reward", "|reward| <= 1e+06"),
        ({"temperature": -1.0}, "invalid_temperature", "temperature -1.0"),
        (
            {"routes": ROUTES_2L[0], "route_shape": list(ROUTES_2L[1])},
            "route_mismatch",
            "[3, 1, 1] (the model's n_layers, top_k)",
        ),
        (
            {"routes": ROUTES_BAD_EXPERT[0], "route_shape": list(ROUTES_BAD_EXPERT[1])},
            "route_mismatch",
            "expert id 2",
        ),
        (
            {"routes": ROUTES_NEG_EXPERT[0], "route_shape": list(ROUTES_NEG_EXPERT[1])},
            "route_mismatch",
            "expert id -1",
        ),
        ({"route_shape": [3, 1, 2]}, "invalid_rollout", "needs 24"),
        (
            {"routes": "not base64!", "route_shape": [3, 1, 1]},
            "invalid_rollout",
            "not valid base64",
        ),
        ({"completion_tokens": [40, -1, 41]}, "invalid_rollout", "completion_tokens"),
        ({"extra_field": 1}, "invalid_rollout", "extra_field"),
    ],
)
def test_each_refusal_reason_names_the_field_and_the_limit(spec, overrides, reason, words):
    refusal = refusal_of(record(**overrides), spec)
    assert refusal is not None and refusal.reason == reason and words in refusal.message, refusal


@pytest.mark.parametrize(
    "literal, reason", [("NaN", "invalid_logprobs"), ("-Infinity", "invalid_logprobs")]
)
def test_non_finite_json_literals_are_refused(spec, literal, reason):
    value = json.dumps(record()).replace('"logprobs": [-0.1', f'"logprobs": [{literal}').encode()
    assert refusal_of(value, spec).reason == reason
    nan_reward = json.dumps(record()).replace('"reward": 0.75', '"reward": NaN').encode()
    assert refusal_of(nan_reward, spec).reason == "invalid_reward"
    nan_temp = json.dumps(record()).replace('"temperature": 0.8', '"temperature": NaN').encode()
    assert refusal_of(nan_temp, spec).reason == "invalid_temperature"


def test_routes_are_checked_only_when_replayed_and_refused_for_a_dense_model(spec):
    wrong = record(routes=ROUTES_2L[0], route_shape=list(ROUTES_2L[1]))
    r, _ = parse_rollout(json.dumps(wrong).encode())
    no_replay = ModelSpec(**{**spec.__dict__, "replay_routes": False})
    assert check_rollout(r, no_replay) is None
    dense = ModelSpec(**{**spec.__dict__, "moe": None})
    assert check_rollout(r, dense).message == "routes given for a model without MoE layers"


def test_every_reason_is_a_known_label():
    with pytest.raises(AssertionError, match="unknown refusal reason"):
        Refusal("made_up", "x")
    assert len(set(REFUSAL_REASONS)) == len(REFUSAL_REASONS) and "step_failed" in REFUSAL_REASONS


def test_dead_letter_envelope_is_streams_dlq_record_with_the_original_bytes():
    src = Source("ns.rollouts", 2, 17, b"r1", b"\xff\x00 not json")
    rec = DlqRecord.model_validate_json(
        envelope(src, "invalid_json", [{"field": "(record)", "message": "m"}], 1024)
    )
    assert (rec.reason, rec.topic, rec.partition, rec.offset) == (
        "invalid_json",
        "ns.rollouts",
        2,
        17,
    )
    assert base64.b64decode(rec.value_b64) == src.value and base64.b64decode(rec.key_b64) == b"r1"
    assert rec.errors == [{"field": "(record)", "message": "m"}] and rec.detected_at.endswith("Z")


def test_a_value_over_the_copy_limit_is_referenced_not_copied():
    src = Source("ns.rollouts", 0, 5, None, b"x" * 2000)
    rec = DlqRecord.model_validate_json(
        envelope(src, "sequence_too_long", [{"field": "f", "message": "m"}], 1000)
    )
    assert rec.value_b64 is None and rec.key_b64 is None
    e = rec.errors[0]
    assert e["value_bytes"] == 2000 and e["value_sha256"] == hashlib.sha256(src.value).hexdigest()
    assert "ns.rollouts:0:5" in e["value_omitted"]


class _Future:
    def __init__(self, exc: Exception | None):
        self.is_done, self.exception = True, exc

    def failed(self) -> bool:
        return self.exception is not None

    def succeeded(self) -> bool:
        return self.exception is None


class _FlakyProducer:
    """Stands in for a broker that fails given deliveries (a real one cannot be made to fail on demand here)."""

    def __init__(self, failures: list[Exception | None]):
        self.failures, self.sent = failures, []

    def send(self, topic, value):
        self.sent.append(json.loads(value))
        return _Future(self.failures.pop(0) if self.failures else None)

    def flush(self, timeout):
        pass


def test_dead_letters_are_resent_until_acknowledged_and_a_record_too_large_loses_only_its_copy():
    from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

    prod = _FlakyProducer([KafkaTimeoutError(), MessageSizeTooLargeError()])
    dl = DeadLetters(prod, "ns.dlq", 1 << 20)
    dl.send(
        Source("ns.rollouts", 0, 1, None, b"v1"),
        "invalid_json",
        [{"field": "(record)", "message": "a"}],
    )
    dl.send(
        Source("ns.rollouts", 0, 2, None, b"v2"),
        "invalid_json",
        [{"field": "(record)", "message": "b"}],
    )
    dl.flush()
    assert dl.pending() == 0
    offsets = [(m["offset"], m["value_b64"] is not None) for m in prod.sent]
    assert offsets == [(1, True), (2, True), (1, True), (2, False)], offsets

    always = _FlakyProducer([KafkaTimeoutError()] * 10)
    dl = DeadLetters(always, "ns.dlq", 1 << 20, max_attempts=3)
    dl.send(
        Source("ns.rollouts", 1, 9, None, b"v"),
        "invalid_json",
        [{"field": "(record)", "message": "c"}],
    )
    with pytest.raises(
        RuntimeError, match="ns.rollouts:1:9 not delivered to ns.dlq after 3 attempts"
    ):
        dl.flush()


def test_refusal_log_is_rate_limited_per_reason(caplog):
    rl = RateLimitedLog(interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="trainer.dlq"):
        logged = [rl.warning("token_out_of_vocab", "bad %d", i) for i in range(1000)]
        logged.append(rl.warning("sequence_too_long", "long"))
    assert logged.count(True) == 2 and len(caplog.records) == 2
    rl.interval_s = 0  # the next line reports the suppressed ones
    assert rl.warning("token_out_of_vocab", "bad again")
    assert "bad again (999 more token_out_of_vocab suppressed" in caplog.records[-1].getMessage()


@pytest.mark.parametrize(
    "version, number", [("7", 7), ("²", None), ("9" * 5000, None), ("v3", None), ("007", 7)]
)
def test_model_versions_that_are_not_plain_numbers_are_stale_not_an_exception(
    spec, version, number
):
    r, refusal = parse_rollout(json.dumps(record(model_version=version)).encode(), spec)
    assert refusal is None and r.version_number() == number


def test_a_flood_of_dead_letters_keeps_only_the_unacknowledged_ones_in_memory():
    prod = _FlakyProducer([])
    dl = DeadLetters(prod, "ns.dlq", 1 << 20, reap_at=100)
    for i in range(1000):
        dl.send(
            Source("ns.rollouts", 0, i, None, b"v"),
            "invalid_json",
            [{"field": "(record)", "message": "x"}],
        )
    assert len(prod.sent) == 1000 and dl.pending() < 100
