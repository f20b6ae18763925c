"""The rollout state machine: every phase against every kind of input, plus replay equivalence."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.contracts.deployments import Decision, DeploymentEvent
from app.controller.canary import (
    ArmStats,
    Event,
    Observe,
    Restart,
    Tick,
    analyze,
    cs_radius,
    transition,
)
from app.controller.state import DeploymentState, fold
from app.registry.operator import CanaryConfig, CommandRejected, operator_command

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CFG = CanaryConfig(min_step=60, min_samples=50, step_deadline=600, margin=0.05, cs_target_n=200)


def ev(type_, version=None, from_version=None, t=0.0, source="controller", **details):
    # canary events carry the candidate's share (a valid DeploymentEvent; the fold is typed)
    traffic = details.pop(
        "traffic_pct", 5.0 if type_ in ("canary_started", "traffic_shifted") else None
    )
    return Decision(
        type=type_,
        version=version,
        from_version=from_version,
        source=source,
        traffic_pct=traffic,
        details=details,
    ).to_event("m", T0 + timedelta(seconds=t))


def arm(n, mean, sd=0.5):
    """Sufficient statistics of n rewards with exactly this mean and (population) sd."""
    return ArmStats(n, n * mean, n * (sd * sd + mean * mean))


def run(state, inputs):
    events = []
    for inp in inputs:
        state, out = transition(state, inp, CFG)
        events += out
    return state, events


def canary_events():
    """The log of canary_state(): champion 1, version 2 gated and its canary started at T0."""
    s = fold(
        "m", [ev("promoted", "1", t=-100), ev("version_registered", "2", source="trainer", t=-10)]
    )
    gated = ev("gate_passed", "2", t=0)
    _, out = transition(s, Event(gated), CFG)
    assert [e["type"] for e in out] == ["canary_started"]
    return [
        ev("promoted", "1", t=-100),
        ev("version_registered", "2", source="trainer", t=-10),
        gated,
        *out,
    ]


def canary_state():
    """Champion 1, version 2 in canary at 5% since T0."""
    return fold("m", canary_events())


def test_gate_pass_starts_canary_at_first_step():
    s = canary_state()
    assert (s.phase, s.candidate, s.champion, s.traffic_pct, s.step) == ("canary", "2", "1", 5.0, 0)


def test_gate_pass_without_champion_promotes_directly():
    s, out = transition(DeploymentState(model="m"), Event(ev("gate_passed", "1")), CFG)
    assert [e["type"] for e in out] == ["promoted"] and s.champion == "1" and s.phase == "idle"


def test_gate_failure_does_not_start_canary():
    s = fold("m", [ev("promoted", "1")])
    s, out = transition(s, Event(ev("gate_failed", "2")), CFG)
    assert out == [] and s.candidate is None and "2" in s.failed


def test_better_candidate_walks_every_step_then_becomes_champion():
    s = canary_state()
    seen = []
    for i in range(1, 5):
        s, out = transition(
            s, Observe(T0 + timedelta(seconds=100 * i), arm(400, 0.6), arm(400, 0.4)), CFG
        )
        seen += [(e["type"], e["traffic_pct"]) for e in out]
    assert seen == [("traffic_shifted", 25.0), ("traffic_shifted", 50.0), ("promoted", 100.0)]
    assert (s.champion, s.candidate, s.phase, s.known_good) == ("2", None, "idle", ["1", "2"])


def test_equal_candidate_within_margin_advances():
    s, out = transition(
        canary_state(), Observe(T0 + timedelta(seconds=100), arm(5000, 0.5), arm(5000, 0.5)), CFG
    )
    assert [e["type"] for e in out] == ["traffic_shifted"]


def test_worse_candidate_is_rolled_back_automatically():
    s, out = transition(
        canary_state(), Observe(T0 + timedelta(seconds=100), arm(400, 0.1), arm(400, 0.5)), CFG
    )
    assert [(e["type"], e["version"], e["from_version"]) for e in out] == [
        ("rolled_back", "1", "2")
    ]
    assert out[0]["details"]["analysis"]["verdict"] == "worse"
    assert (s.champion, s.candidate, s.phase, s.traffic_pct) == (
        "1",
        None,
        "idle",
        0.0,
    ) and "2" in s.failed


def test_no_decision_before_min_time_or_min_samples():
    s = canary_state()
    _, out = transition(s, Observe(T0 + timedelta(seconds=10), arm(400, 0.9), arm(400, 0.1)), CFG)
    assert out == []
    _, out = transition(s, Observe(T0 + timedelta(seconds=100), arm(10, 0.9), arm(400, 0.1)), CFG)
    assert out == []


def test_inconclusive_at_deadline_pauses_and_resume_restarts_the_window():
    s = canary_state()
    noisy = (arm(60, 0.45, sd=2.0), arm(60, 0.5, sd=2.0))
    s, out = transition(s, Observe(T0 + timedelta(seconds=100), *noisy), CFG)
    assert out == [], "inconclusive before the deadline waits"
    s, out = transition(s, Observe(T0 + timedelta(seconds=700), *noisy), CFG)
    assert [e["type"] for e in out] == ["canary_paused"] and s.phase == "paused"
    s, out = transition(s, Observe(T0 + timedelta(seconds=800), arm(400, 0.0), arm(400, 0.9)), CFG)
    assert out == [], "a paused canary is not judged"
    [d] = operator_command(s, "resume", CFG, actor="ops")
    s, _ = transition(s, Event(d.to_event("m", T0 + timedelta(seconds=900))), CFG)
    assert s.phase == "canary" and s.step_started_at == T0 + timedelta(seconds=900)


def test_tick_past_deadline_pauses_without_metrics():
    s, out = transition(canary_state(), Tick(T0 + timedelta(seconds=601)), CFG)
    assert [e["type"] for e in out] == ["canary_paused"]


def test_a_restart_starts_the_running_step_again_and_does_not_hold_the_stop_against_it():
    s = canary_state()
    s, out = transition(s, Observe(T0 + timedelta(seconds=30), arm(40, 0.6), arm(40, 0.5)), CFG)
    assert out == [] and s.step_started_at == T0
    back = T0 + timedelta(seconds=3000)  # the whole loop was stopped 50 minutes, past the deadline
    s, out = transition(s, Restart(back), CFG)
    [e] = out
    assert (e["type"], e["version"], e["traffic_pct"]) == ("canary_resumed", "2", 5.0)
    assert e["details"]["step_restart"] and e["details"]["step"] == s.step == 0
    assert "3000s ago" in e["reason"]
    assert s.phase == "canary" and s.step_started_at == back
    assert fold("m", [*canary_events(), e]) == s, "the published event replays to the same state"
    s2, out = transition(s, Tick(back + timedelta(seconds=599)), CFG)
    assert out == [], "the deadline counts from the restart"
    _, out = transition(s2, Tick(back + timedelta(seconds=601)), CFG)
    assert [e["type"] for e in out] == ["canary_paused"]
    _, out = transition(s, Observe(back + timedelta(seconds=30), arm(400, 0.9), arm(400, 0.1)), CFG)
    assert out == [], "min_step counts from the restart too"
    _, out = transition(s, Observe(back + timedelta(seconds=61), arm(400, 0.9), arm(400, 0.1)), CFG)
    assert [e["type"] for e in out] == ["traffic_shifted"]


def test_a_restart_leaves_a_paused_canary_and_no_canary_alone():
    s = canary_state()
    s, _ = transition(s, Tick(T0 + timedelta(seconds=601)), CFG)
    assert s.phase == "paused"
    assert transition(s, Restart(T0 + timedelta(seconds=3000)), CFG) == (s, [])
    idle = fold("m", [ev("promoted", "1")])
    assert transition(idle, Restart(T0 + timedelta(seconds=3000)), CFG) == (idle, [])


def test_a_resume_without_the_restart_mark_does_not_restart_a_running_step():
    s = canary_state()
    after = fold("m", [*canary_events(), ev("canary_resumed", "2", t=300)])
    assert after.phase == "canary" and after.step_started_at == s.step_started_at == T0


def test_a_running_canary_finishes_before_a_newer_gated_version_starts():
    s, out = transition(canary_state(), Event(ev("gate_passed", "3", t=5)), CFG)
    assert out == [] and s.candidate == "2", (
        "v3 waits: superseding running canaries livelocks a fast ship cadence"
    )
    s, out = transition(s, Event(ev("gate_passed", "4", t=6)), CFG)
    assert out == [] and s.candidate == "2"
    s, out = transition(s, Event(ev("promoted", "2", t=7)), CFG)
    assert [(e["type"], e["version"]) for e in out] == [("canary_started", "4")], (
        "then the newest passed version"
    )
    assert (s.champion, s.candidate) == ("2", "4")


def test_newer_gated_version_supersedes_a_paused_canary():
    s, out = transition(canary_state(), Tick(T0 + timedelta(seconds=601)), CFG)
    assert s.phase == "paused"
    s, out = transition(s, Event(ev("gate_passed", "3", t=700)), CFG)
    assert [(e["type"], e["version"]) for e in out] == [("aborted", "2"), ("canary_started", "3")]
    assert s.candidate == "3"
    s, out = transition(s, Event(ev("gate_passed", "2", t=701)), CFG)
    assert out == [], "an older version never replaces a newer candidate"


# --- operator verbs ---------------------------------------------------------------------------
def apply(s, ds, t=10):
    for d in ds:
        s, out = transition(s, Event(d.to_event("m", T0 + timedelta(seconds=t))), CFG)
    return s


def test_promote_advances_one_step_or_skips_to_champion():
    s = canary_state()
    [d] = operator_command(s, "promote", CFG, actor="alice", reason="looks good")
    assert (d.type, d.traffic_pct, d.source, d.actor, d.reason) == (
        "traffic_shifted",
        25.0,
        "api",
        "alice",
        "looks good",
    )
    [d] = operator_command(s, "promote", CFG, actor="alice", skip_remaining=True)
    assert d.type == "promoted"
    s = apply(s, [d])
    assert s.champion == "2" and s.candidate is None


def test_abort_and_pause_need_a_running_canary():
    s = fold("m", [ev("promoted", "1")])
    for verb in ("promote", "abort", "pause", "resume"):
        with pytest.raises(CommandRejected) as exc:
            operator_command(s, verb, CFG, actor="a")
        assert exc.value.status == 409
    s = apply(canary_state(), operator_command(canary_state(), "abort", CFG, actor="a"))
    assert (s.candidate, s.phase, s.champion) == (None, "idle", "1") and "2" not in s.failed


def test_rollback_to_any_recent_known_good_version_without_analysis():
    s = fold("m", [ev("promoted", v, t=i) for i, v in enumerate(["1", "2", "3", "4"])])
    assert s.rollback_targets(CFG.known_good_n) == ["3", "2", "1"]
    [d] = operator_command(s, "rollback", CFG, actor="bob", version="2")
    assert (d.type, d.version, d.from_version) == ("rolled_back", "2", "4")
    s = apply(s, [d])
    assert s.champion == "2" and "4" in s.failed and s.rollback_targets(5) == ["3", "1"]
    with pytest.raises(CommandRejected) as exc:
        operator_command(s, "rollback", CFG, actor="bob", version="4")
    assert exc.value.status == 422
    [d] = operator_command(s, "rollback", CFG, actor="bob")
    assert d.version == "3", "default target is the newest known-good"


def test_rollback_during_canary_also_ends_it():
    s = fold(
        "m", [ev("promoted", "1"), ev("promoted", "2"), ev("canary_started", "3", t=1, step=0)]
    )
    ds = operator_command(s, "rollback", CFG, actor="a")
    assert [d.type for d in ds] == ["aborted", "rolled_back"], "the canary's end is its own event"
    s = apply(s, ds)
    assert (s.champion, s.candidate, s.phase) == ("1", None, "idle")


def test_rollback_keeps_only_last_n():
    s = fold("m", [ev("promoted", str(v), t=v) for v in range(1, 10)])
    assert s.rollback_targets(3) == ["8", "7", "6"]


# --- MLflow UI alias moves ------------------------------------------------------------------
def ui(alias, to, frm=None, t=20):
    return ev("alias_changed", to, frm, t=t, source="mlflow-ui", alias=alias)


def test_ui_candidate_move_starts_canary_and_is_answered_once():
    s = fold("m", [ev("promoted", "1"), ev("version_registered", "5")])
    e = ui("candidate", "5")
    s, out = transition(s, Event(e), CFG)
    assert [(x["type"], x["version"], x["source"]) for x in out] == [
        ("canary_started", "5", "mlflow-ui")
    ]
    assert out[0]["details"]["in_response_to"] == e["event_id"] and s.ui_candidate is None
    s, out = transition(s, Tick(T0 + timedelta(seconds=21)), CFG)
    assert out == []


def test_ui_candidate_removed_aborts_canary():
    s, out = transition(canary_state(), Event(ui("candidate", None, "2")), CFG)
    assert [x["type"] for x in out] == ["aborted"] and s.candidate is None


def test_ui_candidate_equal_to_champion_is_restored():
    s, out = transition(canary_state(), Event(ui("candidate", "1", "2")), CFG)
    assert [(x["type"], x["version"], x["details"]["alias"]) for x in out] == [
        ("alias_changed", "2", "candidate")
    ]
    assert s.candidate == "2" and s.ui_candidate is None


def test_ui_champion_to_candidate_promotes():
    s, out = transition(canary_state(), Event(ui("champion", "2", "1")), CFG)
    assert [x["type"] for x in out] == ["promoted"] and (s.champion, s.candidate) == ("2", None)


def test_ui_champion_elsewhere_during_canary_aborts_and_serves_new_champion():
    s = fold("m", [ev("promoted", "1"), ev("promoted", "2"), ev("canary_started", "3", step=0)])
    s, out = transition(s, Event(ui("champion", "1", "2")), CFG)
    assert [x["type"] for x in out] == ["aborted"] and (s.champion, s.candidate) == ("1", None)


def test_ui_champion_move_without_canary_needs_no_answer():
    s = fold("m", [ev("promoted", "1"), ev("promoted", "2")])
    s, out = transition(s, Event(ui("champion", "1", "2")), CFG)
    assert out == [] and s.champion == "1"


def test_ui_champion_removal_is_restored():
    s = fold("m", [ev("promoted", "1")])
    s, out = transition(s, Event(ui("champion", None, "1")), CFG)
    assert [(x["type"], x["version"]) for x in out] == [
        ("alias_changed", "1")
    ] and s.champion == "1"
    assert s.ui_champion is None


# --- analysis -------------------------------------------------------------------------------
def test_cs_radius_matches_hand_computation():
    la = -2 * math.log(0.05)
    rho2 = (la + math.log(la + 1)) / 100
    want = 2.0 * math.sqrt(
        2 * (400 * rho2 + 1) / (400**2 * rho2) * math.log(math.sqrt(400 * rho2 + 1) / 0.05)
    )
    assert cs_radius(2.0, 400, 0.05, 100) == pytest.approx(want, rel=1e-12)
    assert (
        cs_radius(1.0, 10_000, 0.05, 100)
        < cs_radius(1.0, 1000, 0.05, 100)
        < cs_radius(1.0, 100, 0.05, 100)
    )
    # a CS is wider than the fixed-horizon 95% interval at the same n (the price of peeking)
    assert cs_radius(1.0, 100, 0.05, 100) > 1.96 / 10


def test_analyze_uses_exact_moments_from_sums():
    cfg = CFG.model_copy(update={"min_samples": 2})
    # p = 100 / 400 = 1/4: sigma^2 = 0.3^2 / (1/4) + 0.5^2 / (3/4) = 0.36 + 1/3
    a = analyze(arm(100, 0.8, sd=0.3), arm(300, 0.2, sd=0.5), cfg)
    assert a.delta == pytest.approx(0.6)
    assert (a.candidate["n"], a.champion["reward_mean"]) == (100, pytest.approx(0.2))
    sigma = math.sqrt(0.36 + 1 / 3)
    assert a.upper - a.delta == pytest.approx(cs_radius(sigma, 400, cfg.alpha, cfg.cs_target_n))
    assert a.method == "asymptotic-cs-aipw"
    # constant rewards: no variance, the bounds close on the difference
    b = analyze(arm(100, 1.0, sd=0.0), arm(100, 0.0, sd=0.0), cfg)
    assert (b.lower, b.upper) == (pytest.approx(1.0), pytest.approx(1.0))


def test_centering_narrows_the_bounds_of_rewards_with_a_mean():
    """The plain inverse-propensity difference's variance carries each arm's squared mean; the
    AIPW score's does not. Rewards around 0.6 (sd 0.4) on a 5% / 95% split."""
    cfg = CFG.model_copy(update={"min_samples": 2})
    a = analyze(arm(50, 0.6, sd=0.4), arm(950, 0.6, sd=0.4), cfg)
    p = 0.05
    ipw_sigma = math.sqrt((0.16 + 0.36) / p + (0.16 + 0.36) / (1 - p))
    aipw_sigma = math.sqrt(0.16 / p + 0.16 / (1 - p))
    assert a.upper - a.delta == pytest.approx(
        cs_radius(aipw_sigma, 1000, cfg.alpha, cfg.cs_target_n)
    )
    assert (a.upper - a.delta) / cs_radius(ipw_sigma, 1000, cfg.alpha, cfg.cs_target_n) < 0.6


def test_false_rollback_rate_of_equal_arms_under_repeated_looks_is_below_alpha():
    import numpy as np

    rng = np.random.default_rng(0)
    cfg = CFG.model_copy(update={"margin": 0.0, "min_samples": 20})
    runs, worse = 300, 0
    for _ in range(runs):
        c, h = rng.normal(0, 1, 2000).astype(np.float64), rng.normal(0, 1, 2000).astype(np.float64)
        cc, ch = np.cumsum(c), np.cumsum(h)
        cq, hq = np.cumsum(c * c), np.cumsum(h * h)
        for n in range(20, 2000, 20):  # look after every 20 samples per arm
            a = analyze(ArmStats(n, cc[n - 1], cq[n - 1]), ArmStats(n, ch[n - 1], hq[n - 1]), cfg)
            if a.verdict == "worse":
                worse += 1
                break
    assert worse / runs <= 0.05, f"false 'worse' rate {worse / runs} under 100 looks"


@pytest.mark.parametrize("share", [0.05, 0.5])
def test_false_rollback_rate_of_equal_bernoulli_arms_on_a_split_is_below_alpha(share):
    """Equal acceptance rates (0.6) on the canary's traffic split, looked at every 20 samples."""
    import numpy as np

    rng = np.random.default_rng(1)
    cfg = CFG.model_copy(update={"margin": 0.0, "min_samples": 20})
    runs, worse, n_total = 300, 0, 4000
    for _ in range(runs):
        is_cand = rng.random(n_total) < share
        r = (rng.random(n_total) < 0.6).astype(np.float64)
        for n in range(200, n_total + 1, 40):
            c, h = r[:n][is_cand[:n]], r[:n][~is_cand[:n]]
            if len(c) < cfg.min_samples or len(h) < cfg.min_samples:
                continue
            a = analyze(
                ArmStats(len(c), c.sum(), (c * c).sum()),
                ArmStats(len(h), h.sum(), (h * h).sum()),
                cfg,
            )
            if a.verdict == "worse":
                worse += 1
                break
    assert worse / runs <= 0.05, f"false 'worse' rate {worse / runs} at a {share:.0%} split"


# --- exhaustive: random input sequences keep the invariants and replay exactly --------------
inputs = st.one_of(
    st.tuples(st.just("gate"), st.integers(2, 6), st.booleans()),
    st.tuples(
        st.just("obs"), st.sampled_from(["better", "worse", "noisy", "few"]), st.integers(0, 900)
    ),
    st.tuples(st.just("tick"), st.integers(0, 2000)),
    st.tuples(
        st.just("verb"),
        st.sampled_from(["promote", "promote!", "abort", "pause", "resume", "rollback"]),
    ),
    st.tuples(
        st.just("ui"),
        st.sampled_from(["champion", "candidate"]),
        st.sampled_from([None, "1", "2", "3", "4"]),
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(inputs, min_size=1, max_size=25))
def test_random_sequences_keep_invariants_and_replay_to_same_state(seq):
    log = [ev("promoted", "1", t=-1)]
    s = fold("m", log)
    t = 0.0
    for item in seq:
        t += 1.0
        kind = item[0]
        if kind == "gate":
            e = ev("gate_passed" if item[2] else "gate_failed", str(item[1]), t=t)
            log.append(e)
            s, out = transition(s, Event(e), CFG)
        elif kind == "obs":
            now = T0 + timedelta(seconds=t + item[2])
            t += item[2]
            c, h = {
                "better": (arm(300, 0.8), arm(300, 0.2)),
                "worse": (arm(300, 0.0), arm(300, 0.9)),
                "noisy": (arm(60, 0.5, 3), arm(60, 0.5, 3)),
                "few": (arm(3, 1), arm(3, 0)),
            }[item[1]]
            s, out = transition(s, Observe(now, c, h), CFG)
        elif kind == "tick":
            t += item[1]
            s, out = transition(s, Tick(T0 + timedelta(seconds=t)), CFG)
        elif kind == "verb":
            verb = item[1].rstrip("!")
            try:
                ds = operator_command(s, verb, CFG, actor="x", skip_remaining=item[1].endswith("!"))
            except CommandRejected:
                continue
            out = []
            for d in ds:
                e = d.to_event("m", T0 + timedelta(seconds=t))
                log.append(e)
                s, more = transition(s, Event(e), CFG)
                log += more
            out = []
        else:
            cur = s.champion if item[1] == "champion" else s.candidate
            if cur == item[2]:
                continue
            e = ui(item[1], item[2], cur, t=t)
            log.append(e)
            s, out = transition(s, Event(e), CFG)
        log += out
        assert (s.phase == "idle") == (s.candidate is None), s
        assert s.candidate != s.champion, s
        assert s.champion is not None, s
        assert s.traffic_pct in (0.0, *CFG.steps), s
        assert s.ui_champion is None and s.ui_candidate is None, "every UI move is answered at once"
        assert s.phase == "idle" or s.step_started_at is not None
    assert fold("m", log).model_dump() == s.model_dump(), "replaying the log rebuilds the state"
    for e in log:  # every event the state machine emits satisfies the deployment-event contract
        DeploymentEvent.model_validate(e)
