"""bench/heldout_interval.py's pieces: its Wilson interval, its tallies, and the yardstick it
measures (app/simulate/agent_eval.py `success_interval`) at the two ends it must get right."""

from __future__ import annotations

import random

import pytest

from app.simulate.agent_eval import success_interval
from bench.heldout_interval import Tally, main, scenario, sessions, wilson


def test_wilson_matches_the_closed_form_at_a_known_point():
    # 63 of 64, as scipy.stats.binomtest(63, 64).proportion_ci(method="wilson") gives it
    low, high = wilson(63, 64)
    assert low == pytest.approx(0.916659, abs=1e-6) and high == pytest.approx(0.997236, abs=1e-6)
    assert wilson(0, 10)[0] == pytest.approx(0.0) and wilson(10, 10)[1] == pytest.approx(1.0)


def test_the_yardstick_is_zero_wide_when_both_sessions_of_every_task_agree():
    mean, low, high = success_interval([1.0, 1.0, 0.0, 0.0, 1.0, 1.0], 2)
    assert (mean, low, high) == (pytest.approx(2 / 3), pytest.approx(2 / 3), pytest.approx(2 / 3))
    mean, low, high = success_interval([1.0, 0.0, 1.0, 1.0], 2)
    assert low < mean == 0.75 < high


def test_tally_counts_cover_width_and_a_second_score_below_the_first_interval():
    t = Tally()
    t.add(0.4, 0.6, truth=0.5, other_mean=0.3)
    t.add(0.4, 0.6, truth=0.7, other_mean=0.5)
    assert (t.covered, t.missed) == (1, 1) and t.width == pytest.approx(0.4)


def test_sessions_follow_each_tasks_probability():
    s = sessions([0.0, 1.0], 3, random.Random(1))
    assert s == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_tasks_alike_at_one_half_give_the_yardstick_about_its_nominal_coverage():
    # every task at p = 0.5 (concentration huge): the within-task variance is the whole variance
    ours, theirs = scenario(0.5, 1e6, tasks=32, k=2, reps=1500, rng=random.Random(3))
    assert 0.91 <= ours.covered / 1500 <= 0.98 and 0.91 <= theirs.covered / 1500 <= 0.98


def test_the_printout_names_every_scenario(capsys):
    main(["--reps", "20"])
    out = capsys.readouterr().out
    assert "run-18 late" in out and out.count("\n") == 3 + 8
