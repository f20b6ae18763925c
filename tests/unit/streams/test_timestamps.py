"""Event timestamps: ingest and every downstream reader agree (app/contracts/events.py `Timestamp`, `parse_ts`).

The property: any `ts` the ingest schema accepts parses downstream (`parse_ts`, used by the
streams reward, the controller's fold and the trainer) to the same instant, never raises
there, and ingest rewrites it to one canonical form that parses back to that instant.
Strings are drawn from an RFC 3339 / ISO 8601 grammar with the variants clients send
(lower-case `t`/`z`, a space, comma fractions, 1-12 fraction digits, offsets with and without
a colon, `-00:00`, extreme years and offsets) plus arbitrary mutations of them.
"""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.contracts.events import format_ts, parse_event, parse_ts, validate_batch
from app.controller.state import DeploymentState, apply_event
from streams.reward import RewardSpec, RewardWeights, compute_reward

CANONICAL = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")
FEEDBACK = {"type": "accept", "event_id": "e1", "request_id": "r1", "session_id": "s1"}


def _two(lo: int, hi: int) -> st.SearchStrategy[str]:
    return st.integers(lo, hi).map(lambda n: f"{n:02d}")


@st.composite
def rfc3339ish(draw: st.DrawFn) -> str:
    year = draw(st.sampled_from([1, 2, 1969, 1970, 2026, 9998, 9999]) | st.integers(1, 9999))
    date = f"{year:04d}-{draw(_two(1, 12))}-{draw(_two(1, 28))}"
    sep = draw(st.sampled_from(["T", "t", " "]))
    clock = f"{draw(_two(0, 23))}:{draw(_two(0, 59))}"
    if draw(st.booleans()):
        clock += f":{draw(_two(0, 59))}"
        if draw(st.booleans()):
            clock += draw(st.sampled_from([".", ","])) + draw(
                st.text("0123456789", min_size=1, max_size=12)
            )
    sign = draw(st.sampled_from(["+", "-"]))
    hh, mm = draw(_two(0, 23)), draw(_two(0, 59))
    offset = draw(
        st.sampled_from(["Z", "z", f"{sign}{hh}:{mm}", f"{sign}{hh}{mm}", "-00:00", "+00:00", ""])
    )
    return date + sep + clock + offset


def _mutate(s: str, data: st.DataObject) -> str:
    i = data.draw(st.integers(0, len(s)))
    j = data.draw(st.integers(i, min(len(s), i + 3)))
    return s[:i] + data.draw(st.text(max_size=3)) + s[j:]


def _ingest(ts: object) -> dict | None:
    """The event as ingest would produce it to Kafka, or None when ingest rejects it."""
    ev = {**FEEDBACK, "ts": ts}
    parsed, errors = validate_batch([ev])
    return ev if parsed else None


def _agrees(raw: str) -> None:
    produced = _ingest(raw)
    if produced is None:
        return
    instant = parse_event({**FEEDBACK, "ts": raw}).ts
    assert parse_ts(raw) == instant, f"{raw!r}: downstream {parse_ts(raw)} != ingest {instant}"
    canonical = produced["ts"]
    assert CANONICAL.match(canonical), (
        f"{raw!r} was rewritten to {canonical!r}, not the canonical form"
    )
    assert parse_ts(canonical) == instant and format_ts(parse_ts(canonical)) == canonical
    assert parse_ts(canonical).tzinfo is UTC


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rfc3339ish())
def test_every_timestamp_ingest_accepts_parses_downstream_to_the_same_instant(raw):
    _agrees(raw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rfc3339ish(), st.data())
def test_mutated_timestamps_never_accepted_by_ingest_and_refused_downstream(raw, data):
    _agrees(_mutate(raw, data))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=40))
def test_arbitrary_text_never_accepted_by_ingest_and_refused_downstream(raw):
    _agrees(raw)


def test_lower_case_z_is_accepted_and_rewritten_to_upper_case_z_in_utc():
    assert _ingest("2026-11-21T10:00:00.123z")["ts"] == "2026-11-21T10:00:00.123000Z"
    assert _ingest("2026-11-21t11:00:00+01:00")["ts"] == "2026-11-21T10:00:00.000000Z"
    assert _ingest("2026-11-21 10:00:00,5-00:00")["ts"] == "2026-11-21T10:00:00.500000Z"


def test_an_offset_that_leaves_the_representable_range_is_refused_at_ingest_and_downstream():
    for raw in ("0001-01-01T00:30:00+01:00", "9999-12-31T23:59:59-01:00"):
        assert _ingest(raw) is None
        try:
            parse_ts(raw)
        except ValueError as exc:
            assert "representable" in str(exc)
        else:
            raise AssertionError(f"{raw} parsed downstream although ingest refuses it")


def test_naive_and_non_string_timestamps_are_refused_with_a_message():
    for raw in ("2026-11-21T10:00:00", 1_700_000_000, None):
        assert _ingest(raw) is None
        try:
            parse_ts(raw)  # type: ignore[arg-type]
        except ValueError as exc:
            assert "invalid timestamp" in str(exc)
        else:
            raise AssertionError(f"{raw!r} parsed downstream although ingest refuses it")


def test_the_reward_and_the_controller_fold_read_every_spelling_ingest_accepts():
    """The downstream readers of `ts` parse every spelling ingest accepts: a lower-case z (the
    streams reward's ordering) and an offset (the controller's canary step start) both parse."""
    spec = RewardSpec(version="v1", weights=RewardWeights())
    fb = [
        {**FEEDBACK, "ts": "2026-11-21T10:00:02z", "event_id": "late", "type": "reject"},
        {**FEEDBACK, "ts": "2026-11-21T11:00:01+01:00", "event_id": "early"},
    ]  # 10:00:01Z: the earliest
    assert compute_reward(spec, copy.deepcopy(fb)).raw["decision"] == "accept"
    state = apply_event(
        DeploymentState(model="m"),
        {
            "event_id": "x",
            "type": "canary_started",
            "model": "m",
            "version": "2",
            "source": "controller",
            "traffic_pct": 5.0,
            "ts": "2026-11-21t10:00:00z",
        },
    )
    assert state.step_started_at == datetime(2026, 11, 21, 10, tzinfo=UTC)
