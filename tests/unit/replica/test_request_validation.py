"""Hostile /v1/complete bodies are refused by `parse_complete_request` with the field named, and the
sampler itself refuses a temperature whose logits / T is not finite instead of sampling NaN."""

from __future__ import annotations

import json

import pytest

from app.replica.bodies import RequestInvalid, parse_complete_request


def _fields(raw: bytes) -> list[list]:
    with pytest.raises(RequestInvalid) as exc:
        parse_complete_request(raw)
    json.dumps(exc.value.errors, ensure_ascii=False).encode(
        "utf-8"
    )  # the 422 body itself must be sendable
    return [e["loc"] for e in exc.value.errors]


@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"session_id": "s", "prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"session_id": "s", "prompt": "x", "temperature": Infinity}', "temperature"),
        (b'{"session_id": "s", "prompt": "x", "temperature": -Infinity}', "temperature"),
        (b'{"session_id": "s", "prompt": "x", "temperature": 1e999}', "temperature"),
        (b'{"session_id": "s", "prompt": "x", "temperature": -1e-300}', "temperature"),
        (b'{"session_id": "s", "prompt": "x", "temperature": "1"}', "temperature"),
        (b'{"session_id": "s", "prompt": "\\ud800"}', "prompt"),
        (b'{"session_id": "\\udfff", "prompt": "x"}', "session_id"),
        (b'{"session_id": "s", "prompt": "x", "n": 1e400}', "n"),
        (b'{"session_id": "s", "prompt": "x", "n": 2.5}', "n"),
        (b'{"session_id": "s", "prompt": "x", "n": true}', "n"),
        (
            b'{"session_id": "s", "prompt": "x", "max_tokens": -99999999999999999999999999}',
            "max_tokens",
        ),
        (b'{"session_id": "s", "prompt": 7}', "prompt"),
        (b'{"session_id": "", "prompt": "x"}', "session_id"),
        (b'{"session_id": "' + b"s" * 129 + b'", "prompt": "x"}', "session_id"),
        (b'{"session_id": "s"}', "prompt"),
    ],
)
def test_hostile_fields_are_refused_naming_the_field(raw, field):
    assert ["body", field] in _fields(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"nul",
        b"[1, 2]",
        b'"a string"',
        b"{" * 100_000,
        b'{"session_id": "s", "prompt": "\xff\xfe"}',
        b'{"session_id": "s", "prompt": "x", "n": 1' + b"0" * 5000 + b"}",
    ],
)
def test_bodies_that_are_not_a_json_object_are_refused_as_the_body(raw):
    assert _fields(raw) == [["body"]]


def test_an_unknown_field_is_named_and_a_surrogate_in_its_name_is_escaped_in_the_answer():
    locs = _fields(b'{"session_id": "s", "prompt": "x", "\\ud800x": 1}')
    assert locs == [["body", "\\ud800x"]]


def test_valid_bodies_parse_including_an_empty_prompt_and_huge_in_range_values():
    req = parse_complete_request(
        b'{"session_id": "s", "prompt": "", "max_tokens": 1, "n": 1, "temperature": 0}'
    )
    assert req.prompt == "" and req.temperature == 0.0
    big = parse_complete_request(
        b'{"session_id": "s", "prompt": "x", "max_tokens": 1' + b"0" * 300 + b"}"
    )
    assert (
        big.max_tokens == 10**300
    )  # in range for the model; the route's bound refuses it with 422


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45])
def test_the_sampler_refuses_temperatures_whose_scaled_logits_overflow(tiny, temperature):
    from policy import build_policy
    from policy.base import SamplingError

    cfg, _ = tiny(0)
    policy = build_policy(cfg)
    with pytest.raises(SamplingError, match="too small"):
        policy.generate([[1, 2, 3]], max_tokens=2, temperature=temperature, seed=0)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_the_sampler_refuses_non_finite_or_negative_temperatures(tiny, temperature):
    from policy import build_policy
    from policy.base import SamplingError

    policy = build_policy(tiny(0)[0])
    with pytest.raises(SamplingError, match="finite number >= 0"):
        policy.generate([[1]], max_tokens=2, temperature=temperature, seed=0)


def test_the_sampler_refuses_non_finite_logits_from_broken_weights(tiny):
    import torch

    from policy import build_policy
    from policy.base import NonFiniteLogits

    policy = build_policy(tiny(0)[0])
    with torch.no_grad():
        next(p for p in policy.parameters() if p.is_floating_point()).fill_(float("nan"))
    with pytest.raises(NonFiniteLogits):
        policy.generate([[1]], max_tokens=2, temperature=1.0, seed=0)
    with pytest.raises(NonFiniteLogits):
        policy.generate([[1]], max_tokens=2, temperature=0.0, seed=0)


def test_the_smallest_allowed_temperature_samples_finite_logprobs(tiny):
    import math

    from app.replica.config import ReplicaConfig
    from policy import build_policy

    policy = build_policy(tiny(0)[0])
    (sample,) = policy.generate(
        [[1, 2]], max_tokens=4, temperature=ReplicaConfig().min_temperature, seed=0
    )
    assert all(math.isfinite(x) and x <= 0 for x in sample.logprobs)
