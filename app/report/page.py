"""The report page: one HTML document, styles and figures inline, no script.

`build_report(data)` -> str. Sections (each says "no ... yet" and why when it has no data):
summary, held-out acceptance per version (left out of an agent loop's report, which has task
success and no acceptance), held-out agent task success per version (only when a version has
agent figures), training curves, gate decisions, canary steps, rollout timeline,
versions. A Content-Security-Policy (`default-src 'none'; img-src data:;
style-src 'unsafe-inline'`) makes the browser refuse anything the page would fetch, so a page
that renders cleanly is self-contained.
"""

from __future__ import annotations

from datetime import datetime
from html import escape
from typing import Any

import app.report.plots as plots
from app.report.model import (
    OUTCOMES,
    CanaryStep,
    GateVerdict,
    ReportData,
    Rollout,
    VersionRow,
    canary_steps,
    check_names,
    gate_by_version,
    rollout,
    ship_steps,
    shows_acceptance,
    version_rows,
    vkey,
)

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;color:#263238;margin:0;background:#f5f7f8}
main{max-width:1180px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:0 0 8px}
section{background:#fff;border:1px solid #dde3e6;border-radius:8px;padding:16px 20px;margin:16px 0}
.meta{color:#607d8b;font-size:12px}.empty{color:#78909c;font-style:italic;margin:6px 0}
.lead{margin:2px 0 10px;color:#455a64}
img.plot{display:block;width:100%;max-width:1080px;height:auto;margin:4px 0 10px}
.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:12.5px;width:100%}
th,td{border-bottom:1px solid #e3e8eb;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef2f4;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass{color:#2e7d32}.fail{color:#c62828;font-weight:600}.skipped{color:#90a4ae}.info{color:#546e7a}
td.cell-fail{background:#fdecea}th.check{font-size:11.5px;min-width:64px}
.badge{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;background:#eceff1}
.badge.good{background:#e0f2e9;color:#1b5e20}.badge.bad{background:#fdecea;color:#b71c1c}
.badge.warn{background:#fff3e0;color:#e65100}
dl.summary{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0 0}
dl.summary dt{color:#607d8b}dl.summary dd{margin:0}
"""


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def _ts(t: datetime | None) -> str:
    return "—" if t is None else t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _img(uri: str | None, alt: str, empty: str) -> str:
    if uri is None:
        return f'<p class="empty">{escape(empty)}</p>'
    return f'<img class="plot" src="{uri}" alt="{escape(alt)}">'


def _section(sid: str, title: str, lead: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{escape(title)}</h2><p class="lead">{escape(lead)}</p>{body}</section>'


def _summary(data: ReportData, rows: list[VersionRow], r: Rollout) -> str:
    champ = r.champion_spans[-1][2] if r.champion_spans else None
    held = [(row.version, row.heldout.acceptance) for row in rows if row.heldout is not None]
    promoted = [row for row in rows if row.promoted]
    items = [
        ("model", data.model),
        ("versions", str(len(rows))),
        ("champion now", f"v{champ}" if champ else "none yet"),
        ("promotions / rollbacks", f"{len(r.promoted)} / {len(r.rolled_back)}"),
        (
            "gate failures",
            str(sum(1 for row in rows if row.gate is not None and not row.gate.passed)),
        ),
    ]
    agents = [(row.version, row.agent.task_success) for row in rows if row.agent is not None]
    last = promoted[-1] if promoted else None
    for name, points, last_value in (
        ("held-out acceptance", held, last.heldout.acceptance if last and last.heldout else None),
        ("held-out task success", agents, last.agent.task_success if last and last.agent else None),
    ):
        if points:
            items.append((name, _progress(points, last, last_value)))
    items += [(f"source: {k}", v) for k, v in data.sources.items() if k != "model"]
    items.append(("generated", _ts(data.generated_at)))
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in items)
    return f'<h1>Flywheel report: {escape(data.model)}</h1><p class="meta">{escape(_ts(data.generated_at))}</p><dl class="summary">{dl}</dl>'


def _progress(points: list[tuple[str, float]], last: VersionRow | None, value: float | None) -> str:
    """`v1 0.340 → best v9 0.880; last promoted v8 0.836` of a held-out figure per version."""
    (v0, x0), (vb, xb) = points[0], max(points, key=lambda p: p[1])
    text = f"v{v0} {x0:.3f} → best v{vb} {xb:.3f}"
    return text + (
        f"; last promoted v{last.version} {value:.3f}" if last and value is not None else ""
    )


def _check_cell(check: dict[str, Any] | None) -> str:
    if check is None:
        return "<td></td>"
    status = str(check.get("status", ""))
    value = check.get("value")
    thr = check.get("threshold")
    text = status + (f" {value:.3g}" if isinstance(value, (int, float)) else "")
    title = check.get("detail") or ""
    if isinstance(thr, (int, float)):
        title = f"threshold {thr:.4g}. {title}"
    return f'<td class="cell-{escape(status)}" title="{escape(title)}"><span class="{escape(status)}">{escape(text)}</span></td>'


def _gate_section(gates: dict[str, GateVerdict]) -> str:
    lead = (
        "One row per gated version: each check's status and value (hover for the threshold and detail). "
        "A version passes when no check fails; a skipped check is not a pass."
    )
    if not gates:
        return _section(
            "gate",
            "Gate decisions",
            lead,
            '<p class="empty">No gate decisions yet: the controller has not '
            "gated a version (no gate_passed / gate_failed events and no flywheel.gate.* tags).</p>",
        )
    names = check_names(gates)
    head = "".join(f"<th>{h}</th>" for h in ("version", "verdict", "failing check(s)")) + "".join(
        f'<th class="check">{escape(n).replace("_", "_<wbr>")}</th>' for n in names
    )
    body = []
    for v in sorted(gates, key=vkey, reverse=True):
        g = gates[v]
        by_name = {c.get("name"): c for c in g.checks}
        verdict = (
            '<span class="badge good">passed</span>'
            if g.passed
            else '<span class="badge bad">failed</span>'
        )
        failing = ", ".join(escape(str(c.get("name"))) for c in g.failing) or "—"
        body.append(
            f'<tr data-version="{escape(v)}"><td>v{escape(v)}</td><td>{verdict}</td><td class="fail">{failing}</td>'
            + "".join(_check_cell(by_name.get(n)) for n in names)
            + "</tr>"
        )
    reasons = "".join(
        f"<li>v{escape(v)}: {escape(gates[v].reason)}</li>"
        for v in sorted(gates, key=vkey)
        if not gates[v].passed and gates[v].reason
    )
    detail = f"<p><b>Why the failed versions failed</b></p><ul>{reasons}</ul>" if reasons else ""
    return _section(
        "gate",
        "Gate decisions",
        lead,
        f'<div class="scroll"><table><tr>{head}</tr>{"".join(body)}</table></div>{detail}',
    )


def _canary_section(steps: list[CanaryStep]) -> str:
    lead = (
        "Each judged canary step: the difference in mean labelled reward, candidate − champion, with its "
        "time-uniform confidence-sequence bounds. Lower bound above −margin: the step passes; upper bound "
        "below −margin: automatic rollback; otherwise inconclusive (paused at the step deadline)."
    )
    if not steps:
        return _section(
            "canary",
            "Canary steps",
            lead,
            '<p class="empty">No canary steps yet: no canary has been '
            "judged (no traffic_shifted / promoted / rolled_back / canary_paused event with an analysis).</p>",
        )
    img = _img(
        plots.canary_plot(steps),
        "canary steps with confidence bounds",
        "No step had enough labelled samples for a delta yet.",
    )
    rows = "".join(
        f'<tr data-version="{escape(s.version)}"><td>v{escape(s.version)}</td><td class="num">{s.step}</td>'
        f'<td class="num">{_num(s.traffic_pct, "g")}%</td><td>{escape(s.verdict)}</td><td class="num">{_num(s.delta, "+.4f")}</td>'
        f'<td class="num">[{_num(s.lower, "+.4f")}, {_num(s.upper, "+.4f")}]</td><td class="num">{s.n_candidate} / {s.n_champion}</td>'
        f"<td>{escape(s.outcome.replace('_', ' '))}</td><td>{escape(_ts(s.ts))}</td></tr>"
        for s in steps
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "version",
            "step",
            "traffic",
            "verdict",
            "delta",
            "bounds",
            "n cand / champ",
            "then",
            "at",
        )
    )
    return _section("canary", "Canary steps", lead, f"{img}<table><tr>{head}</tr>{rows}</table>")


def _timeline_section(data: ReportData, r: Rollout) -> str:
    lead = (
        "Every version on its own line over time: registration, gate verdict, canary steps, promotion "
        "and rollback. The green band is the version serving as champion."
    )
    if not r.marks:
        return _section(
            "timeline",
            "Promotions and rollbacks",
            lead,
            '<p class="empty">No deployment events yet: nothing has been registered, promoted or rolled back.</p>',
        )
    img = _img(plots.timeline_plot(r, data.generated_at), "rollout timeline", "")
    key = [m for m in r.marks if m.kind in ("promoted", "rolled_back", "aborted", "canary_paused")]
    items = "".join(
        f'<li class="{m.kind}">{escape(_ts(m.ts))}: {escape(m.label)}</li>' for m in key
    )
    return _section(
        "timeline",
        "Promotions and rollbacks",
        lead,
        img
        + (f"<ul>{items}</ul>" if items else '<p class="empty">No promotion or rollback yet.</p>'),
    )


def _agent_section(rows: list[VersionRow]) -> str:
    """Held-out agent task success and the sessions' monitors per version; "" (no section) when
    no version has agent figures."""
    pts = [row for row in rows if row.agent is not None]
    if not pts:
        return ""
    lead = (
        "Share of held-out tasks the agent sessions solved (hidden tests pass; flywheel-heldout run "
        "heldout-task-success) per version, with its 95% interval; under it the same sessions' "
        "monitors: turns per session, and the shares that gave up and that edited the tests."
    )
    img = _img(plots.agent_plot(rows), "held-out agent task success per version", "")
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "version",
            "task success",
            "95% CI",
            "turns / session",
            "tokens / session",
            "tool errors / turn",
            "invalid calls / turn",
            "gave up",
            "edited the tests",
        )
    )
    body = []
    for row in reversed(pts):
        a = row.agent
        ci = (
            f"[{a.ci_low:.3f}, {a.ci_high:.3f}]"
            if a.ci_low is not None and a.ci_high is not None
            else "—"
        )
        cells = (
            f"{a.task_success:.3f}",
            ci,
            _num(a.turns, ".1f"),
            _num(a.tokens, ".0f"),
            _num(a.tool_error_rate),
            _num(a.invalid_call_rate),
            _num(a.give_up_rate, ".1%"),
            _num(a.tests_edited_rate, ".1%"),
        )
        body.append(
            f'<tr data-version="{escape(row.version)}"><td>v{escape(row.version)}</td>'
            + "".join(f'<td class="num">{c}</td>' for c in cells)
            + "</tr>"
        )
    return _section(
        "agents",
        "Held-out agent task success per version",
        lead,
        f'{img}<div class="scroll"><table><tr>{head}</tr>{"".join(body)}</table></div>',
    )


def _badge(row: VersionRow) -> str:
    parts = []
    if row.champion_now:
        parts.append('<span class="badge good">champion</span>')
    elif row.served and not row.promoted:
        parts.append('<span class="badge">served as champion</span>')
    if row.promoted:
        parts.append('<span class="badge good">promoted</span>')
    if row.rolled_back:
        parts.append('<span class="badge bad">rolled back</span>')
    return " ".join(parts) or "—"


def _session_cells(row: VersionRow) -> str:
    """Sessions the version served, their mean turns and how they ended: dashes (not zeros)
    for a version that served none, and for outcome shares before any session reached one."""
    st = row.sessions
    if st is None:
        return '<td class="num">—</td>' * 3
    ended = (
        "—"
        if st.shares is None
        else " · ".join(f"{st.shares[o]:.0%}" for o in OUTCOMES) + f" (of {st.with_outcome})"
    )
    return (
        f'<td class="num">{st.sessions}</td><td class="num">{st.turns_mean:.1f}</td>'
        f'<td class="num">{ended}</td>'
    )


def _versions_section(rows: list[VersionRow]) -> str:
    lead = (
        "Every version the registry or the deployments log knows, newest first; the sessions "
        "columns count the agent sessions whose turns it served (the sessions projection)."
    )
    if not rows:
        return _section(
            "versions",
            "Versions",
            lead,
            '<p class="empty">No versions yet: the trainer has not '
            "registered one (the registered model has no versions and the log no version_registered).</p>",
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "version",
            "kind",
            "parent",
            "reward spec",
            "held-out acceptance",
            "gate",
            "failing check(s)",
            "canary",
            "promoted / rolled back",
            "sessions served",
            "turns / session",
            "outcomes: success · failure · abandoned",
        )
    )
    body = []
    for row in reversed(rows):
        h = row.heldout
        held = (
            "—"
            if h is None
            else f"{h.acceptance:.3f}"
            + (
                f" [{h.ci_low:.3f}, {h.ci_high:.3f}]"
                if h.ci_low is not None and h.ci_high is not None
                else ""
            )
        )
        gate = (
            "—"
            if row.gate is None
            else (
                '<span class="pass">passed</span>'
                if row.gate.passed
                else '<span class="fail">failed</span>'
            )
        )
        failing = (
            ", ".join(escape(str(c.get("name"))) for c in row.gate.failing) if row.gate else ""
        )
        body.append(
            f'<tr data-version="{escape(row.version)}"><td>v{escape(row.version)}</td><td>{escape(row.kind)}</td>'
            f"<td>{'v' + escape(row.parent) if row.parent else '—'}</td><td>{escape(row.reward_spec or '—')}</td>"
            f'<td class="num">{held}</td><td>{gate}</td><td class="fail">{failing or "—"}</td>'
            f"<td>{escape(row.canary or '—')}</td><td>{_badge(row)}</td>{_session_cells(row)}</tr>"
        )
    return _section("versions", "Versions", lead, f"<table><tr>{head}</tr>{''.join(body)}</table>")


def build_report(data: ReportData) -> str:
    rows, gates, r = version_rows(data), gate_by_version(data), rollout(data.events)
    steps = canary_steps(data.events)
    held_lead = (
        "Acceptance probability of held-out simulated users on held-out prompts (flywheel-heldout), per "
        "version; bars are the confidence interval where the version carries one."
    )
    train_lead = (
        "The trainer's per-step metrics (flywheel-trainer): mean reward of each batch, and the KL "
        "penalty's measured divergence per token; dotted lines mark the step each version shipped at."
    )
    sections = [
        f"<section>{_summary(data, rows, r)}</section>",
        _section(
            "heldout",
            "Held-out acceptance per version",
            held_lead,
            _img(
                plots.heldout_plot(rows),
                "held-out acceptance per version",
                "No held-out results yet: no version has been evaluated (no heldout_acceptance metric or tag; "
                "`flywheel simulate` evaluates every registered version).",
            ),
        )
        if shows_acceptance(rows)
        else "",
        _agent_section(rows),
        _section(
            "training",
            "Reward and KL over training steps",
            train_lead,
            _img(
                plots.training_plot(data.trainer, ship_steps(data)),
                "reward and KL per optimizer step",
                "No training metrics yet: no flywheel-trainer run of this model has logged a step.",
            ),
        ),
        _gate_section(gates),
        _canary_section(steps),
        _timeline_section(data, r),
        _versions_section(rows),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Flywheel report: {escape(data.model)}</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(sections)}</main></body></html>\n"
    )
