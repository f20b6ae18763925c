"""The canary's guardrails on user outcomes: a candidate whose reward looks better but whose users
accept, keep or like less is rolled back, and the reason names the guardrail."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, timedelta

from app.controller.canary import GUARDRAILS, ArmStats, Observe, analyze, transition
from app.registry.operator import CanaryConfig
from tests.unit.controller.test_canary import CFG, T0, arm, canary_state


def outcomes(
    n: int,
    reward_mean: float,
    accept: float,
    kept: float,
    followup_share: float = 0.0,
    sentiment: float = 0.0,
    tool_errors: float = 0.0,
) -> ArmStats:
    """n completions: a share `accept` accepted, mean kept fraction `kept` among them, a share
    `followup_share` with a follow-up of this sentiment, a share `tool_errors` with a tool error;
    rewards with the given mean (sd 0.5)."""
    base = arm(n, reward_mean)
    return replace(
        base,
        accepts=n * accept,
        persistence_sum=n * accept * kept,
        followup_n=n * followup_share,
        followup_sum=n * followup_share * sentiment,
        tool_error_rollouts=n * tool_errors,
    )


def test_guardrail_means_come_from_the_sums():
    a = analyze(
        outcomes(400, 0.5, 0.6, 0.8, 0.2, -0.5), outcomes(400, 0.5, 0.4, 0.5, 0.1, -0.5), CFG
    )
    g = a.guardrails
    assert set(g) == set(GUARDRAILS)
    assert (
        abs(g["acceptance_rate"]["candidate"] - 0.6) < 1e-12
        and abs(g["acceptance_rate"]["delta"] - 0.2) < 1e-12
    )
    assert (
        abs(g["kept_edit_rate"]["candidate"] - 0.48) < 1e-12
        and abs(g["kept_edit_rate"]["champion"] - 0.2) < 1e-12
    )
    assert abs(g["followup_sentiment"]["delta"] - (-0.1 + 0.05)) < 1e-12
    assert all(v["lower"] <= v["delta"] <= v["upper"] for v in g.values())


def test_a_hacked_candidate_with_a_better_reward_is_rolled_back_on_acceptance():
    # the reward says +0.2; users accept 0.30 instead of 0.50 of what they are shown
    cand, champ = outcomes(2000, 0.6, 0.30, 0.8), outcomes(2000, 0.4, 0.50, 0.8)
    assert analyze(cand, champ, CFG).verdict == "better_or_equal", (
        "the reward alone would advance it"
    )
    s, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), cand, champ), CFG)
    assert [(e["type"], e["version"], e["from_version"]) for e in out] == [
        ("rolled_back", "1", "2")
    ]
    assert (
        "guardrail acceptance_rate" in out[0]["reason"]
        and out[0]["details"]["guardrail"] == "acceptance_rate"
    )
    assert out[0]["details"]["analysis"]["guardrails"]["acceptance_rate"]["verdict"] == "worse"
    assert s.champion == "1" and "2" in s.failed


def test_kept_edits_and_followups_are_guardrails_too():
    kept_less = (outcomes(2000, 0.6, 0.5, 0.3), outcomes(2000, 0.4, 0.5, 0.9))
    _, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), *kept_less), CFG)
    assert out[0]["type"] == "rolled_back" and out[0]["details"]["guardrail"] == "kept_edit_rate", (
        out[0]["reason"]
    )
    unhappier = (outcomes(2000, 0.6, 0.5, 0.8, 0.9, -0.8), outcomes(2000, 0.4, 0.5, 0.8, 0.1, -0.5))
    _, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), *unhappier), CFG)
    assert (
        out[0]["type"] == "rolled_back" and out[0]["details"]["guardrail"] == "followup_sentiment"
    ), out[0]["reason"]
    broken_calls = (
        outcomes(2000, 0.6, 0.5, 0.8, tool_errors=0.3),
        outcomes(2000, 0.4, 0.5, 0.8, tool_errors=0.05),
    )
    _, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), *broken_calls), CFG)
    assert (
        out[0]["type"] == "rolled_back"
        and out[0]["details"]["guardrail"] == "tool_call_success_rate"
    ), out[0]["reason"]


def test_equal_outcomes_and_a_better_reward_advance():
    cand, champ = outcomes(2000, 0.6, 0.5, 0.8, 0.2, -0.5), outcomes(2000, 0.4, 0.5, 0.8, 0.2, -0.5)
    _, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), cand, champ), CFG)
    assert [e["type"] for e in out] == ["traffic_shifted"]


def test_guardrails_off_judges_the_reward_alone():
    cfg = CFG.model_copy(update={"guardrails": False})
    cand, champ = outcomes(2000, 0.6, 0.30, 0.8), outcomes(2000, 0.4, 0.50, 0.8)
    _, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), cand, champ), cfg)
    assert [e["type"] for e in out] == ["traffic_shifted"] and analyze(
        cand, champ, cfg
    ).guardrails == {}


def test_reward_only_stats_never_trip_a_guardrail():
    a = analyze(arm(400, 0.5), arm(400, 0.5), CFG)
    assert a.worst_guardrail() is None and all(
        g["verdict"] != "worse" and g["delta"] == 0 for g in a.guardrails.values()
    )


def test_false_guardrail_rollbacks_of_equal_arms_under_repeated_looks_are_rare():
    """Per-completion outcomes drawn from the same distribution for both arms, looked at after every
    batch of 50: the bounded-variance sequence must (almost) never call the candidate worse."""
    cfg = CanaryConfig(
        min_step=0, min_samples=50, margin=0.05, guardrail_margin=0.0, cs_target_n=1000
    )
    rng = random.Random(4)
    runs, tripped = 100, 0
    for _ in range(runs):
        c = h = ArmStats()
        for _ in range(40):
            for _ in range(50):
                for who in ("c", "h"):
                    acc = rng.random() < 0.4
                    keep = rng.random() if acc else 0.0
                    fu = rng.random() < 0.3
                    one = ArmStats(
                        1,
                        0.0,
                        0.0,
                        float(acc),
                        keep,
                        float(fu),
                        -rng.random() if fu else 0.0,
                        float(rng.random() < 0.1),
                    )
                    c, h = (c + one, h) if who == "c" else (c, h + one)
            if analyze(c, h, cfg).worst_guardrail() is not None:
                tripped += 1
                break
    assert tripped / runs <= 0.05, f"equal arms rolled back on a guardrail in {tripped}/{runs} runs"


def test_window_sums_carry_the_outcomes_and_old_records_read_as_zero():
    import json
    from datetime import datetime
    from types import SimpleNamespace

    import pytest

    from app.contracts.deployments import InvalidRecord
    from app.controller.controller import Controller, decode_metrics

    new = {
        "model_version": "2",
        "bucket_start": 100.0,
        "n": 10,
        "sums": {
            "n": 10.0,
            "reward_sum": 3.0,
            "reward_sumsq": 2.0,
            "accepts": 4.0,
            "persistence_sum": 3.2,
            "followup_n": 2.0,
            "followup_sum": -1.1,
            "tool_error_rollouts": 3.0,
        },
    }
    old = {
        "model_version": "2",
        "bucket_start": 101.0,
        "n": 5,
        "sums": {"n": 5.0, "reward_sum": 1.0, "reward_sumsq": 1.0},
    }
    for rec in (new, old):
        decode_metrics(json.dumps(rec).encode())
    buckets = SimpleNamespace(buckets={"a": new, "b": old})
    w = Controller.window(buckets, "2", datetime.fromtimestamp(50, tz=UTC))
    assert w == ArmStats(15, 4.0, 3.0, 4.0, 3.2, 2.0, -1.1, 3.0)
    for bad in (
        {"accepts": 11.0},
        {"persistence_sum": -1.0},
        {"followup_n": 2.0, "followup_sum": -2.5},
        {"tool_error_rollouts": 12.0},
    ):
        rec = dict(new, sums={**new["sums"], **bad})
        with pytest.raises(InvalidRecord) as err:
            decode_metrics(json.dumps(rec).encode())
        assert (
            err.value.reason == "invalid_metrics"
            and next(iter(bad)) in err.value.errors[0]["message"]
        )
