"""Render a report in a real headless Chromium: a full-page PNG, and what the browser saw.

    python -m app.report.screenshot --data-dir .flywheel --out docs/report.png   # make report-screenshot

builds the data dir's report (as `flywheel report` does), opens it from a `file://` URL in
Debian's `/usr/bin/chromium` driven by Playwright (`make chromium` installs it; `playwright
install` is never used) and saves a full-page screenshot. `render(html, png)` is what the
integration test uses: it returns the console errors, the requests the page tried to make
(none for a self-contained page) and the rendered size of every image.

Playwright is a test dependency (`pip install -e .[test]`); this module imports it only when
called.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Rendered:
    png: Path
    console_errors: list[str] = field(
        default_factory=list
    )  # console messages of type error, and page errors
    requests: list[str] = field(
        default_factory=list
    )  # URLs the page requested besides itself (data: excluded)
    images: list[tuple[str, float, float]] = field(
        default_factory=list
    )  # (alt, width, height) as laid out
    page_height: float = 0.0


def render(
    html: Path, png: Path, *, width: int = 1280, timeout_s: float = 120.0, chromium: Path = CHROMIUM
) -> Rendered:
    """Open `html` in headless Chromium, wait until every image is decoded, save a full-page PNG."""
    from playwright.sync_api import sync_playwright

    if not chromium.is_file():
        raise FileNotFoundError(
            f"{chromium} is missing: run `make chromium` (deploy/chromium/ensure.sh)"
        )
    html, png = html.resolve(), png.resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    out = Rendered(png)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(chromium),
            headless=True,
            args=CHROMIUM_ARGS,
            timeout=timeout_s * 1000,
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": 900}, device_scale_factor=1)
            page.set_default_timeout(timeout_s * 1000)
            page.on(
                "console",
                lambda m: out.console_errors.append(m.text) if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: out.console_errors.append(f"page error: {e}"))
            page.on(
                "request",
                lambda r: (
                    None
                    if r.url.startswith("data:") or r.url == html.as_uri()
                    else out.requests.append(r.url)
                ),
            )
            page.goto(html.as_uri(), wait_until="load")
            page.wait_for_function(
                "Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)"
            )
            out.images = [
                (a, w, h)
                for a, w, h in page.eval_on_selector_all(
                    "img",
                    "els => els.map(e => [e.alt, e.getBoundingClientRect().width, e.getBoundingClientRect().height])",
                )
            ]
            out.page_height = page.evaluate("document.documentElement.scrollHeight")
            page.screenshot(path=str(png), full_page=True)
        finally:
            browser.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.report.screenshot", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="data dir (default FLYWHEEL_DATA_DIR)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/report.png"), help="PNG to write")
    parser.add_argument(
        "--html",
        type=Path,
        default=None,
        help="report page to write (default <data_dir>/report.html)",
    )
    parser.add_argument(
        "--mlflow-uri", default=None, help="a running MLflow server instead of the data dir's store"
    )
    args = parser.parse_args(argv)

    from app.report import (
        ReportSources,
        SourceMissing,
        build_report,
        load_report_data,
        write_report,
    )
    from app.settings import get_settings

    settings = get_settings()
    if args.data_dir is not None:
        settings = settings.model_copy(update={"data_dir": args.data_dir})
    try:
        data = load_report_data(ReportSources.resolve(settings, mlflow_uri=args.mlflow_uri))
    except SourceMissing as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    html = write_report(build_report(data), args.html or settings.data_dir / "report.html")
    shot = render(html, args.out)
    if shot.console_errors or shot.requests:
        print(
            f"the page is not clean: console errors {shot.console_errors}, requests {shot.requests}",
            file=sys.stderr,
        )
        return 1
    print(f"{html}\n{shot.png} ({len(shot.images)} figures, page {shot.page_height:.0f}px tall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
