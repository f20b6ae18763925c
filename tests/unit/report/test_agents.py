"""The held-out agent figures in the report (app/simulate/agent_eval.py's metrics and version tags):
per-version rows, the Markdown table's agent columns, the page's plot, and the gate's agent tags."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from app.report.model import (
    AGENT_METRICS,
    AgentHeldOut,
    ReportData,
    VersionInfo,
    agent_by_version,
    gate_by_version,
    heldout_by_version,
    markdown_table,
    version_rows,
)
from app.report.page import build_report

T0 = datetime(2026, 1, 1, tzinfo=UTC)

# v1: every figure as a metric (step = version); v2: only as version tags (4 decimals, as the
# evaluator writes them); v3: a metric and a tag for task success (the metric wins), one bound
# only, no monitors; v4: monitors without task success (no agent figures).
METRICS = {
    "heldout_task_success": [(1, 0.21875), (3, 0.40625)],
    "heldout_task_success_ci_low": [(1, 0.12), (3, 0.3)],
    "heldout_task_success_ci_high": [(1, 0.31)],
    "heldout_agent_satisfaction": [(1, 0.5)],
    "heldout_turns": [(1, 4.5), (4, 2.0)],
    "heldout_tokens": [(1, 301.7)],
    "heldout_tool_error_rate": [(1, 0.125)],
    "heldout_invalid_call_rate": [(1, 0.0625)],
    "heldout_give_up_rate": [(1, 0.25)],
    "heldout_tests_edited_rate": [(1, 0.03125)],
}
V2_TAGS = {
    "heldout_task_success": "0.5000",
    "heldout_task_success_ci_low": "0.4000",
    "heldout_task_success_ci_high": "0.6000",
    "heldout_turns": "3.2500",
    "heldout_tokens": "250.0000",
    "heldout_tool_error_rate": "0.0500",
    "heldout_invalid_call_rate": "0.0100",
    "heldout_give_up_rate": "0.1000",
    "heldout_tests_edited_rate": "0.0000",
}


def _data() -> ReportData:
    return ReportData(
        "m",
        T0,
        versions=[
            VersionInfo("1", {"kind": "base", "heldout_acceptance": "0.3000"}),
            VersionInfo("2", {"kind": "trained", **V2_TAGS}),
            VersionInfo("3", {"kind": "trained", "heldout_task_success": "0.1"}),
            VersionInfo("4", {"kind": "trained"}),
        ],
        heldout=METRICS,
    )


def test_agent_figures_come_from_the_metric_at_step_version_else_the_tag():
    agents = agent_by_version(_data())
    assert set(agents) == {"1", "2", "3"}, "v4 has monitors but no task success: no agent figures"
    assert agents["1"] == AgentHeldOut(
        0.21875, 0.12, 0.31, 4.5, 301.7, 0.125, 0.0625, 0.25, 0.03125
    ), "every figure from the metrics"
    assert agents["2"] == AgentHeldOut(0.5, 0.4, 0.6, 3.25, 250.0, 0.05, 0.01, 0.1, 0.0), (
        "every figure from the tags"
    )
    assert agents["3"] == AgentHeldOut(0.40625), (
        "the metric wins over the tag; one bound is no interval; absent monitors are None"
    )
    assert set(heldout_by_version(_data())) == {"1"}, "the agent figures are not acceptance"


def test_version_rows_carry_the_agent_figures():
    rows = {r.version: r for r in version_rows(_data())}
    assert rows["1"].agent is not None and rows["1"].agent.task_success == 0.21875
    assert rows["2"].agent is not None and rows["2"].agent.turns == 3.25
    assert rows["4"].agent is None


def test_the_markdown_table_adds_the_agent_columns_when_a_version_has_agent_figures():
    lines = markdown_table(version_rows(_data())).splitlines()
    assert lines[0] == (
        "| version | kind | held-out acceptance | 95% CI | task success | 95% CI | turns | tokens "
        "| tool errors/turn | give-ups | tests edited | gate | failing checks | canary "
        "| sessions | turns/session | outcomes | success | failure | abandoned |"
    ), lines[0]
    assert lines[1] == "|" + "---|" * 20
    blank = "  |" * 6  # no sessions
    assert lines[2] == (
        "| 1 | base | 0.300 |  | 0.219 | [0.120, 0.310] | 4.5 | 302 | 0.125 | 25.0% | 3.1% "
        "|  |  |  |" + blank
    ), lines[2]
    assert lines[3] == (
        "| 2 | trained |  |  | 0.500 | [0.400, 0.600] | 3.2 | 250 | 0.050 | 10.0% | 0.0% "
        "|  |  |  |" + blank
    ), lines[3]
    assert lines[4] == "| 3 | trained |  |  | 0.406 |  |  |  |  |  |  |  |  |  |" + blank
    assert lines[5] == "| 4 | trained |  |  |" + "  |" * 7 + "  |  |  |" + blank, (
        "a version without agent figures: blanks"
    )


def test_the_markdown_table_without_agent_figures_has_no_agent_column():
    data = ReportData("m", T0, versions=[VersionInfo("1", {"kind": "base"})])
    lines = markdown_table(version_rows(data)).splitlines()
    assert lines[0] == (
        "| version | kind | held-out acceptance | 95% CI | gate | failing checks | canary "
        "| sessions | turns/session | outcomes | success | failure | abandoned |"
    )
    assert lines[2] == "| 1 | base |  |  |  |  |  |" + "  |" * 6


def test_an_agent_loops_report_leaves_out_the_acceptance_it_does_not_have():
    data = ReportData(
        "m",
        T0,
        versions=[
            VersionInfo("1", {"kind": "base", **V2_TAGS}),
            VersionInfo("2", {"kind": "trained"}),
        ],
    )
    rows = version_rows(data)
    lines = markdown_table(rows).splitlines()
    assert lines[0] == (
        "| version | kind | task success | 95% CI | turns | tokens | tool errors/turn | give-ups "
        "| tests edited | gate | failing checks | canary "
        "| sessions | turns/session | outcomes | success | failure | abandoned |"
    ), lines[0]
    assert lines[2].startswith("| 1 | base | 0.500 | [0.400, 0.600] | 3.2 |"), lines[2]
    html = build_report(data)
    assert '<section id="agents">' in html and 'id="heldout"' not in html
    assert "No held-out results yet" not in html


def test_the_gates_agent_figure_tags_are_not_checks():
    tags = {
        "flywheel.gate.status": "failed",
        "flywheel.gate.agent_task_success": "pass 0.0312",
        "flywheel.gate.agent_tests_edited_rate": "fail 0.25",
        "flywheel.gate.agent_turns": "skipped",
        "flywheel.gate.ope.snips": "0.4",
        "flywheel.gate.agents.candidate.task_success": "0.4062",
        "flywheel.gate.agents.champion.tests_edited_rate": "0",
        "flywheel.gate.agents.base.turns": "4.5",
    }
    gate = gate_by_version(ReportData("m", T0, versions=[VersionInfo("7", tags)]))["7"]
    assert [(c["name"], c["status"], c["value"]) for c in gate.checks] == [
        ("agent_task_success", "pass", 0.0312),
        ("agent_tests_edited_rate", "fail", 0.25),
        ("agent_turns", "skipped", None),
    ]
    assert [c["name"] for c in gate.failing] == ["agent_tests_edited_rate"]


def test_the_page_plots_agent_task_success_and_its_monitors_only_when_there_are_figures():
    from app.report.plots import agent_plot

    rows = version_rows(_data())
    uri = agent_plot(rows)
    assert uri is not None and uri.startswith("data:image/svg+xml;base64,")
    html = build_report(_data())
    assert '<section id="agents">' in html
    assert 'alt="held-out agent task success per version"' in html
    # the monitors' table, newest first: v3 has task success only
    assert (
        '<tr data-version="1"><td>v1</td><td class="num">0.219</td>'
        '<td class="num">[0.120, 0.310]</td><td class="num">4.5</td><td class="num">302</td>'
        '<td class="num">0.125</td><td class="num">0.062</td><td class="num">25.0%</td>'
        '<td class="num">3.1%</td></tr>' in html
    )
    assert (
        '<tr data-version="3"><td>v3</td><td class="num">0.406</td>'
        + ('<td class="num">—</td>' * 7)
        + "</tr>"
        in html
    )
    assert "held-out task success</dt><dd>v1 0.219 → best v2 0.500" in html

    plain = ReportData("m", T0, versions=[VersionInfo("1", {"kind": "base"})])
    assert agent_plot(version_rows(plain)) is None
    assert 'id="agents"' not in build_report(plain) and "task success" not in build_report(plain)


def test_the_heldout_runs_of_the_model_are_read_with_the_agent_figures(tmp_path: Path):
    """Both `flywheel-heldout` runs of the model (found by the tag `model`) are read; another
    model's run is not."""
    from mlflow import MlflowClient

    from app.report.sources import _heldout_metrics

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.create_experiment("flywheel-heldout", artifact_location=str(tmp_path / "a"))
    acc = client.create_run(exp, run_name="heldout-acceptance", tags={"model": "m"})
    agents = client.create_run(exp, run_name="heldout-task-success", tags={"model": "m"})
    other = client.create_run(exp, run_name="heldout-task-success", tags={"model": "other"})
    client.log_metric(acc.info.run_id, "heldout_acceptance", 0.3, step=1)
    for v in (1, 2):
        for i, name in enumerate(AGENT_METRICS):
            client.log_metric(agents.info.run_id, name, 0.1 * v + 0.01 * i, step=v)
    client.log_metric(other.info.run_id, "heldout_task_success", 0.9, step=3)

    data = ReportData("m", T0, heldout=_heldout_metrics(client, "m"))
    assert data.heldout["heldout_acceptance"] == [(1, 0.3)]
    assert data.heldout["heldout_task_success"] == [(1, 0.1), (2, 0.2)], "not the other model's"
    assert data.heldout["heldout_tests_edited_rate"] == [(1, 0.18), (2, 0.28)]
    agents_by_version = agent_by_version(data)
    assert set(agents_by_version) == {"1", "2"}
    assert agents_by_version["2"].turns == 0.23 and agents_by_version["2"].ci_high == 0.22
