"""The interaction-event schema as the ingest API applies it (app/contracts/events.py, docs/DESIGN.md §Editor events).

Every rejection the API promises is checked here with the field it names and its message;
the integration tests (tests/integration/api/) check the same cases over real HTTP and Kafka.
"""

from __future__ import annotations

import copy

import pytest

from app.contracts.events import EVENT_TYPES, validate_batch

ENVELOPE = {
    "event_id": "ev-1",
    "request_id": "req-1",
    "session_id": "sess-1",
    "ts": "2026-11-21T10:00:00Z",
}

VALID = {
    "generation": {
        **ENVELOPE,
        "type": "generation",
        "model_version": "7",
        "prompt_tokens": [104, 105],
        "completion_tokens": [33, 10, 0],
        "logprobs": [-0.25, -1.5, 0.0],
        "temperature": 0.8,
        "group_id": "g-1",
        "latency_ms": 12.5,
        "tokenizer": "byte-v1",
    },
    "accept": {**ENVELOPE, "type": "accept"},
    "reject": {**ENVELOPE, "type": "reject", "model_version": "7"},
    "edit_persistence": {**ENVELOPE, "type": "edit_persistence", "fraction": 0.75, "after_s": 300},
    "rating": {**ENVELOPE, "type": "rating", "value": -1},
    "tool_error": {
        **ENVELOPE,
        "type": "tool_error",
        "message": "NameError: x",
        "hint": "define x",
        "token_index": 2,
    },
    "followup": {**ENVELOPE, "type": "followup", "sentiment": -0.5},
    "session_outcome": {**ENVELOPE, "type": "session_outcome", "outcome": "success"},
}


def with_(type_: str, **changes):
    ev = copy.deepcopy(VALID[type_])
    for k, v in changes.items():
        if v is _DROP:
            ev.pop(k)
        else:
            ev[k] = v
    return ev


_DROP = object()


def only_error(event) -> dict:
    parsed, errors = validate_batch([event])
    assert parsed == [] and len(errors) >= 1, (
        f"expected a rejection, got parsed={parsed} errors={errors}"
    )
    return errors[0].model_dump()


@pytest.mark.parametrize("type_", EVENT_TYPES)
def test_a_valid_example_of_each_event_type_is_accepted(type_):
    parsed, errors = validate_batch([VALID[type_]])
    assert errors == [], errors
    assert len(parsed) == 1 and parsed[0].type == type_


@pytest.mark.parametrize(
    "event, field, message",
    [
        (with_("accept", colour="red"), "colour", "unknown field"),
        (
            with_("generation", logprobs=[-0.1, -0.2]),
            "logprobs",
            "logprobs has 2 entries but completion_tokens has 3",
        ),
        (with_("generation", logprobs=[-0.1, 0.5, -0.3]), "logprobs.1", "less than or equal to 0"),
        (with_("generation", logprobs=[-0.1, float("nan"), -0.3]), "logprobs.1", "finite number"),
        (with_("generation", logprobs=[-0.1, float("-inf"), -0.3]), "logprobs.1", "finite number"),
        (with_("accept", event_id="x" * 129), "event_id", "at most 128 characters"),
        (with_("accept", request_id="r" * 129), "request_id", "at most 128 characters"),
        (with_("accept", session_id="s" * 129), "session_id", "at most 128 characters"),
        (with_("accept", request_id=""), "request_id", "at least 1 character"),
        (with_("accept", ts="2026-11-21T10:00:00"), "ts", "timezone"),
        (with_("accept", ts="2026-11-21"), "ts", "RFC 3339"),
        (with_("accept", ts=1763719200), "ts", "RFC 3339"),
        (with_("accept", type="applause"), "type", "expected one of generation, accept"),
        (with_("accept", type=_DROP), "type", "expected one of"),
        (with_("accept", event_id=_DROP), "event_id", "Field required"),
        (with_("generation", model_version=_DROP), "model_version", "Field required"),
        (
            with_("generation", completion_tokens=[], logprobs=[]),
            "completion_tokens",
            "at least 1 item",
        ),
        (
            with_("generation", prompt_tokens=[1, -1]),
            "prompt_tokens.1",
            "greater than or equal to 0",
        ),
        (with_("generation", temperature=-0.1), "temperature", "greater than or equal to 0"),
        (with_("generation", temperature="0.8"), "temperature", "valid number"),
        (with_("rating", value=0), "value", "-1 or 1"),
        (with_("rating", value="1"), "value", "-1 or 1"),
        (with_("edit_persistence", fraction=1.5), "fraction", "less than or equal to 1"),
        (with_("edit_persistence", after_s=0), "after_s", "greater than 0"),
        (with_("tool_error", message="m" * 4097), "message", "at most 4096 characters"),
        (with_("tool_error", token_index=-1), "token_index", "greater than or equal to 0"),
        (with_("followup", sentiment=-1.01), "sentiment", "greater than or equal to -1"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None,
)
def test_each_invalid_event_is_rejected_naming_the_field(event, field, message):
    err = only_error(event)
    assert err["index"] == 0
    assert err["field"] == field, err
    assert message in err["message"], err


def test_a_batch_reports_every_bad_event_with_its_index_and_parses_the_good_ones():
    batch = [
        VALID["accept"],
        with_("rating", value=3),
        VALID["followup"],
        with_("accept", extra=1, ts="2026-11-21T10:00:00"),
    ]
    parsed, errors = validate_batch(batch)
    assert [p.type for p in parsed] == ["accept", "followup"]
    assert sorted((e.index, e.field) for e in errors) == [(1, "value"), (3, "extra"), (3, "ts")]


def test_a_non_object_event_is_rejected():
    err = only_error(["not", "an", "object"])
    assert (err["field"], err["message"]) == ("(event)", "each event must be a JSON object")
