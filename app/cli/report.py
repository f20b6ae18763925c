"""`flywheel report`: one self-contained HTML page of the loop's history (app/report/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.common import _configured, _say, console


def report(
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Data dir to report on (default FLYWHEEL_DATA_DIR): its MLflow "
            "store and app database are read directly."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Where to write the page (default <data_dir>/report.html)."),
    ] = None,
    mlflow_uri: Annotated[
        str | None,
        typer.Option(help="A running MLflow server instead of <data_dir>/mlflow/mlflow.db."),
    ] = None,
    api: Annotated[
        str | None,
        typer.Option(help="Read deployment events from a running API's /v1/deployments/history."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Read-scope key for --api (default: <data_dir>/local-keys.json).",
            envvar="FLYWHEEL_REPORT_API_KEY",
        ),
    ] = None,
    from_kafka: Annotated[
        bool,
        typer.Option(
            "--from-kafka", help="Read deployment events from the <ns>.deployments topic."
        ),
    ] = False,
    model: Annotated[
        str | None, typer.Option(help="Registered model (default FLYWHEEL_MODEL_NAME).")
    ] = None,
    markdown: Annotated[
        bool,
        typer.Option(
            "--markdown",
            help="Also print the per-version table (held-out, gate, canary, sessions served: "
            "turns per session, outcome shares) as Markdown.",
        ),
    ] = False,
) -> None:
    """One self-contained HTML page: held-out acceptance, training curves, gate, canary, promotions and rollbacks, sessions per version."""
    import os

    from app.report import (
        ReportSources,
        SourceMissing,
        build_report,
        load_report_data,
        write_report,
    )
    from app.settings import Settings

    s = _configured(Settings, data_dir=data_dir, model_name=model)
    os.environ.setdefault(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"
    )  # a server that went away: fail in seconds, not minutes
    try:
        src = ReportSources.resolve(
            s, mlflow_uri=mlflow_uri, api_url=api, api_key=api_key, from_kafka=from_kafka
        )
        data = load_report_data(src)
    except SourceMissing as exc:
        _say(f"report: {exc}", style="red")
        raise typer.Exit(2) from None
    path = write_report(build_report(data), out or s.data_dir / "report.html")
    sessions = "sessions not read" if data.sessions is None else f"{len(data.sessions)} sessions"
    console.print(
        f"report of {data.model}: {len(data.versions)} versions, {len(data.events)} deployment "
        f"events, {sessions}"
    )
    if markdown:
        from app.report.model import markdown_table, version_rows

        typer.echo(markdown_table(version_rows(data)))
    typer.echo(str(path))
