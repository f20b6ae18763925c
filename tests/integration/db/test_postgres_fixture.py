"""The per-test PostgreSQL database (tests/conftest.py) ends only the sessions its test opened.

Several test sessions (and people) share one PostgreSQL server: dropping a test database must
not end anyone else's session on it. The test's own connections carry the database's name as
`application_name`; the drop ends those, and a session it did not open makes the drop fail
naming it (after a short patience here) instead of being killed.

    .venv/bin/pytest tests/integration/db/test_postgres_fixture.py -q
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.conftest import create_test_database, drop_test_database

pytestmark = pytest.mark.integration


def test_drop_ends_the_test_s_sessions_and_no_one_else_s(postgres_url):
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    name, url = create_test_database(admin, postgres_url)
    own = sa.create_engine(url).connect()  # a session the test opened (left open, as a leak)
    assert own.execute(sa.text("select current_setting('application_name')")).scalar() == name
    other_url = sa.make_url(url).set(query={"application_name": "someone-else"})
    other_engine = sa.create_engine(other_url)
    other = other_engine.connect()  # someone else's session on the same database
    try:
        with pytest.raises(RuntimeError, match="someone-else") as err:
            drop_test_database(admin, name, patience_s=2)
        assert f"'{name}'" not in str(err.value), "the test's own session was left running"
        assert other.execute(sa.text("select 1")).scalar() == 1, "the other session was ended"
        with pytest.raises(sa.exc.DBAPIError):  # the test's own session was ended
            own.execute(sa.text("select 1"))
    finally:
        other.close()
        other_engine.dispose()
    drop_test_database(admin, name)
    with admin.connect() as conn:
        left = conn.execute(
            sa.text("select count(*) from pg_database where datname = :db"), {"db": name}
        ).scalar()
    assert left == 0
    admin.dispose()


def test_fresh_postgres_url_names_its_connections(fresh_postgres_url):
    with sa.create_engine(fresh_postgres_url).connect() as conn:
        db, app = conn.execute(
            sa.text("select current_database(), current_setting('application_name')")
        ).one()
    assert app == db and db.startswith("fw_")
