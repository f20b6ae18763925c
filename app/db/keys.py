"""API keys: creation, lookup by hash, scope checks.

A key looks like `fw_<8 hex prefix>_<43 chars urlsafe base64>`: 256 bits of randomness, so
a plain SHA-256 of the key is a safe thing to store (as GitHub and Stripe do for tokens).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import SCOPES, ApiKey


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, scopes: Iterable[str], name: str = "") -> tuple[str, ApiKey]:
    """Create and store a key; returns (the plaintext key, shown once; its row)."""
    scopes = sorted(set(scopes))
    bad = [s for s in scopes if s not in SCOPES]
    assert scopes and not bad, f"scopes must be a non-empty subset of {SCOPES}, got {scopes}"
    prefix = secrets.token_hex(4)
    key = f"fw_{prefix}_{secrets.token_urlsafe(32)}"
    row = ApiKey(name=name, prefix=prefix, key_hash=hash_key(key), scopes=",".join(scopes))
    session.add(row)
    session.flush()
    return key, row


def lookup_key(session: Session, key: str) -> ApiKey | None:
    """The active key row for a plaintext key, or None."""
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
    if row is None or row.revoked_at is not None:
        return None
    return row
