"""Strict JSON bodies name the field that is wrong; per-route body limits pick the longest match."""

from __future__ import annotations

import json

import pytest

from app.api.jsonbody import JsonBodyError, depth, parse_json
from app.httplimits import BodyLimits


@pytest.mark.parametrize(
    "body, field, words",
    [
        (b'{"a": NaN}', "a", "NaN and Infinity"),
        (b'{"a": {"b": [1, Infinity]}}', "a.b.1", "NaN and Infinity"),
        (b'{"a": -Infinity}', "a", "NaN and Infinity"),
        (b'{"a": 1e400}', "a", "not a finite double"),
        (b'{"a": ["ok", "\\ud800"]}', "a.1", "lone UTF-16 surrogate"),
        (b'{"a": "\\udfff\\ud800"}', "a", "lone UTF-16 surrogate"),
        (b'"\\ud800"', "(body)", "lone UTF-16 surrogate"),
        (b'{"a": "\xff"}', "(body)", "not UTF-8"),
        (b"[" * 5000 + b"]" * 5000, "(body)", "nested deeper than 32"),
        (b"[" * 40 + b"]" * 40, "(body)", "nested deeper than 32"),
        (b'{"a": ', "(body)", "not valid JSON"),
    ],
)
def test_bad_bodies_name_the_field(body, field, words):
    with pytest.raises(JsonBodyError) as exc:
        parse_json(body, max_depth=32)
    assert exc.value.field == field and words in exc.value.message, (
        exc.value.field,
        exc.value.message,
    )
    loc = exc.value.detail()[0]["loc"]
    assert loc[0] == "body" and (field == "(body)" or loc[1:] == field.split("."))


def test_good_bodies_parse_and_a_valid_surrogate_pair_is_fine():
    assert parse_json(b'{"a": "\\ud83d\\ude00", "b": [1.5, -0.0, 1e308]}') == {
        "a": "\U0001f600",
        "b": [1.5, -0.0, 1e308],
    }
    assert parse_json(b"[" * 32 + b"]" * 32, max_depth=32) == json.loads("[" * 32 + "]" * 32)


def test_depth_counts_containers_and_stops_early():
    assert depth(1, 5) == 0 and depth([], 5) == 1 and depth({"a": [{"b": 1}]}, 5) == 3
    assert depth(json.loads("[" * 100 + "]" * 100), 5) == 6, "stops one past the limit"


def test_route_limits_take_the_longest_match():
    limits = BodyLimits(
        default_bytes=100,
        routes=(("/v1/events", 4), ("/v1/deployments/", 16), ("/v1/x/y/", 1)),
        idle_timeout_s=1,
        total_timeout_s=1,
        drain_max_bytes=0,
        drain_timeout_s=0,
    )
    assert limits.limit_for("/v1/events") == 4
    assert limits.limit_for("/v1/events/extra") == 100, (
        "a route without a trailing slash is an exact path"
    )
    assert limits.limit_for("/v1/deployments/pause") == 16
    assert limits.limit_for("/v1/deployments") == 100
    assert limits.limit_for("/v1/x/y/z") == 1
    assert limits.limit_for("/healthz") == 100
