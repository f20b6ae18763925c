"""Fixtures of the data-layer tests: one empty database per test on each dialect.

`db_url` is parametrized over SQLite (a file in tmp) and the real PostgreSQL server
(`fresh_postgres_url` from tests/conftest.py), so every test here runs on both.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'flywheel.db'}"
    return request.getfixturevalue("fresh_postgres_url")
