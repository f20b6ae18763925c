"""Alembic migrations on SQLite and on the real PostgreSQL: upgrade, downgrade, re-upgrade,
and agreement between the SQLAlchemy models and the migrated schema.

    .venv/bin/pytest tests/integration/db -q
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from app.db.migrate import current_revision, downgrade, head_revision, upgrade
from app.db.models import Base

pytestmark = pytest.mark.integration


def _triggers(engine: sa.Engine) -> set[str]:
    """Names of the triggers on deployment_events."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            q = "select name from sqlite_master where type = 'trigger' and tbl_name = 'deployment_events'"
        else:
            q = (
                "select tgname from pg_trigger where not tgisinternal "
                "and tgrelid = 'deployment_events'::regclass"
            )
        return {row[0] for row in conn.execute(sa.text(q))}


def _schema(engine: sa.Engine) -> dict[str, dict[str, set]]:
    insp = sa.inspect(engine)
    return {
        t: {
            "columns": {c["name"] for c in insp.get_columns(t)},
            "indexes": {i["name"] for i in insp.get_indexes(t)},
            "uniques": {tuple(u["column_names"]) for u in insp.get_unique_constraints(t)},
        }
        for t in insp.get_table_names()
    }


def test_upgrade_head_creates_every_table_index_and_constraint(db_url: str) -> None:
    upgrade(db_url)
    engine = sa.create_engine(db_url)
    try:
        schema = _schema(engine)
        expected_tables = set(Base.metadata.tables) | {"alembic_version"}
        assert set(schema) == expected_tables, (
            f"tables {sorted(schema)} != {sorted(expected_tables)}"
        )
        for name, table in Base.metadata.tables.items():
            cols = {c.name for c in table.columns}
            assert schema[name]["columns"] == cols, (
                f"{name}: columns {schema[name]['columns']} != {cols}"
            )
            idx = {i.name for i in table.indexes}
            assert idx <= schema[name]["indexes"], (
                f"{name}: missing indexes {idx - schema[name]['indexes']}"
            )
            uniques = {
                tuple(c.name for c in u.columns)
                for u in table.constraints
                if isinstance(u, sa.UniqueConstraint)
            }
            uniques |= {(c.name,) for c in table.columns if c.unique}
            found = schema[name]["uniques"] | {
                tuple(sa.inspect(engine).get_pk_constraint(name)["constrained_columns"])
            }
            if (
                engine.dialect.name == "sqlite"
            ):  # SQLite reports unique indexes, not always constraints
                found |= {
                    tuple(i["column_names"])
                    for i in sa.inspect(engine).get_indexes(name)
                    if i["unique"]
                }
            assert uniques <= found, f"{name}: missing unique constraints {uniques - found}"
        assert "ix_deployment_events_model_ts" in schema["deployment_events"]["indexes"]
        assert "ix_replicas_model" in schema["replicas"]["indexes"]
        assert _triggers(engine), "the append-only guard triggers are missing after upgrade head"
        assert current_revision(db_url) == head_revision()
    finally:
        engine.dispose()


def test_downgrade_base_removes_everything_and_upgrade_again_works(db_url: str) -> None:
    upgrade(db_url)
    downgrade(db_url, "base")
    engine = sa.create_engine(db_url)
    try:
        left = set(sa.inspect(engine).get_table_names())
        assert left <= {"alembic_version"}, f"downgrade base left tables behind: {sorted(left)}"
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                fn = conn.execute(
                    sa.text(
                        "select count(*) from pg_proc where proname = 'flywheel_deployment_events_append_only'"
                    )
                ).scalar()
            assert fn == 0, "downgrade left the append-only trigger function behind"
        assert current_revision(db_url) is None

        upgrade(db_url)
        tables = set(sa.inspect(engine).get_table_names())
        assert tables == set(Base.metadata.tables) | {"alembic_version"}, (
            f"re-upgrade gave {sorted(tables)}"
        )
        assert _triggers(engine), "re-upgrade did not re-create the append-only triggers"
        assert current_revision(db_url) == head_revision()
    finally:
        engine.dispose()


def test_step_by_step_downgrade_and_upgrade_match_head(db_url: str) -> None:
    upgrade(db_url, "0001")
    engine = sa.create_engine(db_url)
    try:
        assert "deployment_state" not in sa.inspect(engine).get_table_names()
        upgrade(db_url, "head")
        downgrade(db_url, "0001")
        insp = sa.inspect(engine)
        assert "deployment_state" not in insp.get_table_names()
        assert "model" not in {c["name"] for c in insp.get_columns("replicas")}
        assert not _triggers(engine), "downgrade to 0001 left the append-only triggers behind"
        upgrade(db_url, "head")
        assert current_revision(db_url) == head_revision()
    finally:
        engine.dispose()


def test_models_and_migrations_agree(db_url: str) -> None:
    upgrade(db_url)
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": False}
            )
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], (
            f"models and migrations disagree on {engine.dialect.name}; write a migration for: {diff}"
        )
    finally:
        engine.dispose()


def test_0003_adds_the_sessions_tables_and_a_downgrade_to_0002_keeps_the_rest(db_url: str) -> None:
    upgrade(db_url, "0002")
    engine = sa.create_engine(db_url)
    try:
        assert "session_segments" not in sa.inspect(engine).get_table_names()
        upgrade(db_url, "0003")
        insp = sa.inspect(engine)
        assert {"session_segments", "session_turns"} <= set(insp.get_table_names())
        fks = insp.get_foreign_keys("session_turns")
        assert [(f["referred_table"], f["constrained_columns"]) for f in fks] == [
            ("session_segments", ["record_key"])
        ], fks
        with engine.begin() as conn:  # a turn without its segment is refused on both dialects
            if engine.dialect.name == "sqlite":
                conn.execute(sa.text("PRAGMA foreign_keys=ON"))
            with pytest.raises(sa.exc.IntegrityError):
                conn.execute(
                    sa.text(
                        "insert into session_turns (record_key, position, session_id, request_id, "
                        "model_version, sampled_tokens) values ('nope', 0, 's', 'r', '1', 3)"
                    )
                )
        downgrade(db_url, "0002")
        insp = sa.inspect(engine)
        tables = set(insp.get_table_names())
        assert not {"session_segments", "session_turns"} & tables, tables
        assert {"deployment_state", "deployment_events"} <= tables
        assert _triggers(engine), "downgrade to 0002 must leave the append-only guard in place"
        assert current_revision(db_url) == "0002"
    finally:
        engine.dispose()


def test_0004_adds_session_segments_protected_writes_and_its_downgrade_keeps_the_rows(
    db_url: str,
) -> None:
    upgrade(db_url, "0003")
    engine = sa.create_engine(db_url)
    segment_row = (
        "insert into session_segments (record_key, session_id, request_id, reward_spec, "
        "model_version, turn_count, prompt_tokens, completion_tokens, sampled_tokens, reward, "
        "generated_at, labelled_at, kafka_partition, kafka_offset) values ("
        "'{key}', 's', '{key}', 'v1', '1', 1, 3, 3, 3, 0.5, "
        "'2026-11-27 10:00:00+00', '2026-11-27 10:15:00+00', 0, {offset})"
    )

    def columns() -> set[str]:
        return {c["name"] for c in sa.inspect(engine).get_columns("session_segments")}

    try:
        assert "protected_writes" not in columns()
        with engine.begin() as conn:  # a row projected before 0004
            conn.execute(sa.text(segment_row.format(key="old", offset=0)))
        upgrade(db_url, "0004")
        assert "protected_writes" in columns()
        with engine.begin() as conn:
            conn.execute(sa.text(segment_row.format(key="new", offset=1)))
            conn.execute(
                sa.text("update session_segments set protected_writes = 2 where record_key = 'new'")
            )
            conn.execute(
                sa.text(
                    "insert into session_turns (record_key, position, session_id, request_id, "
                    "model_version, sampled_tokens) values ('new', 0, 's', 'new', '1', 3)"
                )
            )
            got = dict(
                conn.execute(sa.text("select record_key, protected_writes from session_segments"))
                .tuples()
                .all()
            )
        assert got == {"old": None, "new": 2}, "an older row has no count: NULL, not 0"

        downgrade(db_url, "0003")
        insp = sa.inspect(engine)
        assert "protected_writes" not in columns()
        assert "ix_session_segments_session" in {
            i["name"] for i in insp.get_indexes("session_segments")
        }
        assert [
            (f["referred_table"], f["constrained_columns"])
            for f in insp.get_foreign_keys("session_turns")
        ] == [("session_segments", ["record_key"])]
        with engine.connect() as conn:
            keys = conn.execute(sa.text("select record_key from session_segments")).scalars().all()
            turns = conn.execute(sa.text("select count(*) from session_turns")).scalar()
        assert (sorted(keys), turns) == (["new", "old"], 1), "the downgrade keeps every row"
        assert _triggers(engine), "downgrade to 0003 must leave the append-only guard in place"
        assert current_revision(db_url) == "0003"
    finally:
        engine.dispose()
