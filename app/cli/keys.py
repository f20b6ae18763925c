"""`flywheel keys`: API keys, stored hashed with their scopes (app/db/keys.py)."""

from __future__ import annotations

import enum
from datetime import UTC
from typing import Annotated

import typer
from rich.console import Console

from app.cli.common import _settings, console

keys_app = typer.Typer(no_args_is_help=True, help="API keys (stored hashed, with scopes).")


class Scope(str, enum.Enum):
    ingest = "ingest"
    read = "read"
    admin = "admin"


@keys_app.command("create")
def keys_create(
    scope: Annotated[
        list[Scope],
        typer.Option("--scope", "-s", help="ingest, read or admin; repeat for several."),
    ],
    name: Annotated[str, typer.Option(help="A label for the key (who or what uses it).")] = "",
) -> None:
    """Create an API key. The key is printed alone on the last line of stdout (shown only once)."""
    from app.db.keys import create_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, "head")
    with session_scope(s.db_url) as session:
        key, row = create_key(session, [sc.value for sc in scope], name=name)
        console.print(
            f"created key {row.prefix} with scopes {row.scopes} (store it now; it is not shown again)"
        )
    typer.echo(key)


def _utc_iso(dt) -> str:
    """ISO 8601 in UTC; SQLite hands back naive datetimes that were stored as UTC."""

    return (
        (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).astimezone(UTC).isoformat(timespec="seconds")
    )


@keys_app.command("list")
def keys_list(
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per key on stdout instead of a table.")
    ] = False,
) -> None:
    """Every API key: prefix, name, scopes, created and revoked times (never the key itself)."""
    import json

    from rich.table import Table

    from app.db.keys import list_keys
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, "head")
    with session_scope(s.db_url) as session:
        rows = [
            {
                "prefix": r.prefix,
                "name": r.name,
                "scopes": sorted(r.scope_set),
                "created_at": _utc_iso(r.created_at),
                "revoked_at": _utc_iso(r.revoked_at) if r.revoked_at else None,
            }
            for r in list_keys(session)
        ]
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    table = Table("prefix", "name", "scopes", "created", "revoked")
    for row in rows:
        table.add_row(
            f"fw_{row['prefix']}",
            row["name"],
            ",".join(row["scopes"]),
            row["created_at"],
            row["revoked_at"] or "",
        )
    Console(width=200).print(table)
    console.print(
        f"{len(rows)} key{'' if len(rows) == 1 else 's'}, {sum(r['revoked_at'] is None for r in rows)} active"
    )


@keys_app.command("revoke")
def keys_revoke(
    prefix: Annotated[
        str,
        typer.Argument(
            help="The key's prefix as `flywheel keys list` shows it (fw_1a2b3c4d), "
            "or its first 4+ hex digits."
        ),
    ],
) -> None:
    """Revoke one API key by prefix (idempotent). Exit 1 when no key or several keys match."""
    from app.db.keys import KeyNotFound, revoke_key
    from app.db.migrate import upgrade
    from app.db.session import session_scope

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(s.db_url, "head")
    try:
        with session_scope(s.db_url) as session:
            done = revoke_key(session, prefix)
            key = done.key
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    except KeyNotFound as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    when = _utc_iso(key.revoked_at)
    if done.already_revoked:
        console.print(
            f"key fw_{key.prefix} ({key.name or 'unnamed'}) was already revoked at {when}"
        )
    else:
        console.print(
            f"revoked key fw_{key.prefix} ({key.name or 'unnamed'}) at {when}; the API refuses it within "
            f"FLYWHEEL_KEY_CACHE_TTL ({s.key_cache_ttl:g}s)"
        )
