"""API keys: stored hashed with scopes; `flywheel keys create|list|revoke` and `flywheel db upgrade`
through the real CLI (subprocess, temp FLYWHEEL_DATA_DIR) on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from app.db.keys import KeyNotFound, create_key, lookup_key, revoke_key
from app.db.migrate import current_revision, head_revision, upgrade

pytestmark = pytest.mark.integration

FLYWHEEL = Path(sys.executable).parent / "flywheel"


def _cli(
    args: list[str], data_dir: Path, db_url: str, expect_rc: int = 0
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_DATA_DIR"] = str(data_dir)
    if not db_url.startswith("sqlite"):
        env["FLYWHEEL_DATABASE_URL"] = db_url
    proc = subprocess.run(
        [str(FLYWHEEL), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == expect_rc, (
        f"flywheel {' '.join(args)} exited {proc.returncode}, expected {expect_rc}:\n"
        f"{proc.stdout}\n{proc.stderr}"
    )
    return proc


def _cli_db_url(db_url: str, data_dir: Path) -> str:
    """Where the CLI writes: FLYWHEEL_DATABASE_URL, or the default SQLite file in the data dir."""
    return (
        db_url
        if not db_url.startswith("sqlite")
        else f"sqlite:///{(data_dir / 'flywheel.db').resolve()}"
    )


def test_keys_are_stored_hashed_with_their_scopes(db_url: str) -> None:
    upgrade(db_url)
    engine = sa.create_engine(db_url)
    try:
        with Session(engine) as s:
            key, row = create_key(s, ["read", "ingest", "read"], name="editor")
            s.commit()
        secret = key.split("_", 2)[
            2
        ]  # fw_<prefix>_<secret>; the urlsafe secret may itself contain "_"
        with engine.connect() as conn:
            rows = conn.execute(sa.text("select * from api_keys")).mappings().all()
        assert len(rows) == 1
        stored = " ".join(str(v) for v in rows[0].values())
        assert key not in stored and secret not in stored, (
            f"plaintext key material stored: {rows[0]}"
        )
        assert rows[0]["key_hash"] == hashlib.sha256(key.encode()).hexdigest()
        assert rows[0]["scopes"] == "ingest,read"
        with Session(engine) as s:
            found = lookup_key(s, key)
            assert found is not None and found.scope_set == {"ingest", "read"}
            assert lookup_key(s, key + "x") is None
            assert lookup_key(s, key.replace(secret, "A" * len(secret))) is None
            found.revoked_at = datetime.now(UTC)
            s.commit()
            assert lookup_key(s, key) is None, "a revoked key must not authenticate"
    finally:
        engine.dispose()


def test_create_key_refuses_unknown_or_empty_scopes(db_url: str) -> None:
    upgrade(db_url)
    engine = sa.create_engine(db_url)
    try:
        with Session(engine) as s:
            with pytest.raises(AssertionError, match="scopes"):
                create_key(s, ["superuser"])
            with pytest.raises(AssertionError, match="scopes"):
                create_key(s, [])
    finally:
        engine.dispose()


def test_cli_keys_create_prints_the_key_alone_on_the_last_line(db_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    proc = _cli(["keys", "create", "--scope", "ingest", "--name", "ci"], data_dir, db_url)
    lines = proc.stdout.rstrip("\n").split("\n")
    key = lines[-1]
    assert key.startswith("fw_") and key == key.strip() and " " not in key, (
        f"last stdout line is not a key: {proc.stdout!r}"
    )
    url = _cli_db_url(db_url, data_dir)
    engine = sa.create_engine(url)
    try:
        with Session(engine) as s:
            row = lookup_key(s, key)
            assert row is not None, f"lookup_key did not find the CLI's key in {url}"
            assert row.scope_set == {"ingest"} and row.name == "ci"
        with engine.connect() as conn:
            stored = conn.execute(
                sa.text("select key_hash, prefix, scopes, name from api_keys")
            ).all()
        assert all(key not in " ".join(map(str, r)) for r in stored)
    finally:
        engine.dispose()


def test_cli_keys_create_with_several_scopes(db_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    key = (
        _cli(["keys", "create", "--scope", "read", "--scope", "admin"], data_dir, db_url)
        .stdout.strip()
        .split("\n")[-1]
    )
    engine = sa.create_engine(_cli_db_url(db_url, data_dir))
    try:
        with Session(engine) as s:
            assert lookup_key(s, key).scope_set == {"read", "admin"}
    finally:
        engine.dispose()


def test_cli_db_upgrade_migrates_to_head(db_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    proc = _cli(["db", "upgrade"], data_dir, db_url)
    url = _cli_db_url(db_url, data_dir)
    assert current_revision(url) == head_revision(), proc.stderr
    engine = sa.create_engine(url)
    try:
        assert {
            "api_keys",
            "deployment_events",
            "model_versions",
            "replicas",
            "deployment_state",
        } <= set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    _cli(["db", "upgrade"], data_dir, db_url)  # idempotent
    assert current_revision(url) == head_revision()


def _listed(data_dir: Path, db_url: str) -> dict[str, dict]:
    proc = _cli(["keys", "list", "--json"], data_dir, db_url)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {r["prefix"]: r for r in rows}


def test_cli_keys_list_shows_every_key_without_its_secret(db_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    assert _listed(data_dir, db_url) == {}, "a fresh database lists no keys"
    a = _cli(
        ["keys", "create", "--scope", "ingest", "--name", "editor"], data_dir, db_url
    ).stdout.split()[-1]
    b = _cli(
        ["keys", "create", "--scope", "read", "--scope", "admin", "--name", "ops"], data_dir, db_url
    ).stdout.split()[-1]
    listed = _listed(data_dir, db_url)
    pa, pb = a.split("_")[1], b.split("_")[1]
    assert set(listed) == {pa, pb}
    assert (
        listed[pa]["name"] == "editor"
        and listed[pa]["scopes"] == ["ingest"]
        and listed[pa]["revoked_at"] is None
    )
    assert listed[pb]["scopes"] == ["admin", "read"]
    assert datetime.fromisoformat(listed[pa]["created_at"]).tzinfo is not None, (
        "times are shown with their zone"
    )
    table = _cli(["keys", "list"], data_dir, db_url)
    for key, prefix in ((a, pa), (b, pb)):
        assert f"fw_{prefix}" in table.stdout, table.stdout
        assert key.split("_", 2)[2] not in table.stdout + table.stderr, (
            "the secret part is never shown"
        )
    assert "editor" in table.stdout and "ops" in table.stdout


def test_cli_keys_revoke_sets_revoked_at_once_and_is_idempotent(
    db_url: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    key = _cli(
        ["keys", "create", "--scope", "ingest", "--name", "leaked"], data_dir, db_url
    ).stdout.split()[-1]
    other = _cli(
        ["keys", "create", "--scope", "ingest", "--name", "kept"], data_dir, db_url
    ).stdout.split()[-1]
    prefix = key.split("_")[1]
    proc = _cli(["keys", "revoke", f"fw_{prefix}"], data_dir, db_url)
    assert "revoked" in proc.stderr and prefix in proc.stderr, proc.stderr
    listed = _listed(data_dir, db_url)
    first = listed[prefix]["revoked_at"]
    assert first is not None and listed[other.split("_")[1]]["revoked_at"] is None, listed
    engine = sa.create_engine(_cli_db_url(db_url, data_dir))
    try:
        with Session(engine) as s:
            assert lookup_key(s, key) is None, "a revoked key does not authenticate"
            assert lookup_key(s, other) is not None
    finally:
        engine.dispose()
    proc = _cli(
        ["keys", "revoke", prefix.upper()[:6]], data_dir, db_url
    )  # again, by a shorter upper-case prefix
    assert "already revoked" in proc.stderr, proc.stderr
    assert _listed(data_dir, db_url)[prefix]["revoked_at"] == first, (
        "revoking again keeps the first revoked_at"
    )


def test_cli_keys_revoke_refuses_unknown_ambiguous_and_malformed_prefixes(
    db_url: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    _cli(["db", "upgrade"], data_dir, db_url)
    url = _cli_db_url(db_url, data_dir)
    engine = sa.create_engine(url)
    try:
        with Session(
            engine
        ) as s:  # two keys whose prefixes share 6 digits (forced: random ones rarely do)
            for prefix, name in (("abcdef01", "one"), ("abcdef02", "two")):
                _, row = create_key(s, ["ingest"], name=name)
                row.prefix = prefix
            s.commit()
    finally:
        engine.dispose()
    proc = _cli(["keys", "revoke", "abcdef"], data_dir, db_url, expect_rc=1)
    assert (
        "matches 2 keys" in proc.stderr and "abcdef01" in proc.stderr and "abcdef02" in proc.stderr
    ), proc.stderr
    proc = _cli(["keys", "revoke", "fw_12345678"], data_dir, db_url, expect_rc=1)
    assert "no API key" in proc.stderr, proc.stderr
    for bad in ("abc", "xyz12345", "fw_abcdef01_" + "A" * 43, "abcdef012"):
        proc = _cli(["keys", "revoke", bad], data_dir, db_url, expect_rc=2)
        assert "is not a key prefix" in proc.stderr, (bad, proc.stderr)
    assert all(r["revoked_at"] is None for r in _listed(data_dir, db_url).values()), (
        "nothing was revoked"
    )
    _cli(["keys", "revoke", "abcdef02"], data_dir, db_url)
    listed = _listed(data_dir, db_url)
    assert listed["abcdef02"]["revoked_at"] is not None and listed["abcdef01"]["revoked_at"] is None


def test_revoke_key_in_code_raises_for_no_match(db_url: str) -> None:
    upgrade(db_url)
    engine = sa.create_engine(db_url)
    try:
        with Session(engine) as s:
            with pytest.raises(KeyNotFound, match="no API key"):
                revoke_key(s, "0000")
            with pytest.raises(ValueError, match="not a key prefix"):
                revoke_key(s, "")
    finally:
        engine.dispose()
