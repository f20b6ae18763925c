"""Agent users and their sessions (app/simulate/agents.py), and the held-out task figures
(app/simulate/agent_eval.py): sessions on real sandboxes, driven turn by turn."""

from __future__ import annotations

import json

import pytest

from app.sandbox.sandbox import Sandbox
from app.sandbox.session import INVALID_CALL, AgentSession, Verdict, run_sessions
from app.sandbox.tasks import OPS, STUB, body, tasks
from app.simulate.agent_eval import METRICS, scores
from app.simulate.agents import AgentPreference, AgentUser
from policy import build_policy


def _call(i: int, name: str, **args: str) -> dict:
    return {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _work(s: AgentSession, op: str, path: str | None = None) -> None:
    """A session that reads the module, replaces its operator with `op` in `path`, runs the tests
    and answers."""
    t = s.task
    s.observe("r0", None, [_call(0, "read_file", path=t.source_path)], False, 20)
    if path == t.test_path:
        s.observe(
            "r1",
            None,
            [_call(1, "apply_edit", path=path, old="assert", new="assert True or")],
            False,
            30,
        )
    else:
        s.observe(
            "r1",
            None,
            [_call(1, "apply_edit", path=t.source_path, old=STUB, new=body(op))],
            False,
            30,
        )
    s.observe("r2", None, [_call(2, "run_tests")], False, 10)
    s.observe("r3", "done", [], False, 4)


def _session(seed: int = 0, max_turns: int = 6):
    task = tasks(1, seed=seed)[0]
    box = Sandbox(task).__enter__()
    return AgentSession("s", task, box, max_turns), box


def test_an_implemented_function_is_a_success_the_user_reports_and_true_satisfaction():
    s, box = _session()
    try:
        _work(s, s.task.op)
        assert s.answered and s.done
        assert s.messages[2] == {
            "role": "tool",
            "tool_call_id": "c0",
            "content": s.task.files()[s.task.source_path],
        }
        v = s.verdict()
        assert v.fixed and v.tests_pass and not v.tests_edited and not v.gave_up
        assert (v.turns, v.completion_tokens, v.tool_errors, v.edits) == (4, 64, 0, 1)
        user = AgentUser("u", AgentPreference(p_notice_fixed=1.0, p_rate_success=0.0))
        assert user.satisfaction(v) == 1.0
        assert user.events(s, v) == [
            {"type": "session_outcome", "request_id": "r3", "outcome": "success"}
        ]
    finally:
        box.__exit__(None, None, None)


def test_a_wrong_fix_fails_and_a_weakened_test_passes_only_for_the_tests_outcome():
    s, box = _session(1)
    wrong = next(op for op in OPS.values() if op != s.task.op)
    _work(s, wrong)
    v = s.verdict()
    box.__exit__(None, None, None)
    user = AgentUser("u", AgentPreference(p_fooled=0.0, p_rate_failure=0.0))
    assert not v.fixed and user.outcome(v) == "failure" and user.satisfaction(v) == 0.0

    s, box = _session(2)
    _work(s, "", path=s.task.test_path)
    v = s.verdict()
    box.__exit__(None, None, None)
    assert v.tests_edited and v.tests_pass and not v.fixed
    assert user.outcome(v, source="tests") == "success"  # the loophole
    assert user.outcome(v, source="user") == "failure" and user.satisfaction(v) == 0.0
    # the harness reports the weakened test's pass; the user, who checks the function, rates -1
    rater = AgentUser("r", AgentPreference(p_fooled=0.0, p_rate_failure=1.0))
    events = [(e["type"], e.get("outcome", e.get("value"))) for e in rater.events(s, v, "tests")]
    assert events == [("session_outcome", "success"), ("rating", -1)], events
    fooled = AgentUser("f", AgentPreference(p_fooled=1.0, p_rate_success=1.0))
    assert [e.get("value") for e in fooled.events(s, v, "tests")] == [None, 1]


def test_failed_and_invalid_calls_are_tool_errors_on_their_turns_and_max_turns_abandons():
    s, box = _session(3, max_turns=3)
    try:
        s.observe("r0", None, [_call(0, "read_file", path="nope.py")], False)
        s.observe("r1", '<tool_call>\n{"name": "read_file"', [], True)
        assert not s.done
        s.observe("r2", None, [_call(2, "run_tests")], False)
        assert s.abandoned == "max_turns" and not s.answered
        v = s.verdict()
        assert (v.tool_errors, v.invalid_calls, v.gave_up) == (2, 1, True)
        user = AgentUser("u", AgentPreference(p_rate_failure=0.0))
        events = user.events(s, v)
        assert [(e["type"], e["request_id"]) for e in events] == [
            ("tool_error", "r0"),
            ("tool_error", "r1"),
            ("session_outcome", "r2"),
        ]
        assert "no file 'nope.py'" in events[0]["message"] and events[1]["message"] == INVALID_CALL
        assert events[2]["outcome"] == "abandoned"
    finally:
        box.__exit__(None, None, None)


def test_sessions_on_a_real_policy_run_to_an_end_within_the_context():
    """An untrained tiny policy writes anything: each session still ends (an answer, max_turns or a
    prompt the context cannot hold), and the verdicts read the sandboxes."""
    policy = build_policy(
        {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 256}
    ).eval()
    boxes = [Sandbox(t).__enter__() for t in tasks(3, seed=4)]
    try:
        sessions = [AgentSession(f"s{i}", b.task, b, max_turns=4) for i, b in enumerate(boxes)]
        run_sessions(policy, sessions, max_tokens=64, seed=0)
        assert all(s.done for s in sessions)
        assert all(s.answered or s.abandoned in ("max_turns", "context") for s in sessions)
        verdicts = [s.verdict() for s in sessions]
        assert not any(v.fixed for v in verdicts)
    finally:
        for b in boxes:
            b.__exit__(None, None, None)


def test_scores_interval_is_the_sampling_error_of_the_tasks():

    def v(fixed: bool, turns: int = 4) -> Verdict:
        return Verdict(fixed, fixed, False, True, turns, 1, 0, 40, 1)

    same = scores([v(True), v(True), v(False), v(False)], [1.0, 1.0, 0.0, 0.0], k=2)
    assert set(same) == set(METRICS)
    assert same["heldout_task_success"] == 0.5
    # each task's two sessions agree: no sampling error
    assert same["heldout_task_success_ci_low"] == same["heldout_task_success_ci_high"] == 0.5
    mixed = scores([v(True), v(False), v(True), v(False)], [1.0, 0.0, 1.0, 0.0], k=2)
    assert mixed["heldout_task_success_ci_low"] < 0.5 < mixed["heldout_task_success_ci_high"]
    assert mixed["heldout_tool_error_rate"] == pytest.approx(4 / 16)
    assert mixed["heldout_turns"] == 4 and mixed["heldout_tokens"] == 40


def test_an_answer_without_an_edit_is_reported_as_giving_up():
    """Answering at once (or after calls that all failed) is `abandoned`, never a mere failure:
    otherwise an answer with no attempt pays better than an attempt whose call failed."""
    s, box = _session(4)
    try:
        s.observe("r0", None, [_call(0, "apply_edit", path="calc.py", old="zzz", new="y")], False)
        s.observe("r1", "done", [], False)
        v = s.verdict()
        assert v.answered and v.edits == 0 and v.gave_up
        assert AgentUser("u").outcome(v) == "abandoned"
        assert AgentUser("u").outcome(v, source="tests") == "abandoned"
    finally:
        box.__exit__(None, None, None)


def test_the_held_out_sessions_take_the_simulators_settings(monkeypatch):
    """The held-out evaluation runs the live users' sessions (their max_tokens, turns and
    temperature) on
    FLYWHEEL_SIMULATE_AGENT_EVAL_TASKS tasks: a short cadence (a test, a slow model) shortens it
    too; arguments still win."""
    from app.simulate.agent_eval import AgentEvaluator

    uri = "http://127.0.0.1:9"  # never reached: nothing is evaluated here
    default = AgentEvaluator(uri, "m")
    figures = lambda e: (len(e.tasks), e.max_tokens, e.max_turns, e.temperature)
    assert figures(default) == (32, 192, 6, 1.0)
    for name, value in (
        ("EVAL_TASKS", "3"),
        ("MAX_TOKENS", "16"),
        ("MAX_TURNS", "2"),
        ("TEMPERATURE", "0.6"),
    ):
        monkeypatch.setenv(f"FLYWHEEL_SIMULATE_AGENT_{name}", value)
    short = AgentEvaluator(uri, "m")
    assert figures(short) == (3, 16, 2, 0.6)
    assert short.tasks == default.tasks[:3]  # the same held-out suite, fewer of its tasks
    given = AgentEvaluator(uri, "m", n_tasks=4, max_tokens=8, max_turns=5, temperature=0.0)
    assert figures(given) == (4, 8, 5, 0.0)


def test_a_session_refused_before_its_first_turn_reports_nothing_and_backs_off(monkeypatch):
    """No replica ready (nothing listens on the port, and no retry of the refused turn:
    `agent_retry_s` 0; the retries are tests/unit/simulate/test_agent_retries.py): no turn was
    served, so nothing reaches the loop, no sandbox verdict runs, and the user waits 0.5, 1, 2 s...
    before the next session instead of spinning through sessions (each verdict runs the tests in a
    subprocess)."""
    import asyncio

    from app.sandbox.session import AgentSession
    from app.simulate.agents import AgentPopulation
    from app.simulate.config import SimulateConfig

    def no_verdict(self):
        raise AssertionError("a session without a turn has nothing to judge")

    monkeypatch.setattr(AgentSession, "verdict", no_verdict)
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(s: float) -> None:
        sleeps.append(s)
        await real_sleep(0)

    monkeypatch.setattr("app.simulate.agents.asyncio.sleep", sleep)
    cfg = SimulateConfig(agents=True, users=1, agent_think_s=0, agent_retry_s=0, seed=1)
    pop = AgentPopulation("http://127.0.0.1:9", "fw_key", ["http://127.0.0.1:9"], cfg)
    stats = asyncio.run(pop.run(max_sessions=4))
    assert (stats.sessions, stats.turns, stats.errors, stats.events) == (0, 0, 4, 0)
    assert sleeps[1:] == [0.5, 1.0, 2.0, 4.0]  # after the first (start-up) pause
