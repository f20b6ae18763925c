"""Typed FastAPI dependencies: settings, DB session, and bearer-key auth with scopes.

    @router.get("/v1/deployments")
    def status(key: Annotated[ApiKey, Depends(require_scope("read"))], session: SessionDep): ...

401 without a valid key, 403 with a key that lacks the scope (docs/DESIGN.md §HTTP APIs); 429 with
Retry-After for a client address that failed authentication more than its budget allows
(`auth_failure_burst`, refilled at `auth_failure_rate_per_s`). Keys are cached by
app.api.main.KeyCache: a revoked key is refused within `key_cache_ttl`. docs/API.md, "Limits".
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Iterator
from typing import Annotated, NoReturn

from fastapi import Depends, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from app.api.metrics import AUTH_FAILURES, AUTH_THROTTLED, KEY_LOOKUPS
from app.api.ratelimit import TokenBucketLimiter
from app.db.keys import KEY_PATTERN, find_key
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


# An Authorization header longer than this is refused unread (a key is 55 characters).
MAX_AUTHORIZATION_CHARS = 256
AUTH_REASONS = ("missing", "scheme", "malformed", "unknown", "revoked")


def bearer_token(request: Request) -> tuple[str | None, str, str]:
    """(token, "", "") for a well-formed `Authorization: Bearer fw_...` header, else (None, reason, message).

    Pure string checks, no database: one header, at most MAX_AUTHORIZATION_CHARS, ASCII, the
    Bearer scheme (any case), and a token of the shape every key has (app/db/keys.py KEY_PATTERN).
    """
    values = request.headers.getlist("authorization")
    if not values:
        return None, "missing", "missing bearer token: send 'Authorization: Bearer <key>'"
    if len(values) > 1:
        return None, "malformed", f"{len(values)} Authorization headers; send exactly one"
    header = values[0]
    if len(header) > MAX_AUTHORIZATION_CHARS:
        return (
            None,
            "malformed",
            f"Authorization header longer than {MAX_AUTHORIZATION_CHARS} characters",
        )
    if not header.isascii():
        return None, "malformed", "Authorization header contains non-ASCII characters"
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return (
            None,
            "scheme",
            "Authorization must use the Bearer scheme: 'Authorization: Bearer <key>'",
        )
    token = token.strip()
    if not token:
        return None, "malformed", "empty bearer token: send 'Authorization: Bearer <key>'"
    if not KEY_PATTERN.fullmatch(token):
        return (
            None,
            "malformed",
            "invalid bearer token: not the shape of a Flywheel API key (fw_<8 hex digits>_<43 characters>)",
        )
    return token, "", ""


def client_address(request: Request) -> str:
    """The address failed authentications are counted against.

    The TCP peer, or, for a peer in `trusted_proxies`, the client its X-Forwarded-For names
    (uvicorn resolves that before the app runs; see `app.httplimits.proxy_options`). IPv6 addresses count per
    /64, the block one subscriber usually holds.
    """
    host = request.client.host if request.client else ""
    if ":" in host:
        try:
            return str(ipaddress.IPv6Network(f"{host}/64", strict=False))
        except ValueError:
            pass
    return host[:64]


def _find_key(db_url: str, token: str) -> ApiKey | None:
    KEY_LOOKUPS.inc()
    with get_sessionmaker(db_url)() as session:
        return find_key(session, token)


def _refuse(request: Request, client: str, reason: str, message: str) -> NoReturn:
    """401 for a failed authentication, charged to the client's budget; 429 once it is spent."""
    AUTH_FAILURES.labels(reason).inc()
    throttle = request.app.state.auth_throttle
    wait_s = throttle.try_take(client)
    if wait_s > 0:
        _throttled(throttle, wait_s)
    raise HTTPException(
        status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"}
    )


def _throttled(throttle: TokenBucketLimiter, wait_s: float) -> NoReturn:
    AUTH_THROTTLED.inc()
    raise HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        f"too many failed authentications from this address (burst {throttle.burst:g}, then "
        f"{throttle.rate_per_s:g}/s); retry after {wait_s:.1f}s",
        headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
    )


async def authenticate(request: Request, settings: SettingsDep) -> ApiKey:
    """The caller's active key, or 401 (429 for a client address over its failure budget).

    Hot path: a well-formed token whose key is in the key cache returns with no other work.
    Otherwise, in order: a malformed header fails without a lookup; a token refused recently
    fails from the cache; a client address over its budget gets 429 without a lookup unless
    the token authenticated within `auth_known_key_window` (so a valid key keeps working
    from an address that also sends bad ones); else one shared database lookup.
    """
    cache = request.app.state.key_cache  # app.api.main.KeyCache
    token, reason, message = bearer_token(request)
    if token is not None:
        row = cache.get(token)
        if row is not None:
            return row
    client = client_address(request)
    if token is None:
        _refuse(request, client, reason, message)
    reason = cache.refusal(token)
    if reason is None:
        throttle = request.app.state.auth_throttle
        wait_s = throttle.wait_s(client)
        if wait_s > 0 and not cache.known(token):
            _throttled(throttle, wait_s)
        row, reason = await cache.resolve(
            token, lambda t: run_in_threadpool(_find_key, settings.db_url, t)
        )
        if row is not None:
            return row
    _refuse(request, client, reason, "invalid or revoked API key")


def require_scope(scope: str) -> Callable[..., ApiKey]:
    """Dependency factory: the caller's key must carry `scope`."""

    async def _check(request: Request, key: Annotated[ApiKey, Depends(authenticate)]) -> ApiKey:
        if scope not in key.scope_set:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"this key has scopes {sorted(key.scope_set)}; this endpoint needs '{scope}'",
            )
        limiter = getattr(request.app.state, "rate_limiter", None)
        if limiter is not None:
            limiter.check(key)  # raises 429 with Retry-After
        return key

    return _check
