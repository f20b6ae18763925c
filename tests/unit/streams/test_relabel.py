"""The relabel core (streams/relabel.py `Relabeller`) and the `flywheel streams relabel` arguments, without a broker.

The core must join exactly as the live worker's `Aggregator` does and label with the new
spec: each generation with in-window feedback gives one rollout keyed '<request_id>|<spec>'
whose reward is `compute_reward(new spec, that feedback)`; everything else is counted under
a skip reason or dead-lettered. The broker path is tests/integration/streams/test_relabel_broker.py.
"""

from __future__ import annotations

import base64
import json
import random

import pytest
from typer.testing import CliRunner

from app.cli import app as cli
from app.contracts.rollouts import DlqRecord, Rollout
from streams.labels import Aggregator
from streams.ledger import LedgerConfig
from streams.relabel import SKIP_REASONS, Relabeller, RelabelOptions, relabel_key
from streams.reward import RewardWeights, compute_reward, resolve_spec
from tests.unit.streams.factories import feedback as fb
from tests.unit.streams.factories import generation as gen
from tests.unit.streams.factories import hacked_turns, random_feedback

W = 10.0
V2 = resolve_spec(
    "v2", RewardWeights(accept=1.0, reject=-1.0, tool_error=-2.0, tool_error_floor=-4.0)
)


def core(since: float = 0.0, until: float | None = None, spec=V2) -> Relabeller:
    return Relabeller(
        spec,
        W,
        1e9,
        60.0,
        since_s=since,
        until_s=until,
        run_id="run-1",
        topic="ns.interactions",
        clock=lambda: 1.8e9,
    )


def rec(ev: dict) -> tuple[bytes, bytes]:
    return ev["request_id"].encode(), json.dumps(ev).encode()


def test_each_generation_with_feedback_gets_one_rollout_under_the_new_spec_keyed_with_it():
    c = core()
    g = gen("r1", version="3")
    events = [
        g,
        fb("r1", "a", "accept"),
        fb("r1", "b", "tool_error"),
        fb("r1", "b", "tool_error"),
    ]  # b duplicated
    out = []
    for i, ev in enumerate(events):
        out += c.feed(0, i, *rec(ev), 100.0 + i)
    out += c.finish(200.0)
    [e] = out
    roll = Rollout.model_validate(e.value)
    want = compute_reward(V2, [fb("r1", "a", "accept"), fb("r1", "b", "tool_error")])
    assert e.key == "r1|v2" == relabel_key("r1", "v2")
    assert (
        roll.reward == want.reward == 1.0 - 2.0
        and roll.reward_spec == "v2"
        and roll.relabel_run == "run-1"
    )
    assert roll.model_version == "3" and roll.completion_tokens == g["completion_tokens"]
    assert c.counts.as_dict() == {
        "read": 4,
        "labelled": 1,
        "written": 0,
        "duplicates": 1,
        "dead_lettered": {},
        "skipped": dict.fromkeys(SKIP_REASONS, 0),
    }


def _session_relabeller(spec: str) -> Relabeller:
    """A relabeller that runs the session ledger, as the live worker does by default."""
    return Relabeller(
        resolve_spec(spec),
        W,
        1e9,
        60.0,
        since_s=0.0,
        until_s=None,
        run_id="run-1",
        topic="ns.interactions",
        clock=lambda: 1.8e9,
        sessions=LedgerConfig(idle_s=300.0, retention_s=600.0),
    )


def test_a_session_is_relabelled_as_one_segment_and_an_open_one_is_left_to_the_live_worker():
    """With the ledger (the live worker's default), a session's turns and outcome become one
    relabelled segment; a session still open at the end is counted, not written."""
    c = _session_relabeller("sessions-v1")
    events = []
    for sid in ("done", "open"):
        prompt = [1, 2, 3]
        for k in range(2):
            completion = [10 + k, 11 + k]
            events.append(
                gen(f"{sid}{k}", t=k, session_id=sid, prompt_tokens=prompt,
                    completion_tokens=completion, logprobs=[-0.5, -0.5], turn=k)
            )  # fmt: skip
            prompt = [*prompt, *completion, 7]
    events.append(fb("done1", "r", "rating", session_id="done"))
    outcome = {**fb("done1", "o", "rating", session_id="done"), "type": "session_outcome"}
    del outcome["value"]
    events.append({**outcome, "outcome": "failure"})
    out = []
    for i, ev in enumerate(events):
        out += c.feed(0, i, *rec(ev), 100.0 + i)
    out += c.finish(150.0)  # windows closed; the open session's idle time not yet passed
    [e] = out
    assert e.key == "done0|sessions-v1" and e.value["relabel_run"] == "run-1"
    assert [t["request_id"] for t in e.value["turns"]] == ["done0", "done1"]
    assert e.value["reward"] == 0.5 - 0.5 and e.value["outcome_reward"] == -0.5
    assert c.counts.skipped["session_open"] == 1 and c.counts.labelled == 1


def test_randomised_log_gives_the_live_joins_relabelled():
    """Against the live Aggregator on the same records: same request_ids, same completions, rewards of
    the new spec on the same joined feedback (the v1 components say which feedback was joined)."""
    rng = random.Random(7)
    records = []
    for i in range(300):
        rid = f"q{i}"
        evs = ([gen(rid, version="2")] if rng.random() < 0.9 else []) + [
            random_feedback(rng, rid, f"{rid}-f{j}") for j in range(rng.randint(0, 4))
        ]
        rng.shuffle(evs)
        records += [(rng.randrange(2), ev) for ev in evs]
    live = Aggregator(resolve_spec("v1"), W, 1e9, 60.0, {}, {}, {}, clock=lambda: 1.8e9)
    c = core()
    live_out, new_out, fed = [], [], {}
    for n, (p, ev) in enumerate(records):
        rt = 100.0 + n * 0.05 + rng.choice([0.0, 0.0, 12.0]) * (n % 50 == 0)
        live_out += live.on_event(p, ev, rt)
        new_out += c.feed(p, n, *rec(ev), rt)
        fed.setdefault(ev["request_id"], []).append(ev)
    for p in (0, 1):
        live_out += live.advance(p, 1e12)
    new_out += c.finish(1e12)
    live_rolls = {
        e.key: e.value
        for e in live_out
        if e.topic == "rollouts" and e.value["components"] is not None
    }
    new_rolls = {e.key: e.value for e in new_out if e.topic == "rollouts"}
    assert (
        sorted(new_rolls) == sorted(relabel_key(k, "v2") for k in live_rolls)
        and len(new_rolls) > 100
    )
    for rid, v1 in live_rolls.items():
        v2 = new_rolls[relabel_key(rid, "v2")]
        assert (
            v2["completion_tokens"] == v1["completion_tokens"]
            and v2["tool_errors"] == v1["tool_errors"]
        )
        joined = {k for k, v in v1["components"].items() if v is not None}
        assert {k for k, v in v2["components"].items() if v is not None} == joined
    no_feedback = sum(
        1 for e in live_out if e.topic == "rollouts" and e.value["components"] is None
    )
    assert c.counts.skipped["no_feedback"] == no_feedback > 0
    late = [e for e in live_out if e.topic == "late"]
    assert (
        c.counts.skipped["orphan_feedback"] + c.counts.skipped["feedback_after_close"]
        == len(late)
        > 0
    )


def test_since_and_until_select_generations_by_record_time_and_open_windows_are_left_to_the_live_worker():
    c = core(since=100.0, until=200.0)
    out, n = [], 0
    for rid, t in [("early", 90.0), ("in", 150.0), ("last", 199.0), ("late", 200.0)]:
        for ev in (gen(rid), fb(rid, f"{rid}-a", "accept")):
            out += c.feed(0, n, *rec(ev), t)
            n += 1
    out += c.finish(
        200.0 + W
    )  # the command's watermark with --until: every window before it is complete
    assert [e.key for e in out] == ["in|v2", "last|v2"]
    assert (
        c.counts.skipped["before_since"] == 1
        and c.counts.skipped["after_until"] == 1
        and c.counts.labelled == 2
    )
    c = core(since=100.0)
    out = c.feed(0, 0, *rec(gen("open")), 195.0) + c.feed(
        0, 1, *rec(fb("open", "o-a", "accept")), 195.5
    )
    out += c.finish(204.9)  # the run started before its window (deadline 205) closed
    assert out == [] and c.counts.skipped["window_open"] == 1 and c.counts.labelled == 0


def test_invalid_records_and_conflicting_generations_are_dead_lettered_with_their_bytes():
    c = core()
    out = c.feed(1, 5, b"k", b"{not json", 100.0)
    out += c.feed(1, 6, *rec(gen("r1")), 100.5)
    second = gen("r1", eid="other-gen")
    out += c.feed(1, 7, *rec(second), 101.0)
    [bad, conflict] = [DlqRecord.model_validate(e.value) for e in out]
    assert (bad.reason, bad.consumer, bad.partition, bad.offset) == (
        "invalid_json",
        "relabel",
        1,
        5,
    )
    assert base64.b64decode(bad.value_b64) == b"{not json" and bad.topic == "ns.interactions"
    assert (conflict.reason, conflict.offset) == ("conflicting_generation", 7)
    assert json.loads(base64.b64decode(conflict.value_b64)) == second
    assert c.counts.dead_lettered == {"invalid_json": 1, "conflicting_generation": 1}


def test_a_spec_name_that_cannot_form_a_key_is_refused():
    with pytest.raises(ValueError, match="cannot name relabelled rollouts"):
        RelabelOptions(
            spec=resolve_spec("v2|x", RewardWeights()),
            since=__import__("datetime").datetime.now().astimezone(),
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--reward-spec", "v2", "--since", "2026-11-21T10:00:00Z"], "unknown reward spec 'v2'"),
        (
            ["--reward-spec", "v1", "--since", "yesterday"],
            "--since 'yesterday' is not an RFC 3339 time",
        ),
        (["--reward-spec", "v1", "--since", "2026-11-21T10:00:00"], "timezone"),
        (
            [
                "--reward-spec",
                "v1",
                "--since",
                "2026-11-21T10:00:00Z",
                "--until",
                "2026-11-21T09:00:00Z",
            ],
            "must be after --since",
        ),
        (
            [
                "--reward-spec",
                "v2",
                "--reward-weights",
                '{"acept": 1}',
                "--since",
                "2026-11-21T10:00:00Z",
            ],
            "acept",
        ),
        (
            [
                "--reward-spec",
                "v2",
                "--reward-weights",
                "{not json",
                "--since",
                "2026-11-21T10:00:00Z",
            ],
            "--reward-weights is not",
        ),
        (
            [
                "--reward-spec",
                "v1",
                "--reward-weights",
                '{"accept": 2}',
                "--since",
                "2026-11-21T10:00:00Z",
            ],
            "pass --reward-spec a new name",
        ),
        (
            ["--reward-spec", "a|b", "--reward-weights", "{}", "--since", "2026-11-21T10:00:00Z"],
            "cannot name relabelled rollouts",
        ),
    ],
)
def test_cli_argument_errors_exit_2_with_a_clear_message(args, message):
    result = CliRunner().invoke(cli, ["streams", "relabel", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


def test_cli_requires_spec_and_since():
    result = CliRunner().invoke(cli, ["streams", "relabel", "--reward-spec", "v1"])
    assert result.exit_code == 2 and "--since" in result.output, result.output


def test_relabelling_a_hacked_session_under_sessions_v2_takes_back_its_outcome():
    """An agent weakened the test file (an apply_edit on test_x.py) and the test-running harness
    reported success: sessions-v1 pays the outcome +1, sessions-v2 (protected test files) -1. The
    records are otherwise the same, token for token."""
    events = hacked_turns()
    events.append(fb("h0", "r", "rating", session_id="hack", value=1))
    outcome = {**fb("h1", "o", "accept", session_id="hack"), "type": "session_outcome"}
    events.append({**outcome, "outcome": "success"})
    records = {}
    for name in ("sessions-v1", "sessions-v2"):
        c = _session_relabeller(name)
        out = [e for i, ev in enumerate(events) for e in c.feed(0, i, *rec(ev), 100.0 + i)]
        [e] = out + c.finish(150.0)
        assert e.key == f"h0|{name}" and c.counts.labelled == 1
        Rollout.model_validate(e.value)
        records[name] = e.value
    v1, v2 = records["sessions-v1"], records["sessions-v2"]
    assert v1["outcome"] == v2["outcome"] == "success"
    assert (v1["outcome_reward"], v1["reward"]) == (1.0, 0.5 + 1.0) and "protected_writes" not in v1
    assert (v2["outcome_reward"], v2["reward"]) == (-1.0, 0.5 - 1.0) and v2["protected_writes"] == 1
    assert [t["reward"] for t in v1["turns"]] == [t["reward"] for t in v2["turns"]] == [0.5, 0.0]
    differ = {"reward", "outcome_reward", "reward_spec", "protected_writes"}
    same = {k: v for k, v in v1.items() if k not in differ}
    assert same == {k: v for k, v in v2.items() if k not in differ}
    assert v2["completion_tokens"] == [10, 11, 7, 11, 12] and v2["loss_mask"] == [1, 1, 0, 1, 1]


def test_the_time_merge_releases_the_partitions_records_in_record_time_order():
    """Read a partition at a time, a session's outcome (partition 0) came before its turns
    (partition 1) and ended the session; the merge releases them by record time, and holds back
    while a partition still being read has nothing buffered."""
    from types import SimpleNamespace as R

    from streams.relabel import TimeMerge

    m = TimeMerge([0, 1])
    m.add(0, R(timestamp=30, name="outcome"))
    assert list(m.ready()) == []  # partition 1 may still hold something earlier
    for t, name in ((10, "turn 0"), (20, "turn 1"), (40, "turn 2")):
        m.add(1, R(timestamp=t, name=name))
    assert [r.name for _, r in m.ready()] == ["turn 0", "turn 1", "outcome"]
    assert (m.held(0), m.held(1)) == (0, 1)  # partition 0 may still hold something before 40
    m.done(0)
    assert [(p, r.name) for p, r in m.ready()] == [(1, "turn 2")]
    m.add(1, R(timestamp=50, name="late"))
    m.done(1)
    assert [r.name for _, r in m.ready()] == ["late"]
