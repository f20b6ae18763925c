"""The report's figures: matplotlib (Agg, no pyplot state) rendered to SVG `data:` URIs.

Each function takes the folded rows of app/report/model.py and returns a `data:image/svg+xml`
URI, or None when there is nothing to draw (the page then says so). SVG text is drawn as paths
(`svg.fonttype = path`), so a figure needs no font and no network; each figure is its own image,
so the ids matplotlib writes into one SVG cannot clash with another's.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from datetime import datetime
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before anything imports pyplot (nothing here does)

from matplotlib import dates as mdates
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import PercentFormatter

from app.report.model import CanaryStep, Rollout, VersionRow, vkey

GREEN, RED, ORANGE, BLUE, GREY, DARK = (
    "#2e7d32",
    "#c62828",
    "#ef6c00",
    "#1565c0",
    "#90a4ae",
    "#37474f",
)
TEAL, PURPLE = "#00838f", "#6a1b9a"  # the agent monitors' lines (not a version's colour)
VERDICT_COLOURS = {
    "better_or_equal": GREEN,
    "worse": RED,
    "inconclusive": ORANGE,
    "insufficient": GREY,
}
MAX_POINTS = (
    1500  # per curve; longer series are strided (the moving mean is computed on every point)
)
WIDTH_IN = (
    10.0  # every figure has this width, so all render at one scale (the page stretches them alike)
)
STYLE = {
    "svg.fonttype": "path",
    "svg.hashsalt": "flywheel-report",
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.25,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "legend.fontsize": 8,
    "legend.frameon": False,
}


def _uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _row_colour(row: VersionRow) -> str:
    if row.gate is not None and not row.gate.passed:
        return RED
    if row.rolled_back:
        return ORANGE
    if row.served:
        return GREEN
    return BLUE


def _marker(row: VersionRow, colour: str) -> str:
    return "X" if colour == RED else "*" if row.champion_now else "o"


def _per_version_axis(
    ax: Any,
    pts: list[VersionRow],
    value: Callable[[VersionRow], float],
    interval: Callable[[VersionRow], tuple[float | None, float | None]],
) -> list[int]:
    """One score per version on `ax`: interval bars where both bounds exist, each point coloured
    (and marked) by what became of its version, the champions' step line and the first version's
    level. Returns the x of each point (the version numbers)."""
    xs = [vkey(r.version) for r in pts]
    ax.plot(xs, [value(r) for r in pts], color=GREY, lw=1, zorder=1)
    # what served, version after version: it should only go up
    champs = [r for r in pts if r.served]
    if len(champs) > 1:
        ax.step(
            [vkey(r.version) for r in champs] + [xs[-1]],
            [value(r) for r in champs] + [value(champs[-1])],
            where="post",
            color=GREEN,
            lw=2.5,
            alpha=0.35,
            zorder=1,
        )
    for x, r in zip(xs, pts):
        y, (low, high), colour = value(r), interval(r), _row_colour(r)
        if low is not None and high is not None:
            ax.errorbar(
                [x], [y], yerr=[[y - low], [high - y]], color=colour, capsize=3, lw=1.2, zorder=2
            )
        marker = _marker(r, colour)
        ax.scatter([x], [y], color=colour, marker=marker, s=90 if marker == "*" else 40, zorder=3)
        if len(pts) <= 24:
            ax.annotate(
                f"{y:.3f}",
                (x, high if high is not None else y),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=7,
                color=DARK,
            )
    ax.axhline(value(pts[0]), color=DARK, ls=":", lw=1)
    ax.set_xticks(xs, [f"v{r.version}" for r in pts])
    return xs


def _version_legend(first: str) -> list[Line2D]:
    return [
        Line2D([], [], color=GREEN, marker="o", ls="", label="served as champion"),
        Line2D([], [], color=GREEN, marker="*", ms=10, ls="", label="champion now"),
        Line2D([], [], color=ORANGE, marker="o", ls="", label="rolled back"),
        Line2D([], [], color=RED, marker="X", ls="", label="gate failed"),
        Line2D([], [], color=BLUE, marker="o", ls="", label="other"),
        Line2D([], [], color=GREEN, lw=2.5, alpha=0.35, label="champions, version after version"),
        Line2D([], [], color=DARK, ls=":", label=f"first version (v{first})"),
    ]


def heldout_plot(rows: list[VersionRow]) -> str | None:
    """Held-out acceptance per version, CI bars where present, coloured by what became of the version."""
    pts = [r for r in rows if r.heldout is not None]
    if not pts:
        return None
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(WIDTH_IN, 3.6), layout="constrained")
        ax = fig.add_subplot()
        _per_version_axis(
            ax, pts, lambda r: r.heldout.acceptance, lambda r: (r.heldout.ci_low, r.heldout.ci_high)
        )
        ax.set_ylabel("held-out acceptance")
        ax.set_title("Held-out acceptance per version")
        ax.margins(y=0.2)
        fig.legend(handles=_version_legend(pts[0].version), loc="outside right upper")
        return _uri(fig)


def agent_plot(rows: list[VersionRow]) -> str | None:
    """Held-out agent task success per version with its interval (drawn as `heldout_plot` draws
    acceptance), and under it the monitors of the same sessions: turns per session, and the shares
    of sessions that gave up and that edited the tests."""
    pts = [r for r in rows if r.agent is not None]
    if not pts:
        return None
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(WIDTH_IN, 6.4), layout="constrained")
        top, turns, rates = fig.subplots(3, 1, sharex=True, height_ratios=[2.2, 1, 1])
        xs = _per_version_axis(
            top, pts, lambda r: r.agent.task_success, lambda r: (r.agent.ci_low, r.agent.ci_high)
        )
        top.set_ylabel("held-out task success")
        top.set_title("Held-out agent task success per version, and the sessions' monitors")
        top.margins(y=0.2)

        def monitor(ax: Any, attr: str, colour: str, label: str | None = None) -> list[float]:
            """The line in the monitor's colour, each point in its version's colour and marker."""
            got = [(x, getattr(r.agent, attr), r) for x, r in zip(xs, pts)]
            got = [(x, y, r) for x, y, r in got if y is not None]
            if got:
                ax.plot(
                    [x for x, _, _ in got],
                    [y for _, y, _ in got],
                    color=colour,
                    lw=1.3,
                    label=label,
                )
            for x, y, r in got:
                c = _row_colour(r)
                m = _marker(r, c)
                ax.scatter([x], [y], color=c, marker=m, s=60 if m == "*" else 18, zorder=3)
            return [y for _, y, _ in got]

        monitor(turns, "turns", DARK)
        turns.set_ylabel("turns / session")
        turns.margins(y=0.25)
        shares = monitor(rates, "give_up_rate", TEAL, "gave up")
        shares += monitor(rates, "tests_edited_rate", PURPLE, "edited the tests")
        rates.set_ylabel("share of sessions")
        rates.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        top_share = max(shares, default=0.0)
        rates.set_ylim(-0.04 * max(top_share, 0.1), 1.25 * max(top_share, 0.1))
        if shares:
            rates.legend(loc="upper left")
        fig.legend(handles=_version_legend(pts[0].version), loc="outside right upper")
        return _uri(fig)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def training_plot(trainer: dict[str, list[tuple[int, float]]], ships: dict[str, int]) -> str | None:
    """Reward and KL (and loss when logged) over optimizer steps; dotted lines where versions shipped."""
    keys = [k for k in ("reward_mean", "kl", "loss") if trainer.get(k)]
    if not keys:
        return None
    labels = {
        "reward_mean": "reward (batch mean)",
        "kl": "KL to reference\n(k3, nats/token)",
        "loss": "loss",
    }
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(WIDTH_IN, 1.0 + 1.9 * len(keys)), layout="constrained")
        axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
        for ax, key in zip(axes, keys):
            steps, values = zip(*trainer[key])
            window = max(1, len(values) // 40)
            smooth = _smooth(list(values), window)
            stride = max(
                1, len(values) // MAX_POINTS
            )  # a long run's curves stay a few hundred kB of SVG
            ax.plot(steps[::stride], values[::stride], color=BLUE, alpha=0.25, lw=0.8)
            ax.plot(
                steps[::stride],
                smooth[::stride],
                color=BLUE,
                lw=1.6,
                label=f"moving mean of {window} steps" if window > 1 else None,
            )
            ax.set_ylabel(labels[key])
            for step in ships.values():
                if steps[0] <= step <= steps[-1]:
                    ax.axvline(step, color=GREY, ls=":", lw=1)
            if window > 1:
                ax.legend(loc="best")
        top = axes[0]
        for v, step in sorted(ships.items(), key=lambda kv: kv[1]):
            if trainer[keys[0]][0][0] <= step <= trainer[keys[0]][-1][0]:
                top.annotate(
                    f"v{v}",
                    (step, 1.0),
                    xycoords=("data", "axes fraction"),
                    fontsize=7,
                    color=DARK,
                    ha="center",
                    va="bottom",
                )
        axes[-1].set_xlabel("optimizer step")
        top.set_title(
            "Training: reward and KL per optimizer step (dotted: a version shipped)", pad=14
        )
        return _uri(fig)


def canary_plot(steps: list[CanaryStep]) -> str | None:
    """Each judged canary step: delta (candidate - champion mean reward) with its confidence-sequence bounds."""
    pts = [s for s in steps if s.delta is not None]
    if not pts:
        return None
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(WIDTH_IN, 3.6), layout="constrained")
        ax = fig.add_subplot()
        for i, s in enumerate(pts):
            colour = VERDICT_COLOURS.get(s.verdict, GREY)
            if s.lower is not None and s.upper is not None:
                ax.errorbar(
                    [i],
                    [s.delta],
                    yerr=[[s.delta - s.lower], [s.upper - s.delta]],
                    color=colour,
                    capsize=4,
                    lw=1.6,
                )
            ax.scatter(
                [i],
                [s.delta],
                color=colour,
                s=36,
                zorder=3,
                marker="v"
                if s.outcome == "rolled_back"
                else "*"
                if s.outcome == "promoted"
                else "o",
            )
            if i and pts[i - 1].version != s.version:
                ax.axvline(i - 0.5, color=GREY, lw=0.8)
        ax.axhline(0.0, color=DARK, lw=0.8)
        margins = sorted({s.margin for s in pts if s.margin is not None})
        for m in margins:
            ax.axhline(-m, color=RED, ls="--", lw=0.9)
        if len(pts) <= 16:
            ax.set_xticks(
                range(len(pts)),
                [
                    f"v{s.version}\nstep {s.step}"
                    + (f"\n{s.traffic_pct:g}%" if s.traffic_pct is not None else "")
                    for s in pts
                ],
            )
        else:  # many steps: one compact rotated label each
            ax.set_xticks(
                range(len(pts)),
                [
                    f"v{s.version} {s.traffic_pct:g}%"
                    if s.traffic_pct is not None
                    else f"v{s.version} #{s.step}"
                    for s in pts
                ],
                rotation=90,
                fontsize=7,
            )
        ax.set_xlim(-0.6, len(pts) - 0.4)
        ax.set_ylabel("reward delta, candidate − champion")
        ax.set_title("Canary steps: delta and confidence-sequence bounds")
        fig.legend(
            handles=[
                Line2D([], [], color=c, marker="o", ls="-", label=v.replace("_", " "))
                for v, c in VERDICT_COLOURS.items()
            ]
            + [
                Line2D([], [], color=DARK, marker="*", ls="", label="→ promoted"),
                Line2D([], [], color=DARK, marker="v", ls="", label="→ rolled back"),
            ]
            + [Line2D([], [], color=RED, ls="--", label=f"−margin ({m:g})") for m in margins],
            loc="outside right upper",
        )
        return _uri(fig)


MARK_STYLE = {  # kind -> (marker, colour, size, legend label)
    "registered": ("o", GREY, 22, "registered"),
    "gate_passed": ("o", GREEN, 30, "gate passed"),
    "gate_failed": ("X", RED, 60, "gate failed"),
    "canary_started": (">", BLUE, 36, "canary started / step"),
    "traffic_shifted": (">", BLUE, 36, None),
    "canary_paused": ("s", ORANGE, 36, "canary paused"),
    "canary_resumed": ("s", BLUE, 30, None),
    "aborted": ("x", DARK, 50, "canary aborted"),
    "promoted": ("*", GREEN, 150, "promoted"),
    "rolled_back": ("v", RED, 90, "rolled back"),
}


def timeline_plot(r: Rollout, until: datetime) -> str | None:
    """Versions (y) over time (x): the champion's spans, and every decision as a marker."""
    if not r.marks:
        return None
    with matplotlib.rc_context(STYLE):
        versions = sorted({vkey(m.version) for m in r.marks})
        fig = Figure(figsize=(WIDTH_IN, max(3.2, 1.2 + 0.28 * len(versions))), layout="constrained")
        ax = fig.add_subplot()
        end = max(until, max(m.ts for m in r.marks))
        for start, stop, v in r.champion_spans:
            ax.plot(
                [start, stop or end],
                [vkey(v)] * 2,
                color=GREEN,
                lw=6,
                alpha=0.35,
                solid_capstyle="butt",
            )
        seen: set[str] = set()
        for kind, (marker, colour, size, label) in MARK_STYLE.items():
            ms = [m for m in r.marks if m.kind == kind]
            if ms:
                ax.scatter(
                    [m.ts for m in ms],
                    [vkey(m.version) for m in ms],
                    marker=marker,
                    color=colour,
                    s=size,
                    zorder=3,
                    label=label if label and label not in seen else None,
                )
                seen.add(label or "")
        ax.set_yticks(versions, [f"v{v}" for v in versions])
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
        ax.set_xlabel("time (UTC)")
        ax.set_title("Rollout timeline (green band: the serving champion)")
        ax.margins(y=0.12)
        handles, labels = ax.get_legend_handles_labels()
        handles.insert(0, Line2D([], [], color=GREEN, lw=6, alpha=0.35))
        labels.insert(0, "champion")
        fig.legend(handles, labels, loc="outside right upper")
        return _uri(fig)
