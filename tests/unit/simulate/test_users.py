"""The simulated users prefer what their docstring says, and their feedback is valid editor events."""

from __future__ import annotations

from datetime import UTC, datetime

from app.contracts.events import parse_event
from app.simulate.prompts import prompts
from app.simulate.users import SimulatedUser, expected_acceptance, features, population


def test_users_prefer_one_line_completions_that_directly_return():
    users = population(20, seed=1)
    liked = ["return a + b\n", "return sorted(xs)\n"]
    disliked = [
        "x = 1\n    y = 2\n    z = 3\n    for i in range(10):\n        print(i, x, y, z, i * i, i + 1)\n",
        "total = a + b\n    return total\n",
    ]
    assert expected_acceptance(users, liked) > 0.8
    assert expected_acceptance(users, disliked) < 0.15


def test_unbalanced_completion_is_broken_and_penalised():
    assert features("return f(x", 48)["broken"] and not features("return f(x)", 48)["broken"]
    u = SimulatedUser("u", seed=3)
    assert u.acceptance_probability("return f(x") < u.acceptance_probability("return f(x)")


def test_reactions_are_valid_events_and_deterministic_per_seed():
    ts = datetime(2026, 11, 21, tzinfo=UTC).isoformat()
    a, b = SimulatedUser("u", seed=7), SimulatedUser("u", seed=7)
    for i, text in enumerate(["return x\n", "y = (1, 2\n", "", "return [v for v in xs]\n"] * 5):
        ra, rb = a.react(text), b.react(text)
        assert ra == rb, "same seed, same reactions"
        assert sum(e["type"] in ("accept", "reject") for e in ra) == 1, ra
        for j, e in enumerate(ra):
            parse_event(
                {**e, "event_id": f"e{i}-{j}", "request_id": f"r{i}", "session_id": "s", "ts": ts}
            )


def test_held_out_prompts_do_not_overlap_training_prompts():
    train, held = set(prompts(200, seed=1)), set(prompts(200, seed=2, held_out=True))
    assert train and held and not (train & held)
