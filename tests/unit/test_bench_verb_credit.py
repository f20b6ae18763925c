"""bench/verb_credit.py: a rollout record's verb and operator, the trainer's positive advantage
per (verb, operator) with the part from groups where no session succeeded, and records read back
from a Kafka log segment as the embedded broker writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.sandbox.tasks import STUB, body
from bench.verb_credit import Session, credit, log_records, parse, replay
from tests.unit.trainer.test_validate import record as validate_record


def record(i: int, verb: str, op: str | None, reward: float, outcome: str, group: str) -> bytes:
    prompt = f"tools: read_file(path)\nuser: implement {verb}_rows in calc.py\nassistant: "
    edit = f'{{"old": "{STUB}", "new": "{body(op)}"}}' if op else "no edit"
    completion = [*edit.encode(), 300]  # an id past the bytes is skipped
    return json.dumps(
        validate_record(  # a record of the topic's contract (trainer/validate.py's tests)
            request_id=f"r{i}",
            session_id=f"s{i}",
            group_id=group,
            model_version="3",
            prompt_tokens=list(prompt.encode()),
            completion_tokens=completion,
            logprobs=[-0.1] * len(completion),
            routes=None,
            route_shape=None,
            reward=reward,
            outcome=outcome,
            tokenizer="byte-v1",
        )
    ).encode()


def test_a_record_s_verb_and_the_operator_its_edit_wrote() -> None:
    s = parse(record(0, "mul", "+", -0.5, "failure", "g"))
    assert s == Session(3, "mul", "+", -0.5, False, "g", "request:r0")  # a one-call record
    assert parse(record(1, "div", "//", 1.0, "success", "g")).op == "//"
    assert parse(record(2, "sub", None, -1.0, "abandoned", "g")).op == "?"
    other = json.loads(record(3, "add", "+", 1.0, "success", "g"))
    other["prompt_tokens"] = list(b"user: write a poem\nassistant: ")
    assert parse(json.dumps(other).encode()) is None
    hf = dict(other, tokenizer="hf:tiny")
    with pytest.raises(SystemExit, match="tokenizer 'hf:tiny'"):
        parse(json.dumps(hf).encode())


def test_the_positive_advantage_per_verb_and_operator_and_where_no_session_succeeded() -> None:
    # group a (mul): all failed; the failure without a tool error (-0.5, wrote +) beats the two
    # with one (-1.0): mean -5/6, +1/3 above it, the group's std 0.2357 -> advantage 1.414
    # group b (add): one success (+1, wrote +) against a failure (-0.5, wrote *): +0.75, or 1.0
    rows = [
        Session(1, "mul", "+", -0.5, False, "a", "s1"),
        Session(1, "mul", "*", -1.0, False, "a", "s2"),
        Session(1, "mul", "-", -1.0, False, "a", "s3"),
        Session(1, "add", "+", 1.0, True, "b", "s4"),
        Session(1, "add", "*", -0.5, False, "b", "s5"),
        Session(1, "sub", "-", 1.0, True, "c", "s6"),  # alone in its group: no baseline
    ]
    total, failed = credit(rows, "group")
    assert total[("mul", "+")] == pytest.approx(2**0.5, rel=1e-4)
    assert failed[("mul", "+")] == total[("mul", "+")]
    assert total[("add", "+")] == pytest.approx(1.0, rel=1e-4) and failed[("add", "+")] == 0
    assert set(total) == {("mul", "+"), ("add", "+")}
    none, _ = credit(rows, "none")
    assert none[("mul", "+")] == pytest.approx(1 / 3) and none[("add", "+")] == pytest.approx(0.75)
    # only successes pushed up: group a's least bad failure gets nothing, group b is as it was
    held, held_failed = credit(rows, "none", needs_success=True)
    assert set(held) == {("add", "+")} and held[("add", "+")] == pytest.approx(0.75)
    assert not +held_failed


def test_records_are_read_back_from_a_log_segment(tmp_path: Path) -> None:
    from kafka.record import MemoryRecordsBuilder

    values = [record(i, "add", "+", 1.0, "success", "g") for i in range(3)]
    for part, vs in enumerate((values[:2], values[2:])):
        b = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20)
        for v in vs:
            b.append(timestamp=len(vs), key=None, value=v)
        b.close()
        seg = tmp_path / "kafka" / "data" / f"flywheel.rollouts-{part}"
        seg.mkdir(parents=True)
        (seg / "00000000000000000000.log").write_bytes(bytes(b.buffer()))
    assert list(log_records(tmp_path)) == [(2, values[0]), (2, values[1]), (1, values[2])]
    with pytest.raises(SystemExit, match="not a run's data dir"):
        list(log_records(tmp_path / "elsewhere"))


def test_replay_trains_a_saved_policy_on_the_records_and_probes_it(tmp_path: Path, capsys) -> None:
    """`--replay`: the records' sessions above their group's mean move the policy (a tiny one
    here, saved as a run's base is), and the probe is printed before and after."""
    from policy import build_policy
    from policy.checkpoint import save_policy
    from tests.unit.policy.conftest import TINY

    save_policy(build_policy({**TINY, "max_context": 1024}), tmp_path / "base")
    values = []
    for i in range(16):
        ok = i % 2 == 1
        rec = json.loads(
            record(
                i,
                "mul",
                "*" if ok else "+",
                1.0 if ok else -0.5,
                "success" if ok else "failure",
                f"g{i // 4}",
            )
        )
        rec["completion_tokens"] = rec["completion_tokens"][:-1]  # bytes only: the tiny vocabulary
        rec["logprobs"] = rec["logprobs"][:-1]
        values.append(json.dumps(dict(rec, temperature=0.6)).encode())
    # the trainer's validation reads the records: one past the vocabulary is refused, left out
    values.append(record(99, "mul", "*", 1.0, "success", "g9"))
    last = replay(values, str(tmp_path / "base"), "none", 0.0, True, 1e-2, False, probe_every=1)
    out = capsys.readouterr().out
    assert "left out 1 refused records: {'token_out_of_vocab': 1}" in out
    assert "step 0: p(right)" in out and "step 1: p(right)" in out
    before = float(out.split("step 0: p(right) ")[1].split(";")[0])
    assert abs(last["p_right"] - before) > 1e-3, "a step of lr 1e-2 moved the probe"
