"""Simulated agent users on the real parts: sessions over a real replica's chat completions with
the sandbox's tools, and each session's feedback through the real ingest API onto the session's
Kafka broker, each user running two sessions on each task at once (a group). The replica serves tiny version 7 (untrained, context 1,024), so what it writes is
mostly not a call; the sessions still run to their end and report as an editor would. The tools'
execution and the users' judgement are shown turn by turn in tests/unit/simulate/test_agents.py."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import pytest

from app.simulate.agents import AgentPopulation
from app.simulate.config import SimulateConfig
from tests.integration.clients.servers import serve_api, serve_replica
from tests.integration.replica.conftest import read_topic

pytestmark = pytest.mark.integration


def test_agent_users_run_sessions_and_report_each_ones_outcome_on_its_last_turn(
    make_settings, tmp_path
):
    settings = make_settings()
    replica = serve_replica(settings, tmp_path, "replica-agents", max_context=1024)
    api, ingest_key = serve_api(settings, "agents")
    cfg = SimulateConfig(
        agents=True,
        users=2,
        agent_max_turns=3,
        agent_max_tokens=48,
        agent_temperature=0.7,
        agent_parallel=2,
        agent_think_s=0,
        seed=5,
    )
    try:
        pop = AgentPopulation(api.url, ingest_key, [replica.url], cfg)
        stats = asyncio.run(pop.run(max_sessions=4))
    finally:
        api.stop()
        replica.stop()
    assert stats.sessions == 4 and stats.errors == 0, stats
    assert sum(stats.outcomes.values()) == 4

    def ours(e: dict) -> bool:
        return str(e.get("session_id", "")).startswith("agent-user-5-")

    generations = read_topic(
        settings, "interactions", stats.turns, where=lambda e: ours(e) and e["type"] == "generation"
    )
    outcomes = read_topic(
        settings, "interactions", 4, where=lambda e: ours(e) and e["type"] == "session_outcome"
    )
    assert len(generations) == stats.turns and len(outcomes) == 4
    assert {g["temperature"] for g in generations} == {0.7}  # FLYWHEEL_SIMULATE_AGENT_TEMPERATURE
    turns = defaultdict(list)
    for g in generations:
        turns[g["session_id"]].append(g)
    assert len(turns) == 4
    groups = defaultdict(set)  # each task's two sessions: one group, the same first prompt
    for g in generations:
        groups[g["group_id"]].add(g["session_id"])
    assert None not in groups and sorted(len(v) for v in groups.values()) == [2, 2], groups
    for members in groups.values():
        first = [next(g for g in turns[m] if g["turn"] == 0) for m in members]
        assert first[0]["prompt_tokens"] == first[1]["prompt_tokens"]
    for o in outcomes:
        session = sorted(turns[o["session_id"]], key=lambda g: g["turn"])
        assert [g["turn"] for g in session] == list(range(len(session))) and len(session) <= 3
        assert o["request_id"] == session[-1]["request_id"]  # the outcome names the last turn
        assert o["outcome"] in ("success", "failure", "abandoned")
        if len(session) == 3 and session[-1].get("tool_calls"):
            assert o["outcome"] == "abandoned"  # three turns of calls: max_turns
    # a turn that wrote a call that is not one drew a tool error
    errors = read_topic(
        settings,
        "interactions",
        sum(1 for g in generations if g.get("invalid_tool_calls")),
        where=lambda e: ours(e) and e["type"] == "tool_error",
        timeout_s=10,
    )
    by_request = Counter(e["request_id"] for e in errors)
    for g in generations:
        if g.get("invalid_tool_calls"):
            assert by_request[g["request_id"]] == 1, g
