"""A hostile corpus for the API's admin, status and webhook routes, on the real app over real HTTP.

Every input here once was, or could be, a 500, an unbounded read or a poisoned state. Each must
get a 4xx whose body says what is wrong (the field where there is one), and the server must
keep answering. Status routes run on SQLite and on the real PostgreSQL (a NUL byte or a
cursor beyond BIGINT fail differently in each).
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from app.registry.webhooks import sign
from tests.integration.hostile.apiserver import (
    connect,
    head,
    read_until_closed,
    start_api,
    status_of,
)

pytestmark = pytest.mark.integration

SECRET = "corpus-secret"
DEEP = 100_000


@pytest.fixture()
def api(make_settings, monkeypatch):
    # the webhook receiver's MLflow is a closed port: reconciliation fails fast, as when MLflow is down
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    from tests.conftest import free_port

    api = start_api(
        make_settings,
        webhook_secret=SECRET,
        model_name="corpus-model",
        mlflow_uri=f"http://127.0.0.1:{free_port()}",
    )
    yield api
    api.server.stop()


def assert_4xx_naming(r: httpx.Response, status: int, field: str | None, words: str) -> None:
    assert r.status_code == status, f"{r.status_code}: {r.text[:500]}"
    detail = r.json()["detail"]
    text = json.dumps(detail)
    assert words.lower() in text.lower(), text
    if field is not None:
        assert isinstance(detail, list), detail
        assert any(e["loc"][-1] == field for e in detail), f"no error at field {field!r}: {detail}"


# --- admin verbs ---------------------------------------------------------------------------------
ADMIN_CORPUS = [  # (name, raw body, field named (None: the body as a whole), words in the message)
    ("nan", b'{"reason": NaN}', "reason", "NaN and Infinity are not JSON"),
    ("infinity", b'{"reason": "x", "version": Infinity}', "version", "NaN and Infinity"),
    ("minus-infinity", b'{"reason": -Infinity}', "reason", "NaN and Infinity"),
    ("huge-number", b'{"reason": 1e400}', "reason", "not a finite double"),
    ("lone-surrogate", b'{"reason": "bad \\ud800 outputs"}', "reason", "lone UTF-16 surrogate"),
    ("lone-low-surrogate", b'{"version": "\\udc00"}', "version", "lone UTF-16 surrogate"),
    ("surrogate-key", b'{"\\ud800": 1}', None, "key contains a lone UTF-16 surrogate"),
    ("not-utf8", b'{"reason": "\xff\xfe"}', None, "not UTF-8"),
    ("not-json", b"reason=bad", None, "not valid JSON"),
    ("truncated", b'{"reason": "x"', None, "not valid JSON"),
    ("array", b'["promote"]', None, "valid dictionary"),
    ("string", b'"pause"', None, "valid dictionary"),
    ("deep-array", b"[" * DEEP + b"]" * DEEP, None, "nested deeper"),
    ("deep-object", b'{"a":' * 2000 + b"1" + b"}" * 2000, None, "nested deeper"),
    ("nested-in-field", b'{"reason": [[[[[[[[[["x"]]]]]]]]]]}', None, "nested deeper"),
    ("wrong-type", b'{"skip_remaining": "yes please"}', "skip_remaining", "valid boolean"),
    ("reason-object", b'{"reason": {"why": 1}}', "reason", "valid string"),
    ("unknown-field", b'{"skip_remaining_steps": true}', "skip_remaining_steps", "Extra inputs"),
    ("too-long", json.dumps({"reason": "x" * 5000}).encode(), "reason", "at most 4096"),
    ("version-too-long", json.dumps({"version": "9" * 100}).encode(), "version", "at most 32"),
    (
        "nul-in-reason",
        b'{"reason": "a\\u0000b"}',
        "reason",
        "control character U+0000 at position 1",
    ),
    ("escape-in-model", b'{"model": "m\\u001b[31m"}', "model", "control character U+001B"),
]


@pytest.mark.parametrize("name, body, field, words", ADMIN_CORPUS, ids=[c[0] for c in ADMIN_CORPUS])
def test_admin_bodies_are_422_naming_the_field(api, name, body, field, words):
    r = httpx.post(
        f"{api.url}/v1/deployments/rollback",
        content=body,
        timeout=30,
        headers={"Content-Type": "application/json", **api.auth("admin")},
    )
    assert_4xx_naming(
        r,
        413 if len(body) > api.settings.admin_max_body_bytes else 422,
        field,
        "exceeds the" if len(body) > api.settings.admin_max_body_bytes else words,
    )


def test_admin_keys_are_checked_before_the_body_is_read(api):
    """With Expect: 100-continue the server asks for the body only when it reads it: a 401/403
    arriving with no 100 Continue first shows that the key was checked without reading."""
    for auth, expected in ((None, 401), ("bogus", 401), (api.keys["read"], 403)):
        hdrs = {
            "Content-Length": "2000",
            "Content-Type": "application/json",
            "Expect": "100-continue",
        }
        if auth:
            hdrs["Authorization"] = f"Bearer {auth}"
        s = connect(api)
        s.sendall(head("POST", "/v1/deployments/promote", hdrs))
        raw, elapsed = read_until_closed(s)
        assert status_of(raw) == expected and b"100 Continue" not in raw, raw[:300]
        assert elapsed < 10


def test_admin_bodies_over_the_limit_are_413_before_auth_or_reading(api):
    big = b'{"reason": "' + b"x" * (api.settings.admin_max_body_bytes + 10) + b'"}'
    for hdrs in ({}, api.auth("admin")):
        r = httpx.post(f"{api.url}/v1/deployments/pause", content=big, headers=hdrs, timeout=30)
        assert r.status_code == 413 and "16384-byte limit" in r.json()["detail"], r.text


def test_after_the_corpus_a_valid_verb_still_works(api):
    """The hostile bodies left nothing behind: an empty body (all defaults) and a form-encoded JSON
    body (what `curl -d` sends) are parsed, and the verb reaches the state check (409: no canary)."""
    for body, ctype in (
        (b"", "application/json"),
        (b'{"reason": "check"}', "application/x-www-form-urlencoded"),
    ):
        r = httpx.post(
            f"{api.url}/v1/deployments/pause",
            content=body,
            timeout=60,
            headers={"Content-Type": ctype, **api.auth("admin")},
        )
        assert r.status_code == 409 and "no canary" in r.json()["detail"], r.text


# --- status ----------------------------------------------------------------------------------------
STATUS_CORPUS = [  # (path with query, words in the error)
    ("/v1/deployments/history?cursor=-1", "greater than or equal to 0"),
    (f"/v1/deployments/history?cursor={2**31}", "less than or equal to"),
    (f"/v1/deployments/history?cursor={2**63}", "less than or equal to"),
    (f"/v1/deployments/history?cursor={10**40}", "less than or equal to"),
    ("/v1/deployments/history?cursor=abc", "valid integer"),
    ("/v1/deployments/history?cursor=1e3", "valid integer"),
    ("/v1/deployments/history?cursor=", "valid integer"),
    ("/v1/deployments/history?cursor=NaN", "valid integer"),
    ("/v1/deployments/history?limit=0", "greater than or equal to 1"),
    ("/v1/deployments/history?limit=501", "less than or equal to 500"),
    ("/v1/deployments/history?limit=99999999999999999999999", "less than or equal to 500"),
    ("/v1/deployments/history?type=bogus", "replica_heartbeat"),
    ("/v1/deployments/history?source=nobody", "Input should be"),
    ("/v1/deployments/history?model=%00", "should match pattern"),
    ("/v1/deployments/history?version=a%00b", "should match pattern"),
    ("/v1/deployments/history?model=" + "m" * 300, "at most 256"),
    ("/v1/deployments?model=x%00", "should match pattern"),
    ("/v1/models/%00", "should match pattern"),
    ("/v1/models/" + "9" * 100, "at most 64"),
    ("/v1/models/3?model=%0a", "should match pattern"),
]


@pytest.fixture(params=["sqlite", "postgres"])
def status_api(request, make_settings):
    overrides = {}
    if request.param == "postgres":
        overrides["database_url"] = request.getfixturevalue("fresh_postgres_url")
    api = start_api(make_settings, **overrides)
    yield api
    api.server.stop()


def test_status_parameters_are_422_not_database_errors(status_api):
    api = status_api
    with httpx.Client(base_url=api.url, headers=api.auth("read"), timeout=30) as client:
        for path, words in STATUS_CORPUS:
            r = client.get(path)
            assert r.status_code == 422, f"{path}: {r.status_code} {r.text[:300]}"
            assert words.lower() in r.text.lower(), f"{path}: {r.text[:300]}"
        # the extremes that are valid still answer
        r = client.get(f"/v1/deployments/history?cursor={2**31 - 1}&limit=500")
        assert r.status_code == 200 and r.json() == {"events": [], "next_cursor": None}, r.text
        assert client.get("/v1/deployments/history?cursor=0").status_code == 200
        assert (
            client.get("/v1/models/%E2%98%83").status_code == 404
        )  # a snowman: unknown, not an error
        assert client.get("/v1/deployments").status_code == 200


# --- webhook receiver -----------------------------------------------------------------------------
def signed(body: bytes, delivery_id: str | None = None, ts: str | None = None) -> dict[str, str]:
    delivery_id = delivery_id or uuid.uuid4().hex
    ts = str(int(time.time())) if ts is None else ts
    return {
        "X-MLflow-Delivery-Id": delivery_id,
        "X-MLflow-Timestamp": ts,
        "X-MLflow-Signature": sign(SECRET, delivery_id, ts, body),
        "Content-Type": "application/json",
    }


def hook(api, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/hooks/mlflow", content=body, headers=headers, timeout=60)


ALIAS = json.dumps(
    {
        "entity": "model_version_alias",
        "action": "created",
        "timestamp": "2026-11-24T00:00:00Z",
        "data": {"name": "corpus-model", "alias": "champion", "version": "1"},
    }
).encode()

AN_HOUR_AHEAD = "an-hour-ahead"
TIMESTAMP_CORPUS = [
    ("nan", "not a finite number"),
    ("inf", "not a finite number"),
    ("-inf", "not a finite number"),
    ("1e400", "not a finite number"),
    ("", "is empty"),
    ("soon", "not a number"),
    ("1.7e9", "not plain unix seconds"),
    ("0", "outside the 300s replay window"),
    (AN_HOUR_AHEAD, "outside the 300s replay window"),
]


@pytest.mark.parametrize(
    "ts, words", TIMESTAMP_CORPUS, ids=[t[0] or "empty" for t in TIMESTAMP_CORPUS]
)
def test_webhook_timestamps_that_are_not_finite_fresh_seconds_are_401(api, ts, words):
    if ts == AN_HOUR_AHEAD:  # made when the test runs: its id must not change between collections
        ts = str(int(time.time()) + 3600)
    r = hook(api, ALIAS, signed(ALIAS, ts=ts))  # correctly signed over that timestamp
    assert r.status_code == 401 and words in r.json()["detail"], r.text


def test_webhook_header_corpus_is_401(api):
    good = signed(ALIAS)
    cases = [
        (
            {k: v for k, v in good.items() if k != "X-MLflow-Signature"},
            "missing X-MLflow-Signature",
        ),
        (
            {k: v for k, v in good.items() if k != "X-MLflow-Delivery-Id"},
            "missing X-MLflow-Delivery-Id",
        ),
        ({**good, "X-MLflow-Delivery-Id": "x" * 200}, "1-128 characters"),
        ({**good, "X-MLflow-Delivery-Id": "../../etc"}, "1-128 characters"),
        ({**good, "X-MLflow-Signature": "v1,AAAA"}, "signature does not match"),
        ({**good, "X-MLflow-Signature": "v1," + "A" * 8000}, "signature does not match"),
        ({**good, "X-MLflow-Signature": " ".join(["v1,AAAA"] * 500)}, "signature does not match"),
    ]
    for headers, words in cases:
        r = hook(api, ALIAS, headers)
        assert r.status_code == 401 and words in r.json()["detail"], (words, r.text)


PAYLOAD_CORPUS = [  # (name, body, field named or None, words)
    ("not-json", b"entity=model_version_alias", None, "not valid JSON"),
    ("array", b"[1, 2]", None, "valid dictionary"),
    ("null", b"null", None, "valid dictionary"),
    ("no-entity", b'{"action": "created", "data": {}}', "entity", "Field required"),
    ("entity-number", b'{"entity": 7, "action": "created"}', "entity", "valid string"),
    (
        "data-list",
        b'{"entity": "model_version_alias", "action": "created", "data": [1]}',
        "data",
        "valid dictionary",
    ),
    (
        "data-string",
        b'{"entity": "model_version_alias", "action": "created", "data": "x"}',
        "data",
        "valid dictionary",
    ),
    (
        "alias-without-name",
        b'{"entity": "model_version_alias", "action": "created", "data": {"alias": "c"}}',
        "name",
        "Field required",
    ),
    (
        "name-object",
        b'{"entity": "model_version_alias", "action": "x", "data": {"name": {"a": 1}}}',
        "name",
        "valid string",
    ),
    (
        "nan-in-data",
        b'{"entity": "model_version", "action": "x", "data": {"v": NaN}}',
        "v",
        "NaN and Infinity",
    ),
    (
        "surrogate",
        b'{"entity": "model_version_alias", "action": "\\udfff", "data": {}}',
        "action",
        "lone UTF-16",
    ),
    (
        "deep",
        b'{"entity": "x", "action": "y", "data": ' + b"[" * 30000 + b"]" * 30000 + b"}",
        None,
        "nested deeper",
    ),
]


@pytest.mark.parametrize(
    "name, body, field, words", PAYLOAD_CORPUS, ids=[c[0] for c in PAYLOAD_CORPUS]
)
def test_signed_webhook_payloads_of_the_wrong_shape_are_422_and_not_remembered(
    api, name, body, field, words
):
    delivery_id = uuid.uuid4().hex
    r = hook(api, body, signed(body, delivery_id))
    assert_4xx_naming(r, 422, field, words)
    ignored = b'{"entity": "experiment", "action": "created", "data": {}}'
    r = hook(api, ignored, signed(ignored, delivery_id))  # same id, now a well-formed delivery
    assert r.status_code == 200 and r.json()["status"] == "ignored", (
        "the failed delivery was remembered: " + r.text
    )


def test_a_webhook_whose_processing_failed_is_not_remembered_as_delivered(api):
    """MLflow is unreachable: the alias reconciliation fails, the answer is 503 with Retry-After,
    and MLflow's retry of the same delivery is processed again (503 again), never 'duplicate'."""
    headers = signed(ALIAS)
    for _ in range(3):
        r = hook(api, ALIAS, headers)
        assert r.status_code == 503 and r.headers["Retry-After"] == "2", r.text
        assert "could not reconcile" in r.json()["detail"]


def test_a_carried_out_webhook_repeat_is_a_duplicate(api):
    body = json.dumps(
        {
            "entity": "model_version_alias",
            "action": "created",
            "data": {"name": "another-model", "alias": "champion"},
        }
    ).encode()
    headers = signed(body)
    assert hook(api, body, headers).json()["status"] == "ignored"
    r = hook(api, body, headers)
    assert r.status_code == 200 and r.json()["status"] == "duplicate", r.text


def test_webhook_bodies_over_the_limit_are_413(api):
    body = b'{"entity": "x", "action": "y", "data": {"pad": "' + b"p" * 70_000 + b'"}}'
    r = hook(api, body, signed(body))
    assert r.status_code == 413 and "limit" in r.json()["detail"], r.text

    def chunked():  # no Content-Length: cut while streaming
        yield body[:40_000]
        yield body[40_000:]

    r = httpx.post(
        f"{api.url}/v1/hooks/mlflow", content=chunked(), headers=signed(body), timeout=30
    )
    assert r.status_code == 413, r.text
