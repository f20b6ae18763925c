"""Fixtures of the deployment unit tests: a migrated SQLite database in tmp (no broker)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from app.db.migrate import upgrade


@pytest.fixture()
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'flywheel.db'}"
    upgrade(url)
    return url


@pytest.fixture()
def session(sqlite_url: str) -> Iterator[Session]:
    engine = sa.create_engine(sqlite_url)
    with Session(engine) as s:
        yield s
    engine.dispose()
