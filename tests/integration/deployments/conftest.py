"""Fixtures of the deployment integration tests: pairs of migrated, empty databases.

`db_pair` is parametrized over SQLite and the real PostgreSQL: (incremental, rebuilt) URLs,
both at `alembic upgrade head`, so a test can project into one and rebuild into the other.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from app.db.migrate import upgrade


@pytest.fixture(params=["sqlite", "postgresql"])
def db_pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    if request.param == "sqlite":
        urls = (f"sqlite:///{tmp_path / 'incremental.db'}", f"sqlite:///{tmp_path / 'rebuilt.db'}")
        for url in urls:
            upgrade(url)
        yield urls
        return
    first = request.getfixturevalue("fresh_postgres_url")
    base = request.getfixturevalue("postgres_url")
    name = f"fw_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'create database "{name}"'))
    second = base.rsplit("/", 1)[0] + f"/{name}"
    try:
        for url in (first, second):
            upgrade(url)
        yield first, second
    finally:
        from app.db.session import get_engine

        get_engine(second).dispose()
        get_engine(first).dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'drop database if exists "{name}" with (force)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One migrated, empty database per test on each dialect."""
    url = (
        f"sqlite:///{tmp_path / 'flywheel.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("fresh_postgres_url")
    )
    upgrade(url)
    return url
