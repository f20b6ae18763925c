"""What every command group shares: the stderr console, logging, and settings read from the
environment (a bad FLYWHEEL_* value exits 2 naming the variable).

Cheap imports only at the top (typer, rich): `flywheel --help` imports this module."""

from __future__ import annotations

import logging

import typer
from rich.console import Console

console = Console(stderr=True)


def _setup_logging(verbose: bool = False) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )
    for noisy in ("kafka", "aiokafka", "urllib3", "httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _invalid(exc: Exception) -> typer.Exit:
    """Print a settings ValidationError (its locations are the FLYWHEEL_* variables,
    app/settings_base.py) and the exit to raise: status 2."""
    console.print("[red]invalid configuration:[/red]")
    _say(str(exc))
    return typer.Exit(2)


def _say(text: str, **style) -> None:
    """Print `text` as it is (no rich markup or highlighting: it may hold paths and brackets)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True, **style)


def _refused(text: str) -> typer.Exit:
    """Say why a command refused its input; the exit to raise: status 2."""
    _say(text)
    return typer.Exit(2)


def _settings():
    """The process-wide `Settings` from the environment."""
    from pydantic import ValidationError

    from app.settings import get_settings

    try:
        return get_settings()
    except ValidationError as exc:
        raise _invalid(exc) from None


def _configured(cls, **flags):
    """A role's settings class read from the environment, each CLI flag that was given
    overriding the field of the same name: the one way a flag reaches a setting (a flag wins
    over its FLYWHEEL_* variable). A bad value, from a flag or the environment, exits 2 naming
    the variable."""
    from pydantic import ValidationError

    try:
        return cls(**{name: value for name, value in flags.items() if value is not None})
    except ValidationError as exc:
        raise _invalid(exc) from None
