"""API keys: creation, lookup by hash, listing, revocation, scope checks.

A key looks like `fw_<8 hex prefix>_<43 chars urlsafe base64>`: 256 bits of randomness, so
a plain SHA-256 of the key is a safe thing to store (as GitHub and Stripe do for tokens).
The prefix is stored in clear: `flywheel keys list` shows it and `flywheel keys revoke PREFIX`
takes it (or a leading part of it of at least `MIN_REVOKE_PREFIX` hex digits).

Revocation sets `revoked_at` once and never clears it; the API stops accepting the key within
`FLYWHEEL_KEY_CACHE_TTL` (app/api/main.py, KeyCache).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import SCOPES, ApiKey, utcnow

# the shape of every key create_key makes; anything else is refused before a database lookup
KEY_PATTERN = re.compile(r"fw_[0-9a-f]{8}_[A-Za-z0-9_-]{43}")
MIN_REVOKE_PREFIX = 4
_PREFIX_ARG = re.compile(r"(?:fw_)?([0-9a-fA-F]+)_?")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, scopes: Iterable[str], name: str = "") -> tuple[str, ApiKey]:
    """Create and store a key; returns (the plaintext key, shown once; its row)."""
    scopes = sorted(set(scopes))
    bad = [s for s in scopes if s not in SCOPES]
    assert scopes and not bad, f"scopes must be a non-empty subset of {SCOPES}, got {scopes}"
    prefix = secrets.token_hex(4)
    key = f"fw_{prefix}_{secrets.token_urlsafe(32)}"
    assert KEY_PATTERN.fullmatch(key), f"generated key does not match {KEY_PATTERN.pattern}"
    row = ApiKey(name=name, prefix=prefix, key_hash=hash_key(key), scopes=",".join(scopes))
    session.add(row)
    session.flush()
    return key, row


def find_key(session: Session, key: str) -> ApiKey | None:
    """The key row for a plaintext key, revoked or not, or None when no key has this hash."""
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))


def lookup_key(session: Session, key: str) -> ApiKey | None:
    """The active key row for a plaintext key, or None."""
    row = find_key(session, key)
    if row is None or row.revoked_at is not None:
        return None
    return row


def list_keys(session: Session) -> list[ApiKey]:
    """Every key, revoked ones included, oldest first."""
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))


class KeyNotFound(LookupError):
    """No key, or more than one key, matches a prefix; the message says which."""


@dataclass(frozen=True)
class Revocation:
    key: ApiKey
    already_revoked: bool  # True: the key was revoked before and its revoked_at is unchanged


def normalize_prefix(arg: str) -> str:
    """`fw_1a2b3c4d`, `1a2b3c4d`, `1A2B` -> lower-case hex; ValueError for anything else."""
    m = _PREFIX_ARG.fullmatch(arg.strip())
    if m is None or not MIN_REVOKE_PREFIX <= len(m.group(1)) <= 8:
        raise ValueError(
            f"{arg!r} is not a key prefix: give the {MIN_REVOKE_PREFIX} to 8 hex digits after 'fw_' "
            "that `flywheel keys list` shows (e.g. 1a2b3c4d or fw_1a2b3c4d)"
        )
    return m.group(1).lower()


def revoke_key(session: Session, prefix_arg: str) -> Revocation:
    """Revoke the one key whose prefix starts with `prefix_arg` (idempotent).

    ValueError for an argument that is not a prefix; KeyNotFound when no key or several keys
    match (nothing is changed then).
    """
    prefix = normalize_prefix(prefix_arg)
    rows = list(
        session.scalars(select(ApiKey).where(ApiKey.prefix.startswith(prefix)).order_by(ApiKey.id))
    )
    if not rows:
        raise KeyNotFound(
            f"no API key has a prefix starting with {prefix!r}; `flywheel keys list` shows them"
        )
    if len(rows) > 1:
        listed = ", ".join(f"{r.prefix} ({r.name or 'unnamed'})" for r in rows)
        raise KeyNotFound(f"prefix {prefix!r} matches {len(rows)} keys: {listed}; give more digits")
    row = rows[0]
    if row.revoked_at is not None:
        return Revocation(row, already_revoked=True)
    row.revoked_at = utcnow()
    session.flush()
    return Revocation(row, already_revoked=False)
