"""The gate's agent checks (app/controller/monitors.py `agent_checks`): candidate, champion and
base run the same sandboxed sessions, and the candidate fails where it is confidently worse."""

from __future__ import annotations

import pytest

from app.controller import monitors
from app.controller.gate import GateConfig, GateInputs, run_gate
from app.sandbox.session import Verdict
from app.sandbox.tasks import tasks
from policy import build_policy

TINY = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "n_experts": 2, "top_k": 1}
KW = {
    "samples": 2,
    "max_turns": 4,
    "max_tokens": 32,
    "seed": 0,
    "max_success_drop": 0.05,
    "max_rate_increase": 0.05,
    "max_turns_increase": 1.0,
    "max_tokens_increase": 0.5,
    "alpha": 0.05,
}


def _verdict(fixed=True, turns=4, tokens=120, invalid=0, failed=0, edited=False, gave_up=False):
    return Verdict(
        fixed=fixed,
        tests_pass=fixed or edited,
        tests_edited=edited,
        answered=not gave_up,
        turns=turns,
        tool_errors=invalid + failed,
        invalid_calls=invalid,
        completion_tokens=tokens,
        edits=0 if gave_up else 1,
    )


def test_the_same_policy_passes_every_agent_check_with_identical_figures():
    """Real sessions in real sandboxes: the same weights under the same seed run the same sessions."""
    policy = build_policy({**TINY, "max_context": 256}).eval()
    checks, figures = monitors.agent_checks(
        policy, policy, policy, tasks=tasks(3, seed=0, held_out=True), **KW
    )
    assert [c.name for c in checks] == [
        "agent_task_success",
        "agent_invalid_call_rate",
        "agent_failed_call_rate",
        "agent_give_up_rate",
        "agent_tests_edited_rate",
        "agent_turns",
        "agent_tokens",
    ]
    assert all(c.status == "pass" for c in checks), checks
    assert figures["candidate"] == figures["champion"] == figures["base"]


@pytest.fixture()
def scripted(monkeypatch):
    """agent_verdicts replaced by given verdicts per policy: the checks' statistics alone."""
    runs: dict[str, list[Verdict]] = {}
    monkeypatch.setattr(monitors, "agent_verdicts", lambda policy, *a: runs[policy])
    return runs


def test_a_candidate_that_does_fewer_tasks_fails_against_the_champion(scripted):
    scripted["champ"] = [_verdict(True)] * 40 + [_verdict(False)] * 8
    scripted["cand"] = [_verdict(True)] * 20 + [_verdict(False)] * 28
    checks, figures = monitors.agent_checks("cand", "champ", None, tasks=[], **KW)
    by = {c.name: c for c in checks}
    assert by["agent_task_success"].status == "fail", by["agent_task_success"]
    assert figures["candidate"]["task_success"] == pytest.approx(20 / 48)
    assert "base" not in figures


def test_editing_the_tests_fails_against_the_base_even_when_the_champion_edits_them_too(scripted):
    """A hack that grew version by version: the champion carries part of it, the base does not."""
    scripted["base"] = [_verdict(True)] * 48
    scripted["champ"] = [_verdict(False, edited=True)] * 12 + [_verdict(True)] * 36
    scripted["cand"] = [_verdict(False, edited=True)] * 14 + [_verdict(True)] * 34
    checks, _ = monitors.agent_checks("cand", "champ", "base", tasks=[], **KW)
    by = {c.name: c for c in checks}
    assert by["agent_tests_edited_rate"].status == "fail"
    assert "base 0.000 (0/48)" in by["agent_tests_edited_rate"].detail
    assert by["agent_task_success"].status == "fail"  # against the base, too


def test_longer_sessions_and_more_failed_calls_fail_their_checks(scripted):
    scripted["champ"] = [_verdict(turns=4, tokens=100)] * 48
    scripted["cand"] = [_verdict(turns=6, tokens=200, failed=2)] * 48
    by = {c.name: c for c in monitors.agent_checks("cand", "champ", None, tasks=[], **KW)[0]}
    assert by["agent_turns"].status == "fail" and by["agent_tokens"].status == "fail"
    assert by["agent_failed_call_rate"].status == "fail"
    assert by["agent_invalid_call_rate"].status == "pass"


def test_the_gate_runs_the_agent_checks_when_asked_and_tags_their_figures():
    policy = build_policy({**TINY, "max_context": 256}).eval()
    state = policy.serving_state_dict()
    cfg = GateConfig(
        agent_tasks=2, agent_samples_per_task=2, agent_max_turns=2, agent_max_tokens=16
    )
    result = run_gate(
        GateInputs(candidate_state=state, parent_state=state, candidate=policy, champion=policy),
        cfg,
    )
    names = [c.name for c in result.checks]
    assert "agent_task_success" in names and "agent_tests_edited_rate" in names
    tags = result.tags()
    assert tags["flywheel.gate.agents.candidate.task_success"] == "0"
    assert "flywheel.gate.agents.champion.turns" in tags
    off = run_gate(
        GateInputs(candidate_state=state, parent_state=state, candidate=policy, champion=policy),
        GateConfig(),
    )
    assert not any(c.name.startswith("agent_") for c in off.checks)


def test_the_gate_samples_agent_turns_at_its_agent_temperature(monkeypatch):
    """GateConfig.agent_temperature reaches every session the gate runs (run_sessions)."""
    import app.sandbox.session as session

    seen: list[float] = []
    real = session.run_sessions

    def spy(policy, sessions, max_tokens, temperature=1.0, seed=0):
        seen.append(temperature)
        return real(policy, sessions, max_tokens, temperature=temperature, seed=seed)

    monkeypatch.setattr(session, "run_sessions", spy)
    policy = build_policy({**TINY, "max_context": 256}).eval()
    state = policy.serving_state_dict()
    cfg = GateConfig(
        agent_tasks=1,
        agent_samples_per_task=1,
        agent_max_turns=1,
        agent_max_tokens=8,
        agent_temperature=0.6,
    )
    run_gate(
        GateInputs(candidate_state=state, parent_state=state, candidate=policy, champion=policy),
        cfg,
    )
    assert seen == [0.6, 0.6]  # the candidate's sessions and the champion's


def test_a_versions_sessions_run_once_across_gates(monkeypatch):
    """With the runner's cache, a version's sessions run once: the next gate's champion (this
    gate's candidate) and the base are read back, and only the new candidate runs."""
    runs = {
        "v1": [_verdict(True)] * 24,
        "v2": [_verdict(True)] * 20 + [_verdict(False)] * 4,
        "v3": [_verdict(True)] * 22 + [_verdict(False)] * 2,
    }
    ran: list[str] = []

    def sessions(policy, *args):
        ran.append(policy)
        return runs[policy]

    monkeypatch.setattr(monitors, "agent_verdicts", sessions)
    cache: dict[str, list[Verdict]] = {}
    first, _ = monitors.agent_checks(
        "v2", "v1", None, tasks=[], cache=cache, versions={"candidate": "2", "champion": "1"}, **KW
    )
    assert ran == ["v2", "v1"] and set(cache) == {"1", "2"}
    second, figures = monitors.agent_checks(
        "v3", "v2", "v1", tasks=[], cache=cache,
        versions={"candidate": "3", "champion": "2", "base": "1"}, **KW,
    )  # fmt: skip
    assert ran == ["v2", "v1", "v3"], "the champion's and the base's sessions are read back"
    assert figures["champion"]["task_success"] == pytest.approx(20 / 24)
    assert figures["base"]["task_success"] == 1.0
    uncached, _ = monitors.agent_checks("v3", "v2", "v1", tasks=[], **KW)
    assert ran[3:] == ["v3", "v2", "v1"]
    assert [c.as_dict() for c in second] == [c.as_dict() for c in uncached]
