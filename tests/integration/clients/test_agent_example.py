"""examples/agent/: the coding agent run against a real replica and a real ingest API.

The replica serves the tiny untrained model (version 7, context widened to 8192 tokens for the
tools and their outputs); under `tool_choice: "required"` constrained decoding makes every turn a
call with arguments that validate, so the tools really run on the copy of the sample repository,
though the model will not fix its bug. What is asserted is the mechanics: each call's effect on
the copy, the original left alone, the agent's own test run, and every piece of feedback (a
`tool_error` per failed call, the session's outcome since the tests still fail) on Kafka next
to the replica's generation events.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.api.conftest import api_factory  # noqa: F401
from tests.integration.replica.conftest import read_topic, replica_factory, seeded_replica  # noqa: F401

EXAMPLE = REPO / "examples" / "agent"
KEY = "agent-serving-key"


def _load_agent():
    spec = importlib.util.spec_from_file_location("flywheel_example_agent", EXAMPLE / "agent.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def _digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts
    }


def test_the_sample_repository_fails_until_the_fix_through_the_tools(tmp_path):
    """The tools over a copy, without a model: the bug is there and apply_edit can fix it."""
    agent = _load_agent()
    ws = agent.Workspace(agent.SAMPLE_REPO, tmp_path / "repo")
    assert ws.files() == ["pytest.ini", "stats.py", "tests/test_stats.py"]
    before = ws.run_tests()
    assert not before.passed and "1 failed, 2 passed" in before.output, before.output
    with pytest.raises(agent.ToolError, match="occurs 0 times"):
        ws.apply_edit("stats.py", "no such text", "x")
    with pytest.raises(agent.ToolError, match="no file"):
        ws.read_file("../secret")
    assert "len(values) - 1" in ws.read_file("stats.py")
    ws.apply_edit("stats.py", "(len(values) - 1)", "len(values)")
    after = ws.run_tests()
    assert after.passed and "3 passed" in after.output, after.output


@pytest.mark.integration
def test_the_agent_runs_its_tools_and_reports_feedback(seeded_replica, api_factory, tmp_path):
    import openai

    from app.client import FeedbackClient

    agent = _load_agent()
    srv = seeded_replica(
        id="replica-agent", api_key=KEY, max_context=8192, max_tokens=1024, max_n=1
    )
    api = api_factory()
    original = _digest(agent.SAMPLE_REPO)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    with FeedbackClient(api.url, api.ingest_key, flush_interval_s=0) as fc:

        def run(name: str, max_turns: int, max_tokens: int):
            return agent.run_agent(
                client,
                fc,
                model=srv.settings.model_name,
                workdir=tmp_path / name / "repo",
                max_turns=max_turns,
                max_tokens=max_tokens,
            )

        out = run("work", max_turns=4, max_tokens=1024)
        # A budget no call fits in: every turn's call is cut off, a failed action to report.
        cut = run("cut", max_turns=2, max_tokens=24)

    # The copy was worked on, the original was not.
    assert out.workdir == tmp_path / "work" / "repo" and _digest(agent.SAMPLE_REPO) == original
    assert 1 <= len({s.turn for s in out.steps}) <= 4
    names = {"read_file", "apply_edit", "run_tests", "finish"}
    for s in out.steps:
        assert s.tool in names, s  # required: every turn is a call of a listed tool
        if s.tool == "read_file":
            assert s.error is None and s.output == (out.workdir / s.arguments["path"]).read_text()
        elif s.tool == "apply_edit" and s.error is None:
            assert s.arguments["new"] in (out.workdir / s.arguments["path"]).read_text()
        elif s.tool == "run_tests":
            assert s.error is None and s.output.startswith("exit code ")
    assert out.finished == any(s.tool == "finish" for s in out.steps)
    # The agent's own test run: the untrained model did not fix the bug.
    assert out.tests is not None and not out.tests.passed, out.tests
    assert out.tests.output.startswith("exit code ") and out.tests.output != "exit code 0\n"

    # Every completion is a generation event of the session; every feedback event is on Kafka.
    request_ids = list(dict.fromkeys(s.request_id for s in out.steps))
    generations = read_topic(
        srv.settings,
        "interactions",
        len(request_ids),
        where=lambda e: e.get("session_id") == out.session_id,
    )
    assert sorted(e["request_id"] for e in generations) == sorted(request_ids)
    assert all(e["constrained"] and e["tool_choice"] == "required" for e in generations)
    assert sorted(e["turn"] for e in generations) == list(range(len(request_ids)))

    errors = [s for s in out.steps if s.error]
    want = 1 + len(errors)
    assert len(out.feedback) == want
    feedback = read_topic(
        api.settings, "interactions", want, where=lambda e: e.get("session_id") == out.session_id
    )
    assert sorted(e["event_id"] for e in feedback) == sorted(out.feedback)
    [outcome] = [e for e in feedback if e["type"] == "session_outcome"]
    assert outcome["request_id"] == request_ids[-1]
    assert outcome["outcome"] == ("failure" if out.finished else "abandoned"), outcome
    tool_errors = sorted(
        (e["request_id"], e["message"], e["token_index"])
        for e in feedback
        if e["type"] == "tool_error"
    )
    assert tool_errors == sorted((s.request_id, s.error, 0) for s in errors)

    assert [(s.tool, s.error is not None) for s in cut.steps] == [(None, True), (None, True)]
    cut_feedback = read_topic(
        api.settings, "interactions", 3, where=lambda e: e.get("session_id") == cut.session_id
    )
    assert sorted((e["type"], e.get("outcome")) for e in cut_feedback) == [
        ("session_outcome", "abandoned"),
        ("tool_error", None),
        ("tool_error", None),
    ]
    assert all(
        e["message"].startswith("the completion ended (max_tokens)")
        for e in cut_feedback
        if e["type"] == "tool_error"
    )
