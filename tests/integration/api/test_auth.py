"""Authentication of the real API (uvicorn in a thread, real Kafka, SQLite or PostgreSQL):

- a key revoked with the real `flywheel keys revoke` (a subprocess) is refused by every request
  sent more than FLYWHEEL_KEY_CACHE_TTL after the command returned, under continuous traffic;
- malformed Authorization headers are 401 with a reason and cost no database statement;
- failed authentications are budgeted per client address: 429 + Retry-After past the budget,
  no database lookup for a new token from that address, a key that authenticated recently
  keeps working, and X-Forwarded-For counts only from FLYWHEEL_TRUSTED_PROXIES;
- the counters on /metrics move with each of these.

Database statements are counted with a SQLAlchemy event on the engine the API itself uses
(app.db.session.get_engine, shared in this process), not with a mock.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.api.conftest import Api, event

pytestmark = pytest.mark.integration

FLYWHEEL = Path(sys.executable).parent / "flywheel"


def _random_key() -> str:
    """A token of the right shape that no database holds."""
    return f"fw_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}"


def _metric(api: Api, name: str, **labels: str) -> float:
    text = httpx.get(f"{api.url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


@contextmanager
def _key_statements(db_url: str) -> Iterator[list[str]]:
    """Every SQL statement on api_keys that the API's engine runs inside the block."""
    from app.db.session import get_engine

    engine = get_engine(db_url)
    seen: list[str] = []

    def on_execute(conn, cursor, statement, parameters, context, executemany) -> None:
        if "api_keys" in statement:
            seen.append(statement)

    sa.event.listen(engine, "after_cursor_execute", on_execute)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "after_cursor_execute", on_execute)


def _revoke_with_cli(api: Api, key: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_DATA_DIR"] = str(api.settings.data_dir)
    if api.settings.database_url:
        env["FLYWHEEL_DATABASE_URL"] = api.settings.database_url
    proc = subprocess.run(
        [str(FLYWHEEL), "keys", "revoke", key.split("_")[1]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"flywheel keys revoke exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc


class Traffic:
    """One client thread posting single-event batches with `key` back to back, recording
    (monotonic time each request was sent, its status)."""

    def __init__(self, api: Api, key: str):
        self.api, self.key, self.sent = api, key, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {self.key}"}) as client:
            i = 1
            while not self._stop.is_set():
                t = time.monotonic()
                r = client.post(f"{self.api.url}/v1/events", json={"events": [event("accept", i)]})
                self.sent.append((t, r.status_code))
                i += 1

    def wait_for(self, cond, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond(self.sent):
            assert time.monotonic() < deadline and self._thread.is_alive(), (
                f"traffic: no {what} in {timeout_s}s"
            )
            time.sleep(0.05)

    def __enter__(self) -> Traffic:
        self._thread.start()
        self.wait_for(lambda sent: any(code == 202 for _, code in sent), "accepted request")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def check_revoked(self, started: float, revoked_by: float, ttl: float) -> None:
        """Accepted before `started`; only 401 for every request sent after `revoked_by + ttl`."""
        after = [code for t, code in self.sent if t > revoked_by + ttl]
        assert after and set(after) == {401}, (
            f"requests sent after revocation + {ttl}s got {sorted(set(after))}"
        )
        # before it the key authenticated (a 503 is Kafka being slow on a busy machine, after auth)
        before = [code for t, code in self.sent if t < started]
        assert 202 in before and set(before) <= {202, 503}, sorted(set(before))
        assert {code for _, code in self.sent} <= {202, 401, 503}, sorted(
            {code for _, code in self.sent}
        )


def _api_on(api_factory, request, dialect: str) -> Api:
    overrides = (
        {}
        if dialect == "sqlite"
        else {"database_url": request.getfixturevalue("fresh_postgres_url")}
    )
    api = api_factory(
        auth_failure_burst=1_000_000, **overrides
    )  # the revoked client's 401s, not its throttling
    assert api.settings.key_cache_ttl == 1.0, "these tests check the default bound"
    return api


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_key_revoked_with_the_cli_is_refused_within_key_cache_ttl_under_traffic(
    api_factory, request, dialect: str
) -> None:
    api = _api_on(api_factory, request, dialect)
    ttl = api.settings.key_cache_ttl
    with Traffic(api, api.ingest_key) as traffic:
        started = time.monotonic()
        _revoke_with_cli(api, api.ingest_key)
        revoked_by = time.monotonic()  # the revocation committed before the command returned
        traffic.wait_for(
            lambda sent: any(t > revoked_by + ttl + 1.0 for t, _ in sent), "request past the bound"
        )
    traffic.check_revoked(started, revoked_by, ttl)
    final = api.post_events({"events": [event("accept", 99)]})
    assert final.status_code == 401 and "invalid or revoked" in final.json()["detail"], final.text
    assert api.post_events({"events": [event("accept", 100)]}, key="read").status_code == 403, (
        "other keys still work"
    )


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_the_bound_holds_for_a_key_looked_up_just_before_its_revocation(
    api_factory, request, dialect: str
) -> None:
    """The worst case, made deterministic: revoke right after the API's own lookup read the key
    (seen by an event on its engine after the SELECT ran), so a cache entry that outlived `ttl` would serve 202s
    after the bound. (The CLI test above hits this case only when its timing happens to.)"""
    from app.db.keys import revoke_key
    from app.db.session import get_engine, session_scope

    api = _api_on(api_factory, request, dialect)
    ttl = api.settings.key_cache_ttl
    looked_up = threading.Event()

    def on_execute(conn, cursor, statement, parameters, context, executemany) -> None:
        if "api_keys" in statement:
            looked_up.set()

    engine = get_engine(api.settings.db_url)
    with Traffic(api, api.ingest_key) as traffic:
        time.sleep(
            ttl
        )  # the entry of the first lookup goes stale: traffic makes the API look the key up again
        looked_up.clear()
        sa.event.listen(engine, "after_cursor_execute", on_execute)
        try:
            assert looked_up.wait(60), "the API did not look the key up again under traffic"
        finally:
            sa.event.remove(engine, "after_cursor_execute", on_execute)
        started = time.monotonic()
        with session_scope(api.settings.db_url) as session:
            assert not revoke_key(session, api.ingest_key.split("_")[1]).already_revoked
        revoked_by = time.monotonic()
        traffic.wait_for(
            lambda sent: any(t > revoked_by + ttl + 1.0 for t, _ in sent), "request past the bound"
        )
    traffic.check_revoked(started, revoked_by, ttl)


def test_malformed_authorization_headers_are_401_without_a_database_lookup(api_factory) -> None:
    api = api_factory(auth_failure_burst=100)
    body = {"events": [event("accept", 0)]}
    valid = api.ingest_key
    cases: list[tuple[str, list[tuple[bytes, bytes]], str]] = [
        ("missing", [], "missing bearer token"),
        ("basic", [(b"Authorization", f"Basic {valid}".encode())], "Bearer scheme"),
        ("token", [(b"Authorization", f"Token {valid}".encode())], "Bearer scheme"),
        ("no space", [(b"Authorization", f"Bearer{valid}".encode())], "Bearer scheme"),
        ("empty", [(b"Authorization", b"Bearer")], "empty bearer token"),
        ("non-ascii", [(b"Authorization", b"Bearer fw_0000000\xe9_" + b"A" * 43)], "non-ASCII"),
        ("too long", [(b"Authorization", b"Bearer " + b"A" * 4000)], "longer than 256"),
        (
            "wrong shape",
            [(b"Authorization", b"Bearer fw_00000000_not-a-real-key")],
            "not the shape",
        ),
        ("key plus junk", [(b"Authorization", f"Bearer {valid}x".encode())], "not the shape"),
        (
            "two headers",
            [
                (b"Authorization", f"Bearer {valid}".encode()),
                (b"Authorization", f"Bearer {valid}".encode()),
            ],
            "2 Authorization headers",
        ),
    ]
    malformed_before = _metric(api, "flywheel_api_auth_failures_total", reason="malformed")
    lookups_before = _metric(api, "flywheel_api_key_lookups_total")
    with _key_statements(api.settings.db_url) as statements:
        for name, headers, fragment in cases:
            r = httpx.post(
                f"{api.url}/v1/events",
                json=body,
                headers=[(b"Content-Type", b"application/json"), *headers],
                timeout=30,
            )
            assert r.status_code == 401, (name, r.status_code, r.text)
            assert r.headers["www-authenticate"] == "Bearer", name
            assert fragment in r.json()["detail"], (name, r.json())
    assert statements == [], f"malformed headers reached the database: {statements}"
    assert _metric(api, "flywheel_api_key_lookups_total") == lookups_before
    assert (
        _metric(api, "flywheel_api_auth_failures_total", reason="malformed") - malformed_before == 6
    )
    ok = httpx.post(
        f"{api.url}/v1/events", json=body, headers={"Authorization": f"bearer {valid}"}, timeout=30
    )
    assert ok.status_code == 202, "the scheme is case-insensitive (RFC 9110)"


def test_failed_authentications_are_throttled_per_client_address(api_factory) -> None:
    """Decision under test: past its budget an address gets 429 for every failure and for any token
    that has not authenticated recently (no lookup), while a key that did keeps working."""
    api = api_factory(
        auth_failure_burst=5, auth_failure_rate_per_s=0.001
    )  # no refill within the test
    body = {"events": [event("accept", 0)]}
    assert api.post_events(body).status_code == 202  # the ingest key authenticates: it is known now
    unknown_before = _metric(api, "flywheel_api_auth_failures_total", reason="unknown")
    throttled_before = _metric(api, "flywheel_api_auth_throttled_total")
    with _key_statements(api.settings.db_url) as statements:
        codes = [api.post_events(body, key=_random_key()).status_code for _ in range(5)]
        assert codes == [401] * 5
        assert len(statements) == 5, "each unknown token is one lookup while the budget lasts"
        repeat = api.post_events(body, key=_random_key())
        assert repeat.status_code == 429, repeat.text
        assert 900 <= int(repeat.headers["retry-after"]) <= 1000, (
            repeat.headers
        )  # one token at 0.001/s
        assert "failed authentications" in repeat.json()["detail"]
        for _ in range(20):  # an attacker keeps guessing: no lookups any more
            assert api.post_events(body, key=_random_key()).status_code == 429
        assert api.post_events(body, key="fw_junk").status_code == 429, "malformed ones too"
        assert len(statements) == 5, (
            f"a throttled address still reached the database: {statements[5:]}"
        )
    assert _metric(api, "flywheel_api_auth_failures_total", reason="unknown") - unknown_before == 5
    assert _metric(api, "flywheel_api_auth_throttled_total") - throttled_before == 22

    # a key that authenticated recently keeps working from the throttled address, past its cache TTL too
    time.sleep(api.settings.key_cache_ttl)
    assert api.post_events({"events": [event("accept", 1)]}).status_code == 202
    # a forged X-Forwarded-For does not buy a new budget (not trusted by default)
    assert (
        api.post_events(
            body, key=_random_key(), headers={"X-Forwarded-For": "198.51.100.9"}
        ).status_code
        == 429
    )


def test_a_new_valid_key_from_a_throttled_address_waits_for_the_budget(api_factory) -> None:
    from app.db.keys import create_key
    from app.db.session import session_scope

    api = api_factory(
        auth_failure_burst=1, auth_failure_rate_per_s=0.1
    )  # one failure, then one per 10 s
    with session_scope(api.settings.db_url) as session:
        fresh, _ = create_key(session, ["ingest"], name="fresh")
    assert api.post_events({"events": [event("accept", 0)]}, key=_random_key()).status_code == 401
    with _key_statements(api.settings.db_url) as statements:
        throttled = api.post_events({"events": [event("accept", 1)]}, key=fresh)
    assert throttled.status_code == 429 and statements == [], (
        "not looked up: it never authenticated from here"
    )
    deadline = time.monotonic() + 60
    r = throttled
    while r.status_code == 429:
        assert time.monotonic() < deadline, "the failure budget never refilled"
        time.sleep(int(r.headers["retry-after"]))
        r = api.post_events({"events": [event("accept", 2)]}, key=fresh)
    assert r.status_code == 202, r.text


def test_forwarded_for_names_the_client_only_from_a_trusted_proxy(api_factory) -> None:
    api = api_factory(
        auth_failure_burst=2, auth_failure_rate_per_s=0.01, trusted_proxies="127.0.0.1"
    )
    body = {"events": [event("accept", 0)]}

    def fail(xff: str) -> int:
        return api.post_events(
            body, key=_random_key(), headers={"X-Forwarded-For": xff}
        ).status_code

    assert [fail("203.0.113.7"), fail("203.0.113.7"), fail("203.0.113.7")] == [401, 401, 429]
    assert fail("203.0.113.8") == 401, "another client behind the proxy has its own budget"
    assert fail("1.2.3.4, 203.0.113.7") == 429, (
        "the proxy appends the real address last; earlier entries are forgeable"
    )
    assert fail("2001:db8::1") == 401 and fail("2001:db8::2") == 401
    assert fail("2001:db8::3") == 429, "IPv6 addresses share one budget per /64"
    assert fail("2001:db8:0:1::1") == 401


def test_unknown_tokens_are_remembered_and_cost_one_lookup(api_factory) -> None:
    api = api_factory(auth_failure_burst=100)
    guess = _random_key()
    with _key_statements(api.settings.db_url) as statements:
        codes = [
            api.post_events({"events": [event("accept", i)]}, key=guess).status_code
            for i in range(10)
        ]
    assert codes == [401] * 10
    assert len(statements) == 1, f"one lookup for a repeated unknown token, got {len(statements)}"
