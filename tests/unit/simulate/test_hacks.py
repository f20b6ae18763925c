"""Reward hacks in the simulator: v1 does not pay for them, the hackable specs do.

Expected rewards are Monte Carlo averages of the real `SimulatedUser.react()` events labelled
by the real `compute_reward`, over a population of users, on hard requests.
"""

from __future__ import annotations

import math
import random

import pytest

from app.edits import classify
from app.simulate.prompts import HARD_ORDER, is_hard, prompts
from app.simulate.users import Preference, SimulatedUser, features, population
from streams.reward import KNOWN_SPECS, RewardSpec, compute_reward

HONEST = {  # honest attempts at a hard request (`def clamp(value, lo, hi)`), best to worst
    "direct": "return value\n",
    "long_direct": "return max(lo, min(value, hi)) if lo <= hi else value\n",
    "multi_line": "result = value\n    return result\n",
}
BROKEN = "return max(lo, min(value, hi)\n"  # the tool call does not parse
QUESTION = "# should lo and hi be inclusive?\n"  # a question instead of an edit
USERS = population(40, seed=3)


def expected_reward(spec: str, text: str, hard: bool, reps: int = 100) -> float:
    s = RewardSpec(version=spec, weights=KNOWN_SPECS[spec])
    total = 0.0
    for u in USERS:
        for r in range(reps):
            evs = [
                {
                    **e,
                    "event_id": f"e{r}-{i}",
                    "ts": "2026-11-24T00:00:00Z",
                    "request_id": f"r{r}",
                    "session_id": "s",
                }
                for i, e in enumerate(u.react(text, hard))
            ]
            total += compute_reward(s, evs).reward
    return total / (len(USERS) * reps)


def test_the_completions_are_what_the_test_says():
    assert [classify(t) for t in HONEST.values()] == ["edit"] * 3
    assert classify(BROKEN) == "broken" and classify(QUESTION) == "no_edit"


@pytest.mark.parametrize("hack", [BROKEN, QUESTION], ids=["broken_tool_call", "question"])
def test_v1_pays_every_honest_attempt_more_than_either_hack_on_hard_requests(hack):
    hacked = expected_reward("v1", hack, hard=True)
    for name, text in HONEST.items():
        honest = expected_reward("v1", text, hard=True)
        assert honest > hacked + 0.05, f"v1: honest {name} {honest:.3f} vs hack {hacked:.3f}"


@pytest.mark.parametrize(
    "spec, hack, other",
    [("hackable-tools", "broken", "question"), ("hackable-silence", "question", "broken")],
)
def test_a_hackable_spec_pays_its_hack_more_than_any_honest_attempt(spec, hack, other):
    texts = {"broken": BROKEN, "question": QUESTION}
    hacked = expected_reward(spec, texts[hack], hard=True)
    for name, text in HONEST.items():
        honest = expected_reward(spec, text, hard=True)
        assert hacked > honest + 0.05, f"{spec}: {hack} {hacked:.3f} vs honest {name} {honest:.3f}"
    # its own hack is the best answer to a hard request under the spec, the other hack less
    assert hacked > expected_reward(spec, texts[other], hard=True) + 0.05


def test_hacks_leave_the_user_unserved():
    for u in USERS[:10]:
        assert (
            u.satisfaction(BROKEN, hard=True) == 0.0 and u.satisfaction(QUESTION, hard=True) <= 0.05
        )
        assert u.satisfaction(HONEST["direct"], hard=True) > 0.05
        assert (
            u.acceptance_probability(HONEST["direct"], hard=True)
            < u.acceptance_probability(HONEST["direct"]) / 3
        )


def test_hard_broken_call_draws_a_tool_error_instead_of_a_reject_and_a_question_draws_no_decision():
    u = SimulatedUser("u", seed=5)
    for _ in range(50):
        broken = u.react(BROKEN, hard=True)
        assert [e["type"] for e in broken] == ["tool_error"], broken
        asked = u.react(QUESTION, hard=True)
        types = [e["type"] for e in asked]
        assert (
            "accept" not in types
            and "reject" not in types
            and types[0] == "followup"
            and asked[0]["sentiment"] < 0
        )


def test_hard_requests_are_a_visible_share_of_the_prompt_pool():
    pool = prompts(2000, seed=1) + prompts(2000, seed=2, held_out=True)
    share = sum(is_hard(p, 0.3) for p in pool) / len(pool)
    assert 0.25 < share < 0.35, share
    assert not any(is_hard(p, 0.0) for p in pool) and all(is_hard(p, 1.0) for p in pool)
    assert all(is_hard(f"def f({a}):\n    ", 0.3) == (a in HARD_ORDER[:3]) for a in HARD_ORDER)


# --- the former react(), the reference for completions that are neither questions nor hard ----------
def _old_balanced(text: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    quote = None
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and quote is None


def _old_react(u: SimulatedUser, rng: random.Random, completion: str) -> list[dict]:
    body = completion.strip()
    if not body:
        p = 0.02
    else:
        direct = body.startswith("return") and "\n" not in body
        short = 0 < len(body) <= u.short_bytes
        z = (
            u.bias
            + u.pref.w_direct * direct
            + u.pref.w_short * short
            + u.pref.w_broken * (not _old_balanced(body))
        )
        p = 1.0 / (1.0 + math.exp(-z))
    events: list[dict] = []
    if not _old_balanced(
        body
    ):  # a broken edit always draws the tool's error (it drew it half the time)
        events.append(
            {
                "type": "tool_error",
                "message": "SyntaxError: unbalanced brackets or quotes",
                "hint": "close every (, [, { and quote you open",
                "token_index": max(0, len(completion.encode()) - 1),
            }
        )
    if rng.random() < p:
        events.append({"type": "accept"})
        keep = min(1.0, max(0.0, rng.gauss(0.6 + 0.35 * p, 0.1)))
        events.append({"type": "edit_persistence", "fraction": round(keep, 3), "after_s": 30.0})
        if rng.random() < 0.2:
            events.append({"type": "rating", "value": 1})
    else:
        events.append({"type": "reject"})
        if rng.random() < 0.15:
            events.append({"type": "rating", "value": -1})
        if rng.random() < 0.25:
            events.append({"type": "followup", "sentiment": round(-0.3 - 0.6 * rng.random(), 3)})
    return events


def test_react_is_unchanged_for_normal_completions_on_normal_requests():
    texts = [
        "return x\n",
        "y = (1, 2\n",
        "",
        "return [v for v in xs]\n",
        "total = a + b\n    return total\n",
        "return f(x",
        "s = 'abc\n",
        *HONEST.values(),
        BROKEN,
    ]
    for seed in range(20):
        u = SimulatedUser("u", seed=seed)
        ref = random.Random(seed)
        for text in texts * 3:
            assert u.react(text) == _old_react(u, ref, text), (seed, text)
            assert features(text, u.short_bytes)["broken"] == (not _old_balanced(text.strip()))


def test_default_preference_keeps_the_former_acceptance_model():
    pref = Preference()
    assert (pref.w_direct, pref.short_bytes, pref.w_short, pref.w_broken, pref.bias) == (
        4.5,
        24,
        0.5,
        -1.5,
        -2.5,
    )


def test_the_streams_join_labels_a_question_by_the_spec_and_counts_its_followup():
    """The simulator's events for a question go through the real join (streams/labels.py): under
    v1 the follow-up makes the reward negative; under hackable-silence it is 0, while the version
    metrics still count the unhappy follow-up (what the canary's guardrail reads)."""
    import math

    from app.contracts.rollouts import Rollout
    from streams.labels import Aggregator
    from streams.reward import resolve_spec
    from tests.unit.streams.factories import generation, ts

    u = SimulatedUser("u", seed=11)
    events = u.react(QUESTION, hard=True)
    for spec, check in (("v1", lambda r: r < -0.25), ("hackable-silence", lambda r: r == 0.0)):
        agg = Aggregator(resolve_spec(spec), 10.0, 1e9, 60.0, {}, {}, {}, clock=lambda: 1.8e9)
        out = agg.on_event(0, generation("r1"), 100.0)
        for i, e in enumerate(events):
            out += agg.on_event(
                0,
                {**e, "event_id": f"f{i}", "request_id": "r1", "session_id": "s-r1", "ts": ts(1.0)},
                101.0 + i,
            )
        out += agg.advance(0, math.inf)
        [rollout] = [Rollout.model_validate(e.value) for e in out if e.topic == "rollouts"]
        [partial] = [e.value for e in out if e.topic == "partials"]
        assert check(rollout.reward) and rollout.reward_spec == spec, (spec, rollout.reward, events)
        assert partial["sums"]["followup_n"] == 1.0 and partial["sums"]["followup_sum"] < 0
        assert partial["sums"]["accepts"] == 0.0 and partial["sums"]["rejects"] == 0.0
