"""Fixtures of the deployment integration tests: pairs of migrated, empty databases.

`db_pair` is parametrized over SQLite and the real PostgreSQL: (incremental, rebuilt) URLs,
both at `alembic upgrade head`, so a test can project into one and rebuild into the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from app.db.migrate import upgrade
from tests.conftest import create_test_database, drop_test_database


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
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    name, second = create_test_database(admin, base)
    try:
        for url in (first, second):
            upgrade(url)
        yield first, second
    finally:
        from app.db.session import get_engine

        get_engine(second).dispose()
        get_engine(first).dispose()
        drop_test_database(admin, name)
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
