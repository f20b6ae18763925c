"""`flywheel config`: the configuration reference (app/config_reference.py)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console


def config(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the README's reference table.")
    ] = False,
) -> None:
    """Every FLYWHEEL_* setting with its default and meaning (the configuration reference)."""
    from app.config_reference import all_settings
    from app.config_reference import markdown as render

    if markdown:
        typer.echo(render())
        return
    from rich.table import Table

    table = Table("variable", "default", "what")
    for row in all_settings():
        table.add_row(row.env, "" if row.default is None else str(row.default), row.description)
    Console().print(table)
