"""The report's folds (app/report/model.py) on hand-made logs: where each number on the page comes from."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app.report.model import (
    ReportData,
    VersionInfo,
    canary_steps,
    gate_by_version,
    heldout_by_version,
    rollout,
    version_rows,
)
from app.report.page import build_report

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ev(
    i: int,
    type: str,
    version: str | None,
    from_version: str | None = None,
    traffic_pct: float | None = None,
    **details,
) -> dict:
    return {
        "event_id": f"e{i}",
        "type": type,
        "model": "m",
        "version": version,
        "from_version": from_version,
        "traffic_pct": traffic_pct,
        "source": "controller",
        "actor": "controller",
        "reason": "",
        "details": details,
        "ts": T0 + timedelta(minutes=i),
    }


def analysis(verdict: str, delta: float, lower: float, upper: float) -> dict:
    return {
        "verdict": verdict,
        "delta": delta,
        "lower": lower,
        "upper": upper,
        "margin": 0.05,
        "candidate": {"n": 40, "reward_mean": 0.5},
        "champion": {"n": 50, "reward_mean": 0.4},
    }


LOG = [
    ev(0, "version_registered", "1"),
    ev(1, "gate_passed", "1", checks=[]),
    ev(2, "promoted", "1", traffic_pct=100),
    ev(3, "version_registered", "2", "1"),
    ev(4, "gate_passed", "2", "1", checks=[{"name": "kl_to_champion", "status": "pass"}]),
    ev(5, "canary_started", "2", "1", 5.0, step=0),
    ev(
        6,
        "traffic_shifted",
        "2",
        "1",
        25.0,
        step=1,
        analysis=analysis("better_or_equal", 0.1, 0.01, 0.2),
    ),
    ev(
        7,
        "promoted",
        "2",
        "1",
        100.0,
        step=2,
        analysis=analysis("better_or_equal", 0.08, 0.02, 0.14),
    ),
    ev(8, "version_registered", "3", "2"),
    ev(
        9,
        "gate_failed",
        "3",
        "2",
        checks=[
            {"name": "kl_to_champion", "status": "fail", "value": 0.9},
            {"name": "tool_error_rate", "status": "fail", "value": 0.3},
            {"name": "ope_reward", "status": "skipped"},
        ],
    ),
    ev(10, "version_registered", "4", "2"),
    ev(11, "gate_passed", "4", "2", checks=[]),
    ev(12, "canary_started", "4", "2", 5.0, step=0),
    # a rollback names the restored version in `version` and the rolled-back one in `from_version`
    ev(13, "rolled_back", "2", "4", 0.0, step=0, analysis=analysis("worse", -0.3, -0.4, -0.2)),
]


def test_each_canary_analysis_is_placed_at_the_step_it_judged():
    steps = canary_steps(LOG)
    assert [(s.version, s.step, s.traffic_pct, s.verdict, s.outcome) for s in steps] == [
        (
            "2",
            0,
            5.0,
            "better_or_equal",
            "traffic_shifted",
        ),  # judged the 5% step, then shifted to 25%
        ("2", 1, 25.0, "better_or_equal", "promoted"),
        (
            "4",
            0,
            5.0,
            "worse",
            "rolled_back",
        ),  # the candidate is from_version, not the restored champion
    ]
    assert (
        steps[2].delta,
        steps[2].lower,
        steps[2].upper,
        steps[2].n_candidate,
        steps[2].n_champion,
    ) == (-0.3, -0.4, -0.2, 40, 50)


def test_rollout_follows_the_champion_and_each_versions_outcome():
    r = rollout(LOG)
    # the rollback restores v2, which already serves: its span goes on
    assert [
        (v, start.minute, stop.minute if stop else None) for start, stop, v in r.champion_spans
    ] == [("1", 2, 7), ("2", 7, None)]
    assert r.canary == {"2": "promoted", "4": "rolled back"}
    assert set(r.promoted) == {"1", "2"} and set(r.rolled_back) == {"4"}
    labels = [m.label for m in r.marks if m.kind in ("promoted", "rolled_back", "gate_failed")]
    assert labels == [
        "v1 promoted",
        "v2 promoted over v1",
        "v3 gate failed: kl_to_champion, tool_error_rate",
        "v4 rolled back to v2",
    ]


def test_a_step_restarted_by_the_controller_is_marked_apart_from_an_operators_resume():
    log = [
        ev(0, "promoted", "1", traffic_pct=100),
        ev(1, "canary_started", "2", "1", 5.0, step=0),
        ev(2, "canary_resumed", "2", None, 5.0, step=0, step_restart=True),
        ev(3, "canary_paused", "2", None, 5.0),
        ev(4, "canary_resumed", "2", None, 5.0),
    ]
    r = rollout(log)
    assert [m.label for m in r.marks if m.kind.startswith("canary_")][1:] == [
        "v2 canary step 0 restarted with the controller",
        "v2 canary paused",
        "v2 canary resumed",
    ]
    assert r.canary == {"2": "in canary"}


def test_a_rollback_without_from_version_rolls_back_the_candidate():
    log = [
        ev(0, "promoted", "1", traffic_pct=100),
        ev(1, "canary_started", "2", "1", 5.0, step=0),
        ev(2, "rolled_back", "1", None, 0.0),
    ]
    assert set(rollout(log).rolled_back) == {"2"}


def test_gate_verdicts_come_from_the_log_and_else_from_the_version_tags():
    data = ReportData(
        "m",
        T0,
        versions=[
            VersionInfo(
                "3", {"flywheel.gate.status": "passed"}
            ),  # the log's verdict wins over a tag
            VersionInfo(
                "5",
                {
                    "flywheel.gate.status": "failed",
                    "flywheel.gate.weights_finite": "fail 3",
                    "flywheel.gate.weight_change": "skipped",
                    "flywheel.gate.ope.snips": "0.4",
                },
            ),
        ],
        events=LOG,
    )
    gates = gate_by_version(data)
    assert [c["name"] for c in gates["3"].failing] == [
        "kl_to_champion",
        "tool_error_rate",
    ] and not gates["3"].passed
    assert gates["5"].source == "tags" and not gates["5"].passed
    assert [(c["name"], c["status"], c["value"]) for c in gates["5"].checks] == [
        ("weight_change", "skipped", None),
        ("weights_finite", "fail", 3.0),
    ]


def test_heldout_takes_the_metric_then_the_tag_and_a_ci_only_when_both_bounds_exist():
    data = ReportData(
        "m",
        T0,
        versions=[
            VersionInfo("1", {"heldout_acceptance": "0.3000"}),
            VersionInfo(
                "2",
                {
                    "heldout_acceptance": "0.4000",
                    "heldout_acceptance_ci_low": "0.35",
                    "heldout_acceptance_ci_high": "0.45",
                },
            ),
            VersionInfo("3", {"heldout_acceptance_ci_low": "0.1"}),
            VersionInfo("4", {}),
        ],
        heldout={
            "heldout_acceptance": [(1, 0.31234), (3, 0.2)],
            "heldout_acceptance_ci_low": [(3, 0.15)],
        },
    )
    held = heldout_by_version(data)
    assert (
        held["1"].acceptance == 0.31234 and held["1"].ci_low is None
    )  # the metric is more precise than the tag
    assert (held["2"].acceptance, held["2"].ci_low, held["2"].ci_high) == (0.4, 0.35, 0.45)
    assert (
        held["3"].acceptance == 0.2 and held["3"].ci_low is None and held["3"].ci_high is None
    )  # one bound: no CI
    assert "4" not in held


def test_version_rows_join_registry_and_log():
    data = ReportData(
        "m",
        T0,
        versions=[
            VersionInfo("1", {"kind": "base", "parent_version": "none"}),
            VersionInfo("4", {"kind": "trained", "parent_version": "2", "planted_bad": "true"}),
        ],
        events=LOG,
    )
    rows = {r.version: r for r in version_rows(data)}
    assert list(rows) == ["1", "2", "3", "4"]
    assert (rows["1"].kind, rows["1"].parent, rows["1"].promoted) == ("base", None, True)
    assert (rows["2"].parent, rows["2"].canary, rows["2"].champion_now) == ("1", "promoted", True)
    assert [c["name"] for c in rows["3"].gate.failing] == ["kl_to_champion", "tool_error_rate"]
    assert (rows["4"].kind, rows["4"].rolled_back, rows["4"].canary) == (
        "trained (planted bad)",
        True,
        "rolled back",
    )


def test_a_report_without_data_says_so_in_every_section_and_has_no_figure():
    html = build_report(ReportData("m", T0))
    for says in (
        "No held-out results yet",
        "No training metrics yet",
        "No gate decisions yet",
        "No canary steps yet",
        "No deployment events yet",
        "No versions yet",
    ):
        assert says in html, says
    assert "<img" not in html and "<script" not in html


def test_a_long_training_run_is_strided_to_a_bounded_figure():
    from app.report.plots import MAX_POINTS, training_plot

    n = 20 * MAX_POINTS
    small = training_plot({"reward_mean": [(s, (s % 97) / 97) for s in range(MAX_POINTS)]}, {})
    large = training_plot({"reward_mean": [(s, (s % 97) / 97) for s in range(n)]}, {})
    assert small and large and len(large) < 3 * len(small), (len(small), len(large))


def test_a_champion_recorded_from_the_alias_served_without_a_promotion():
    log = [
        ev(0, "version_registered", "1"),
        ev(1, "alias_changed", "1", alias="champion"),
        ev(2, "version_registered", "2", "1"),
        ev(3, "promoted", "2", "1", 100.0),
    ]
    rows = {r.version: r for r in version_rows(ReportData("m", T0, events=log))}
    assert (rows["1"].served, rows["1"].promoted, rows["1"].champion_now) == (True, False, False)
    assert (rows["2"].served, rows["2"].promoted, rows["2"].champion_now) == (True, True, True)
    assert rollout(log).served == ["1", "2"]


def test_markdown_table_names_the_failing_check_and_the_interval():
    from app.report.model import GateVerdict, HeldOut, VersionRow, markdown_table

    rows = [
        VersionRow(
            "1",
            "base",
            None,
            HeldOut(0.356, 0.31, 0.40),
            GateVerdict(True, []),
            "",
            False,
            False,
            True,
            False,
            "v1",
        ),
        VersionRow(
            "2",
            "trained",
            "1",
            HeldOut(0.3),
            GateVerdict(False, [{"name": "reward_vs_champion", "status": "fail", "value": -0.149}]),
            "",
            False,
            False,
            False,
            False,
            "v1",
        ),
    ]
    lines = markdown_table(rows).splitlines()
    blank = "  |" * 6  # no sessions: blank cells, not zeros
    assert lines[2] == "| 1 | base | 0.356 | [0.310, 0.400] | passed |  | champion |" + blank
    assert lines[3] == "| 2 | trained | 0.300 |  | failed | reward_vs_champion -0.149 |  |" + blank


def _sessions() -> list:
    from app.report.model import SessionInfo

    return [
        SessionInfo("a", 3, "success", frozenset({"1"})),
        SessionInfo("b", 4, "failure", frozenset({"1", "2"})),  # promoted mid-session: both count
        SessionInfo("c", 1, None, frozenset({"2"})),
        SessionInfo("d", 2, "abandoned", frozenset({"2"})),
        SessionInfo("e", 5, None, frozenset({"3"})),
    ]


def test_sessions_per_version_count_every_session_it_served_and_share_the_outcomes_reached():
    from app.report.model import session_stats

    stats = session_stats(_sessions())
    assert set(stats) == {"1", "2", "3"}, "a version that served no session has no stats"
    v1, v2, v3 = stats["1"], stats["2"], stats["3"]
    assert (v1.sessions, v1.turns_mean, v1.with_outcome) == (2, 3.5, 2)
    assert v1.shares == {"success": 0.5, "failure": 0.5, "abandoned": 0.0}
    assert (v2.sessions, round(v2.turns_mean, 4), v2.with_outcome) == (3, 2.3333, 2)
    assert v2.shares == {"success": 0.0, "failure": 0.5, "abandoned": 0.5}
    assert (v3.sessions, v3.with_outcome, v3.shares) == (1, 0, None), (
        "no outcome yet: no shares, not zero shares"
    )


def test_the_markdown_table_shows_sessions_per_version_and_blanks_without_them():
    from app.report.model import markdown_table

    data = ReportData(
        "m",
        T0,
        versions=[VersionInfo(v, {"kind": "trained"}) for v in ("1", "2", "3", "4")],
        sessions=_sessions(),
    )
    lines = markdown_table(version_rows(data)).splitlines()
    assert lines[0].endswith(
        "| sessions | turns/session | outcomes | success | failure | abandoned |"
    ), lines[0]
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ")[7:] for line in lines[2:]}
    assert cells["1"] == ["2", "3.5", "2", "50%", "50%", "0% |"], cells["1"]
    assert cells["2"] == ["3", "2.3", "2", "0%", "50%", "50% |"], cells["2"]
    assert cells["3"] == ["1", "5.0", "0", "", "", " |"], cells["3"]
    assert lines[5].endswith("|  |  |  |  |  |  |"), "v4 served no session: blanks, not zeros"


def test_the_page_shows_sessions_per_version_and_dashes_without_them():
    data = ReportData(
        "m",
        T0,
        versions=[VersionInfo(v, {"kind": "trained"}) for v in ("1", "4")],
        sessions=_sessions(),
    )
    html = build_report(data)
    assert (
        '<td class="num">2</td><td class="num">3.5</td><td class="num">50% · 50% · 0% (of 2)</td>'
        in html
    )
    assert '<td class="num">—</td>' * 3 + "</tr>" in html, "v4 served no session"
