"""The session ledger in the real worker on the real broker, across a SIGKILL mid-session.

Agent sessions' turns (chat generations with `turn`, each prompt extending the last), feedback
on one turn and each session's outcome go to `<ns>.interactions`; the worker is killed while
every session is half done (its first turns labelled and in the ledger's state, the rest not yet
produced) and restarted. Every session must come out as exactly one segment holding each of its
turns once, in order (re-emits after the restart are allowed, and must be identical), and no
turn may go to late. Each session that ended with its outcome reaches the canary once: its sums
on `<ns>.version-metrics`, in the version that served its last turn (v8 for half the sessions,
whose last turn a canary served; v7 for the rest)."""

from __future__ import annotations

import json
import signal

import orjson

from app.contracts.rollouts import Rollout, VersionMetrics
from tests.integration.streams.conftest import (
    WINDOW,
    broker_timed_settings,
    produce,
    read_to_end,
    read_until,
)
from tests.unit.streams.factories import feedback, generation, ts
from tests.waiting import poll

SESSIONS, TURNS = 24, 4
TOOLS = "b" * 64


def _version(s: int, k: int) -> str:
    """The version that served turn `k` of session `s`: the last turn of every even session v8."""
    return "v8" if k == TURNS - 1 and s % 2 == 0 else "v7"


def _turn(s: int, k: int) -> dict:
    """Turn `k` of session `s`: 3 sampled tokens; the next prompt adds 2 tool-result tokens."""
    prompt = [1, 2, 3]
    for j in range(k):
        prompt += [100 + j, 101 + j, 102 + j, 50 + j, 51 + j]
    return generation(
        f"s{s}-t{k}",
        t=10.0 * k + 0.01 * s,
        version=_version(s, k),
        session_id=f"sess-{s}",
        prompt_tokens=prompt,
        completion_tokens=[100 + k, 101 + k, 102 + k],
        logprobs=[-0.25, -0.5, -0.75],
        turn=k,
        tools_digest=TOOLS,
        finish_reason="tool_calls",
    )


def _records(turns: range, outcome: bool) -> list[tuple[bytes, bytes]]:
    out = []
    for k in turns:
        for s in range(SESSIONS):
            gen = _turn(s, k)
            out.append((gen["request_id"].encode(), orjson.dumps(gen)))
            if k == 1:  # the user rated the second turn
                fb = feedback(gen["request_id"], f"{gen['request_id']}-r", "rating", t=10.0 * k + 5)
                fb["session_id"] = gen["session_id"]
                out.append((gen["request_id"].encode(), orjson.dumps(fb)))
    if outcome:
        for s in range(SESSIONS):
            last = f"s{s}-t{TURNS - 1}"
            ev = {
                "event_id": f"sess-{s}-outcome",
                "type": "session_outcome",
                "request_id": last,
                "session_id": f"sess-{s}",
                "ts": ts(100.0),
                "outcome": "success",
            }
            out.append((last.encode(), orjson.dumps(ev)))
    return out


def test_sigkill_mid_session_loses_and_duplicates_no_turn(make_settings, start_worker):
    settings = broker_timed_settings(make_settings, wait_window=WINDOW)
    env = {"FLYWHEEL_STREAMS_LOG_LEVEL": "INFO", "FLYWHEEL_STREAMS_SESSION_IDLE": "300s"}
    worker = start_worker(settings, **env)
    produce(settings, _records(range(2), outcome=False))
    # every session's first two turns in the ledger's state (its changelog), none closed yet
    read_until(
        settings,
        f"{settings.topic_namespace}-streams-sessions-changelog",
        SESSIONS,
        key_of=lambda r: r.key,
        alive=[worker],
        settle=0.5,
    )
    worker.kill(signal.SIGKILL)
    assert worker.proc.returncode == -signal.SIGKILL
    assert not [
        r for r in read_to_end(settings, settings.topic("rollouts")) if b"sess-" in r.value
    ], "the kill was not mid-session: a session's record was already out"

    restarted = start_worker(settings, **env)
    produce(settings, _records(range(2, TURNS), outcome=True))
    records = read_until(
        settings,
        settings.topic("rollouts"),
        SESSIONS,
        key_of=lambda r: r.key,
        alive=[restarted],
    )
    by_key: dict[bytes, list[dict]] = {}
    for r in records:
        by_key.setdefault(r.key, []).append(json.loads(r.value))
    assert len(by_key) == SESSIONS, sorted(by_key)
    for key, copies in by_key.items():
        first = copies[0]
        Rollout.model_validate(first)
        for other in copies[1:]:  # at-least-once: a re-emit is the same record
            assert {**other, "labelled_at": None} == {**first, "labelled_at": None}, key
        s = first["session_id"].removeprefix("sess-")
        assert [t["request_id"] for t in first["turns"]] == [f"s{s}-t{k}" for k in range(TURNS)]
        assert first["outcome"] == "success" and first["segment_closed_by"] == "end"
        assert [t["reward"] for t in first["turns"]] == [0.0, 0.5, 0.0, 0.0]
        assert sum(first["loss_mask"]) == 3 * TURNS
    late = [json.loads(r.value) for r in read_to_end(settings, settings.topic("late"))]
    assert [v for v in late if v["request_id"].startswith("s")] == [], late[:3]
    log_text = restarted.log_path.read_text(errors="replace")
    assert "resuming from the state's progress" in log_text, restarted.tail()
    assert "records were skipped" not in log_text, restarted.tail()
    _assert_sessions_reach_the_version_metrics_once(settings)


def _session_sums(settings) -> dict[str, dict[str, float]]:
    """version -> the session sums of its version-metrics records (the latest record of each
    bucket, which supersedes the earlier ones, as the controller reads them)."""
    latest: dict[str, VersionMetrics] = {}
    for r in read_to_end(settings, settings.topic("version-metrics")):
        rec = VersionMetrics.model_validate_json(r.value)
        assert r.key == rec.model_version.encode(), (r.key, rec.bucket_id)
        latest[rec.bucket_id] = rec
    out: dict[str, dict[str, float]] = {}
    for rec in latest.values():
        if rec.sums.get("sessions_n", 0.0):
            assert rec.session_partitions, rec
            sums = out.setdefault(rec.model_version, {})
            for k in (
                "sessions_n",
                "session_success",
                "session_give_up",
                "session_turns_sum",
                "session_tokens_sum",
            ):
                sums[k] = sums.get(k, 0.0) + rec.sums[k]
    return out


def _assert_sessions_reach_the_version_metrics_once(settings) -> None:
    half = SESSIONS / 2
    per_version = {
        "sessions_n": half,
        "session_success": half,
        "session_give_up": 0.0,
        "session_turns_sum": half * TURNS,
        "session_tokens_sum": half * TURNS * 3,
    }
    want = {"v7": per_version, "v8": per_version}
    # a session's bucket goes out once the ledger's time passes its end (2 s buckets, ticks)
    got = poll(
        lambda: (sums := _session_sums(settings)) == want and sums,
        90,
        "every session's sums on the version-metrics topic",
        every=1.0,
        fail=False,
    )
    assert got == want, _session_sums(settings)
