"""Typed FastAPI dependencies: settings, DB session, and bearer-key auth with scopes.

    @router.get("/v1/deployments")
    def status(key: Annotated[ApiKey, Depends(require_scope("read"))], session: SessionDep): ...

401 without a valid key, 403 with a key that lacks the scope (DESIGN.md, HTTP API).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from app.db.keys import lookup_key
from app.db.models import ApiKey
from app.db.session import get_sessionmaker
from app.settings import Settings


async def get_app_settings(request: Request) -> Settings:
    # async (and the auth below): FastAPI runs sync dependencies in a thread pool, a thread hop per
    # dependency per request that showed up in the ingest benchmark on a busy machine
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    session = get_sessionmaker(settings.db_url)()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]


def _lookup_key(db_url: str, token: str) -> ApiKey | None:
    with get_sessionmaker(db_url)() as session:
        return lookup_key(session, token)


async def authenticate(request: Request, settings: SettingsDep) -> ApiKey:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token: send 'Authorization: Bearer <key>'",
                            headers={"WWW-Authenticate": "Bearer"})
    cache = request.app.state.key_cache  # token -> ApiKey, short-lived (see app.api.main)
    row = cache.get(token.strip())
    if row is None:
        row = await run_in_threadpool(_lookup_key, settings.db_url, token.strip())  # cache miss only
        if row is None:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid or revoked API key",
                                headers={"WWW-Authenticate": "Bearer"})
        cache.put(token.strip(), row)
    return row


def require_scope(scope: str) -> Callable[..., ApiKey]:
    """Dependency factory: the caller's key must carry `scope`."""

    async def _check(request: Request, key: Annotated[ApiKey, Depends(authenticate)]) -> ApiKey:
        if scope not in key.scope_set:
            raise HTTPException(status.HTTP_403_FORBIDDEN,
                                f"this key has scopes {sorted(key.scope_set)}; this endpoint needs '{scope}'")
        limiter = getattr(request.app.state, "rate_limiter", None)
        if limiter is not None:
            limiter.check(key)  # raises 429 with Retry-After
        return key

    return _check
