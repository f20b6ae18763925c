"""The canary's guardrails on user outcomes: a candidate whose reward looks better but whose users
accept, keep or like less is rolled back, and the reason names the guardrail."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, timedelta

from app.controller.canary import (
    GUARDRAILS,
    SESSION_GUARDRAILS,
    SPARSE_GUARDRAILS,
    ArmStats,
    Observe,
    analyze,
    transition,
)
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
    skipped = SESSION_GUARDRAILS | SPARSE_GUARDRAILS  # no sessions, no ratings
    assert set(g) == set(GUARDRAILS) - skipped, "no sessions nor ratings: those are skipped"
    assert set(a.guardrails_skipped) == skipped
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


# --- agent sessions -----------------------------------------------------------------------------
def with_sessions(
    stats: ArmStats, sessions: int, success: float, give_up: float = 0.0, turns: float = 6.0
) -> ArmStats:
    """`stats` plus `sessions` ended agent sessions: a share `success` succeeded, a share
    `give_up` was abandoned, `turns` turns each (one tool error in ten turns)."""
    return replace(
        stats,
        sessions_n=sessions,
        session_success=sessions * success,
        session_give_up=sessions * give_up,
        session_turns_sum=sessions * turns,
        session_tokens_sum=sessions * turns * 40,
        session_tool_error_turns=sessions * turns / 10,
    )


def test_a_candidate_whose_live_tasks_succeed_confidently_less_is_rolled_back_on_task_success():
    # reward better and every per-completion outcome equal: only the sessions tell
    cand = with_sessions(outcomes(2000, 0.6, 0.5, 0.8), 300, success=0.45)
    champ = with_sessions(outcomes(2000, 0.4, 0.5, 0.8), 300, success=0.70)
    s, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), cand, champ), CFG)
    assert [(e["type"], e["version"], e["from_version"]) for e in out] == [
        ("rolled_back", "1", "2")
    ]
    assert out[0]["details"]["guardrail"] == "task_success_rate", out[0]["reason"]
    assert "guardrail task_success_rate: candidate 0.4500 vs champion 0.7000" in out[0]["reason"]
    g = out[0]["details"]["analysis"]["guardrails"]["task_success_rate"]
    assert g["verdict"] == "worse" and g["samples"] == {"candidate": 300, "champion": 300}
    assert s.champion == "1" and "2" in s.failed


def test_a_candidate_that_gives_up_confidently_more_is_rolled_back_on_give_ups():
    cand = with_sessions(outcomes(2000, 0.6, 0.5, 0.8), 300, success=0.6, give_up=0.30)
    champ = with_sessions(outcomes(2000, 0.4, 0.5, 0.8), 300, success=0.6, give_up=0.05)
    _, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), cand, champ), CFG)
    assert out[0]["type"] == "rolled_back" and out[0]["details"]["guardrail"] == "give_up_rate"
    g = out[0]["details"]["analysis"]["guardrails"]["give_up_rate"]
    # the arms' give-up rates; the difference and its bounds on 1 - rate: negative is worse
    assert abs(g["candidate"] - 0.30) < 1e-12 and abs(g["champion"] - 0.05) < 1e-12
    assert abs(g["delta"] - (-0.25)) < 1e-12 and g["upper"] < -CFG.guardrail_margin
    assert g["lower_is_better"] and "(lower is better)" in out[0]["reason"], out[0]["reason"]
    better = analyze(champ, cand, CFG).guardrails["give_up_rate"]  # fewer give-ups: not worse
    assert better["verdict"] == "better_or_equal" and better["delta"] > 0


def test_equal_sessions_are_not_rolled_back():
    cand = with_sessions(outcomes(2000, 0.6, 0.5, 0.8), 300, success=0.6, give_up=0.1)
    champ = with_sessions(outcomes(2000, 0.4, 0.5, 0.8), 300, success=0.6, give_up=0.1)
    _, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), cand, champ), CFG)
    assert [e["type"] for e in out] == ["traffic_shifted"]
    g = analyze(cand, champ, CFG).guardrails
    assert g["task_success_rate"]["delta"] == 0 and g["give_up_rate"]["delta"] == 0


def test_arms_without_sessions_skip_the_session_guardrails_neither_pass_nor_fail():
    """No sessions in an arm (a completion-only product, or a candidate no agent reached yet):
    no verdict, whatever the other arm's sessions say; the reward and the other guardrails decide."""
    cfg = CFG.model_copy(update={"min_sessions": 50})
    good_reward = outcomes(2000, 0.6, 0.5, 0.8)
    champ = with_sessions(outcomes(2000, 0.4, 0.5, 0.8), 300, success=0.9)
    for cand, champion in (
        (good_reward, champ),  # the candidate served no session
        (with_sessions(good_reward, 300, success=0.1), outcomes(2000, 0.4, 0.5, 0.8)),
        (with_sessions(good_reward, 49, success=0.0), champ),  # below min_sessions
        (good_reward, outcomes(2000, 0.4, 0.5, 0.8)),
    ):
        a = analyze(cand, champion, cfg)
        assert SESSION_GUARDRAILS.isdisjoint(a.guardrails) and a.worst_guardrail() is None
        assert set(a.guardrails_skipped) == SESSION_GUARDRAILS | SPARSE_GUARDRAILS
        assert "judged from 50 per arm" in a.guardrails_skipped["task_success_rate"]
        _, out = transition(
            canary_state(), Observe(T0 + timedelta(seconds=100), cand, champion), cfg
        )
        assert [e["type"] for e in out] == ["traffic_shifted"], out
    judged = analyze(with_sessions(good_reward, 50, success=0.0), champ, cfg)
    assert judged.guardrails["task_success_rate"]["verdict"] == "worse"
    assert set(judged.guardrails_skipped) == SPARSE_GUARDRAILS  # no ratings


def test_a_session_guardrail_counts_sessions_not_completions():
    """The same sessions behind 400 or 40,000 completions per arm give the same bounds: a session,
    not a turn, is one sample of its outcome. Counted per completion, 40,000 samples would make
    a 0.10 difference over 100 sessions per arm look certain."""
    few, many = (outcomes(n, 0.5, 0.5, 0.8) for n in (400, 40_000))
    bounds = [
        analyze(with_sessions(x, 100, 0.5), with_sessions(y, 100, 0.6), CFG).guardrails[
            "task_success_rate"
        ]
        for x, y in ((few, few), (many, many))
    ]
    assert bounds[0] == bounds[1] and bounds[0]["verdict"] == "inconclusive", bounds
    from app.controller.canary import _aipw_bounds

    d, lo, hi = _aipw_bounds(100, 50.0, 50.0, 100, 60.0, 60.0, CFG)
    assert (bounds[0]["delta"], bounds[0]["lower"], bounds[0]["upper"]) == (d, lo, hi)


def test_the_completion_guardrails_do_not_change_with_sessions():
    cand, champ = outcomes(2000, 0.6, 0.45, 0.8, 0.2, -0.4, 0.1), outcomes(2000, 0.4, 0.5, 0.8)
    plain = analyze(cand, champ, CFG).guardrails
    sessions = analyze(with_sessions(cand, 300, 0.5), with_sessions(champ, 300, 0.9), CFG)
    assert {g: sessions.guardrails[g] for g in plain} == plain
    assert sessions.guardrails["task_success_rate"]["verdict"] == "worse"
    first = analyze(cand, champ, CFG).worst_guardrail()  # a completion guardrail comes first
    assert sessions.worst_guardrail() == (first or "task_success_rate")


def test_false_session_guardrail_rollbacks_of_equal_arms_under_repeated_looks_are_rare():
    """Sessions of both arms from one distribution (60% success, half the rest abandoned), 5% or
    50% of them the candidate's (200 candidate sessions expected), looked at after every 20
    sessions once each arm has min_sessions: neither session guardrail may call the candidate
    worse at margin 0 in more than alpha of the runs (seed 11: 1 and 2 of 100)."""
    cfg = CanaryConfig(min_step=0, min_samples=2, guardrail_margin=0.0, cs_target_n=1000)
    rng = random.Random(11)
    for share in (0.05, 0.5):
        runs, tripped = 100, 0
        for _ in range(runs):
            c = h = outcomes(1000, 0.5, 0.5, 0.8)
            for _ in range(int(200 / share) // 20):
                for _ in range(20):
                    ok = rng.random() < 0.6
                    one = ArmStats(
                        sessions_n=1,
                        session_success=float(ok),
                        session_give_up=float(not ok and rng.random() < 0.5),
                    )
                    c, h = (c + one, h) if rng.random() < share else (c, h + one)
                if analyze(c, h, cfg).worst_guardrail() is not None:
                    tripped += 1
                    break
        assert tripped / runs <= 0.05, f"share {share}: equal arms rolled back in {tripped}/{runs}"


# --- ratings ------------------------------------------------------------------------------------
def with_ratings(stats: ArmStats, rated: int, mean: float) -> ArmStats:
    """`stats` plus `rated` ratings (-1 or +1) of mean `mean`."""
    return replace(stats, rating_n=float(rated), rating_sum=rated * mean)


def test_a_hack_reported_as_success_and_rated_down_is_rolled_back_on_the_rating():
    """Under a harness's outcome a version that weakens the tests is reported successful more often
    (reward and task success better) while its users, who check the work, rate it down: the rating
    guardrail rolls it back, on its own count of rated completions."""
    cand = with_ratings(with_sessions(outcomes(2000, 0.6, 0.5, 0.8), 300, success=0.8), 80, -0.7)
    champ = with_ratings(with_sessions(outcomes(2000, 0.4, 0.5, 0.8), 300, success=0.6), 80, 0.1)
    s, out = transition(canary_state(), Observe(T0 + timedelta(seconds=100), cand, champ), CFG)
    assert [e["type"] for e in out] == ["rolled_back"], out
    assert out[0]["details"]["guardrail"] == "rating", out[0]["reason"]
    g = out[0]["details"]["analysis"]["guardrails"]["rating"]
    assert g["samples"] == {"candidate": 80, "champion": 80}
    assert abs(g["candidate"] + 0.7) < 1e-12 and abs(g["delta"] + 0.8) < 1e-12
    assert g["upper"] < -CFG.guardrail_margin
    assert analyze(cand, champ, CFG).guardrails["task_success_rate"]["verdict"] != "worse"
    # the same ratings behind 20,000 completions give the same bounds: a rating is one sample
    many = analyze(
        with_ratings(outcomes(20_000, 0.6, 0.5, 0.8), 80, -0.7),
        with_ratings(outcomes(20_000, 0.4, 0.5, 0.8), 80, 0.1),
        CFG,
    ).guardrails["rating"]
    assert (many["lower"], many["upper"]) == (g["lower"], g["upper"])


def test_too_few_ratings_skip_the_rating_guardrail():
    cfg = CFG.model_copy(update={"min_ratings": 30})
    champ = with_ratings(outcomes(2000, 0.4, 0.5, 0.8), 200, 0.5)
    for rated in (0, 29):
        a = analyze(with_ratings(outcomes(2000, 0.6, 0.5, 0.8), rated, -1.0), champ, cfg)
        assert "rating" not in a.guardrails and a.worst_guardrail() is None
        assert f"{rated} candidate and 200 champion ratings" in a.guardrails_skipped["rating"]
    a = analyze(with_ratings(outcomes(2000, 0.6, 0.5, 0.8), 30, -1.0), champ, cfg)
    assert a.guardrails["rating"]["verdict"] == "worse" and "rating" not in a.guardrails_skipped


def test_false_rating_rollbacks_of_equal_arms_under_repeated_looks_are_rare():
    """Ratings of both arms from one distribution (40% +1), half of them the candidate's, looked at
    after every 10 ratings from min_ratings on, up to 400: the rating guardrail may call the
    candidate worse at margin 0 in at most alpha of the runs."""
    cfg = CanaryConfig(min_step=0, min_samples=2, guardrail_margin=0.0, cs_target_n=400)
    rng = random.Random(5)
    runs, tripped = 100, 0
    for _ in range(runs):
        c = h = outcomes(1000, 0.5, 0.5, 0.8)
        for _ in range(40):
            for _ in range(10):
                one = ArmStats(rating_n=1.0, rating_sum=1.0 if rng.random() < 0.4 else -1.0)
                c, h = (c + one, h) if rng.random() < 0.5 else (c, h + one)
            if analyze(c, h, cfg).worst_guardrail() is not None:
                tripped += 1
                break
    assert tripped / runs <= 0.05, f"equal ratings rolled back in {tripped}/{runs}"


def test_window_sums_carry_the_sessions_and_refuse_impossible_ones():
    import json
    from datetime import datetime
    from types import SimpleNamespace

    import pytest

    from app.contracts.deployments import InvalidRecord
    from app.controller.controller import Controller, decode_metrics

    sums = {
        "n": 0.0,
        "sessions_n": 4.0,
        "session_success": 3.0,
        "session_give_up": 1.0,
        "session_turns_sum": 20.0,
        "session_tokens_sum": 800.0,
        "session_tool_error_turns": 2.0,
    }
    rec = {"model_version": "2", "bucket_start": 100.0, "n": 0, "sums": sums}
    decode_metrics(json.dumps(rec).encode())
    w = Controller.window(
        SimpleNamespace(buckets={"a": rec, "b": rec}), "2", datetime.fromtimestamp(50, tz=UTC)
    )
    assert w == ArmStats(
        sessions_n=8,
        session_success=6.0,
        session_give_up=2.0,
        session_turns_sum=40.0,
        session_tokens_sum=1600.0,
        session_tool_error_turns=4.0,
    )
    rated = dict(rec, sums={"n": 10.0, "rating_n": 4.0, "rating_sum": -2.0})
    decode_metrics(json.dumps(rated).encode())
    w = Controller.window(
        SimpleNamespace(buckets={"a": rated}), "2", datetime.fromtimestamp(50, tz=UTC)
    )
    assert (w.n, w.rating_n, w.rating_sum) == (10, 4.0, -2.0)
    for bad in ({"rating_sum": -5.0}, {"rating_n": 11.0}):
        with pytest.raises(InvalidRecord) as err:
            decode_metrics(json.dumps(dict(rated, sums={**rated["sums"], **bad})).encode())
        assert next(iter(bad)) in err.value.errors[0]["message"], err.value.errors
    for bad in ({"session_success": 5.0}, {"session_give_up": -1.0}, {"sessions_n": -1.0}):
        with pytest.raises(InvalidRecord) as err:
            decode_metrics(json.dumps(dict(rec, sums={**sums, **bad})).encode())
        assert (
            err.value.reason == "invalid_metrics"
            and next(iter(bad)) in err.value.errors[0]["message"]
        )
