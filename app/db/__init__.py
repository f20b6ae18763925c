"""The app database (SQLite by default, PostgreSQL beside it): SQLAlchemy 2.0 models, engine and
session helpers, API keys, and the Alembic migrations driven from code.

- `models.py`, `session.py`, `keys.py`, `migrate.py` (the migrations themselves are in migrations/).

May import: nothing
Tests: tests/integration/db/
Docs: docs/API.md
"""
