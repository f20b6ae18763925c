"""bench/agent_rl.py's rewards: `reported_reward` labels a session as the streams label what its
agent user reports (each turn's `compute_reward` plus the session's outcome under sessions-v1),
and `reward` as the truth reported."""

from __future__ import annotations

import json

from app.sandbox.sandbox import Sandbox
from app.sandbox.session import AgentSession
from app.sandbox.tasks import STUB, body, tasks
from app.simulate.agents import AgentUser
from bench.agent_rl import reported_reward, reward


def _call(i: int, name: str, **args: str) -> dict:
    return {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def test_reported_reward_is_the_streams_label_of_what_the_user_reported() -> None:
    task = tasks(1, seed=4)[0]
    with Sandbox(task) as box:
        s = AgentSession("s", task, box, max_turns=6)
        s.observe("r0", None, [_call(0, "read_file", path="nope.py")], False, 10)  # a tool error
        s.observe(
            "r1",
            None,
            [_call(1, "apply_edit", path=task.source_path, old=STUB, new=body(task.op))],
            False,
            30,
        )
        s.observe("r2", "done", [], False, 4)
        v = s.verdict()
    assert v.fixed and v.tool_errors == 1
    assert reward(v) == -0.5 + 1.0
    seen = set()
    for seed in range(40):
        events = AgentUser("u", seed=seed).events(s, v)
        outcome = next(e["outcome"] for e in events if e["type"] == "session_outcome")
        rating = next((e["value"] for e in events if e["type"] == "rating"), 0)
        expected = -0.5 + {"success": 1.0, "failure": -0.5}[outcome] + 0.5 * rating
        # the same draws: a fresh user with the same seed reports the same
        assert reported_reward(AgentUser("u", seed=seed), s, v) == expected, (seed, events)
        seen.add((outcome, rating))
    assert ("success", 0) in seen and ("success", 1) in seen, seen  # the dice were rolled


def test_skill_reads_each_verbs_right_operator_off_the_probe() -> None:
    from bench.agent_rl import skill
    from policy import build_policy
    from trainer.skill_probe import probe

    policy = build_policy(
        {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16, "max_context": 1024}
    ).eval()
    p, s = probe(policy), skill(policy)
    assert s["p_right_operator"] == p["p_right"]
    assert s["p_right_by_verb"] == {
        "add": p["by_verb"]["add"][0],
        "sub": p["by_verb"]["sub"][1],
        "mul": p["by_verb"]["mul"][2],
        "div": p["by_verb"]["div"][3],
    }
