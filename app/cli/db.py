"""`flywheel db`: the app database's Alembic migrations (app/db/migrate.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from app.cli.common import _settings, console

db_app = typer.Typer(no_args_is_help=True, help="The app database (SQLAlchemy + Alembic).")


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Apply the Alembic migrations to FLYWHEEL_DATABASE_URL (default: SQLite in the data dir)."""
    from app.db.migrate import upgrade

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, revision)
    console.print(f"database at {s.db_url} upgraded to {revision}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision, e.g. base or -1.")],
) -> None:
    """Revert the Alembic migrations down to REVISION."""
    from app.db.migrate import downgrade

    s = _settings()
    downgrade(s.db_url, revision)
    console.print(f"database at {s.db_url} downgraded to {revision}")
