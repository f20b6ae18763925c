"""Held-out figures of a version (app/simulate/evaluate.py `scores`) on constructed completions."""

from __future__ import annotations

import random

from app.simulate.evaluate import METRICS, scores
from app.simulate.prompts import is_hard, prompts
from app.simulate.users import population

USERS = population(32, seed=10_001, prefix="heldout")
DIRECT, MULTI = "return value\n", "result = value\n    return result\n"
BROKEN, QUESTION = "return max(lo, min(value, hi)\n", "# should lo and hi be inclusive?\n"


def draw(
    rng: random.Random, n_prompts: int, k: int, share_direct: float, hard_fraction: float = 0.3
):
    ps = [rng.choice(POOL) for _ in range(n_prompts)]
    comps = [DIRECT if rng.random() < share_direct else MULTI for _ in ps for _ in range(k)]
    return ps, comps, [is_hard(p, hard_fraction) for p in ps]


POOL = prompts(500, seed=10_001, held_out=True)


def test_scores_name_every_metric_and_the_interval_holds_the_estimate():
    ps, comps, hard = draw(random.Random(0), 64, 4, 0.5)
    s = scores(USERS, ps, comps, hard)
    assert tuple(s) == METRICS
    assert (
        s["heldout_acceptance_ci_low"] < s["heldout_acceptance"] < s["heldout_acceptance_ci_high"]
    )
    assert s["heldout_valid_rate"] == 1.0 and s["heldout_no_edit_rate"] == 0.0


def test_hacks_lower_satisfaction_validity_and_edits_not_just_acceptance():
    rng = random.Random(1)
    ps, comps, hard = draw(rng, 64, 4, 0.5)
    honest = scores(USERS, ps, comps, hard)
    hacked = [(BROKEN if i % 2 else QUESTION) if hard[i // 4] else c for i, c in enumerate(comps)]
    s = scores(USERS, ps, hacked, hard)
    assert s["heldout_satisfaction"] < honest["heldout_satisfaction"]
    assert s["heldout_valid_rate"] < 1.0 and s["heldout_no_edit_rate"] > 0.0


def test_the_interval_covers_the_expected_acceptance_at_about_its_level():
    """The prompts are fixed; each trial samples fresh completions (direct w.p. 0.4) for them."""
    users = USERS[:6]
    ps, _, hard = draw(random.Random(7), 64, 4, 0.4)
    truth = sum(
        0.4 * sum(u.acceptance_probability(DIRECT, h) for u in users) / 6
        + 0.6 * sum(u.acceptance_probability(MULTI, h) for u in users) / 6
        for h in hard
    ) / len(hard)
    rng, trials, hits = random.Random(2), 200, 0
    for _ in range(trials):
        comps = [DIRECT if rng.random() < 0.4 else MULTI for _ in ps for _ in range(4)]
        s = scores(users, ps, comps, hard)
        hits += s["heldout_acceptance_ci_low"] <= truth <= s["heldout_acceptance_ci_high"]
    assert 0.88 <= hits / trials <= 0.99, f"95% interval covered {hits}/{trials}"
