"""`flywheel report`: one self-contained HTML page that shows how the loop is doing.

    from app.report import build_report, write_report
    data = load_report_data(sources)      # app/report/sources.py: MLflow + the deployments log
    html = build_report(data)             # app/report/page.py: str, every plot inline
    write_report(html, Path("report.html"))

The page shows held-out acceptance per version (with its confidence interval when the version
carries one), held-out agent task success per version with the sessions' monitors (when the
agent evaluator has run), reward and KL over the trainer's optimizer steps, gate decisions per version with
the failing checks, canary steps with their confidence bounds, promotions and rollbacks on a
timeline, and a per-version table (with the sessions each version served: turns per session,
outcome shares). Plots are matplotlib SVGs embedded as `data:` URIs; the page
has no script, loads nothing from the network (a Content-Security-Policy forbids it) and opens
from a file.

Modules:
- `model.py`    what the page is made of (ReportData) and the pure folds over it (per-version rows,
                canary steps, timeline); no I/O.
- `sources.py`  where the data comes from: a data dir (MLflow's SQLite store and the projection
                database, read directly) or a running stack (MLflow server, API, Kafka topic);
                the sessions each version served from the sessions projection.
- `plots.py`    the figures (matplotlib, Agg) as SVG data URIs.
- `page.py`     the HTML page.
- `screenshot.py` a headless Chromium that renders a report and saves a PNG (docs/report.png).

May import: app.contracts, app.db, app.settings
Tests: tests/unit/report/, tests/integration/report/
Docs: docs/REPORT.md
"""

from __future__ import annotations

from pathlib import Path

from app.report.model import ReportData
from app.report.page import build_report
from app.report.sources import ReportSources, SourceMissing, load_report_data

__all__ = [
    "ReportData",
    "ReportSources",
    "SourceMissing",
    "build_report",
    "load_report_data",
    "write_report",
]


def write_report(html: str, out: Path) -> Path:
    """Write the page atomically (a reader never sees half a page); returns the resolved path."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)
    return out
