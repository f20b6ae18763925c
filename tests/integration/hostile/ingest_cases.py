"""Hostile request bodies and headers for POST /v1/events, one `Case` each.

Every case must be answered with one of its `statuses` (all 4xx) and a body that matches `says`
(a case-insensitive regex naming what is wrong), quickly, and must write nothing to Kafka.
tests/integration/hostile/test_ingest_corpus.py runs them against the real API and broker.
Bodies are built from one valid event (`VALID`) so each case breaks exactly one thing.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field

TS = "2026-11-21T10:00:00Z"
VALID = {
    "event_id": "ev-hostile",
    "type": "followup",
    "request_id": "req-h",
    "session_id": "sess-h",
    "ts": TS,
    "sentiment": 0.5,
}
GENERATION = {
    "event_id": "ev-gen",
    "type": "generation",
    "request_id": "req-g",
    "session_id": "sess-h",
    "ts": TS,
    "model_version": "3",
    "prompt_tokens": [72, 105],
    "completion_tokens": [33, 10],
    "logprobs": [-0.5, -0.0625],
    "temperature": 1.0,
    "tokenizer": "byte-v1",
}

INGEST = "ingest"  # the test's ingest key, as "Bearer <key>"
READ = "read"  # a valid key without the ingest scope


@dataclass(frozen=True)
class Case:
    id: str
    body: bytes
    statuses: frozenset[int]
    says: str  # regex, matched case-insensitively against the response body
    headers: dict[str, str | bytes] = field(default_factory=dict)
    auth: str | bytes | None = INGEST  # INGEST, READ, None (no header) or a raw Authorization value
    raw: bool = False  # send with http.client: httpx (h11) refuses to send some of these headers


def _body(*events: object, raw_event: bytes | None = None) -> bytes:
    if raw_event is not None:
        return b'{"events": [' + raw_event + b"]}"
    return json.dumps({"events": list(events)}).encode()


def _event_with(raw_field: bytes, base: dict | None = None) -> bytes:
    """VALID's JSON with `raw_field` (e.g. b'"sentiment": NaN') spliced in as its last member."""
    base = dict(base or VALID)
    name = raw_field.split(b":", 1)[0].strip().strip(b'"').decode("utf-8", "replace")
    base.pop(name, None)
    return json.dumps(base).encode()[:-1] + b", " + raw_field + b"}"


INVALID_JSON = r"not valid json"
S422 = frozenset({422})


def _deep(levels: int, open_: bytes, close: bytes) -> bytes:
    return open_ * levels + close * levels


MALFORMED = [
    Case("truncated", b'{"events": [', S422, INVALID_JSON),
    Case("empty-body", b"", S422, INVALID_JSON),
    Case("trailing-garbage", _body(VALID) + b" x", S422, INVALID_JSON),
    Case("two-documents", _body(VALID) + _body(VALID), S422, INVALID_JSON),
    Case("single-quotes", b"{'events': []}", S422, INVALID_JSON),
    Case("comment", b'{"events": [] /* hi */}', S422, INVALID_JSON),
    Case(
        "trailing-comma",
        _body(raw_event=json.dumps(VALID).encode()[:-1] + b",}"),
        S422,
        INVALID_JSON,
    ),
    Case("utf8-bom", b"\xef\xbb\xbf" + _body(VALID), S422, INVALID_JSON),
    Case("null", b"null", S422, r'\{\\?"events\\?": \[\.\.\.\]\}'),
    Case("bare-string", b'"events"', S422, r"json object"),
    Case("utf16-body", _body(VALID).decode().encode("utf-16"), S422, INVALID_JSON),
]

NESTING = [
    Case(
        "10k-nested-arrays-as-events",
        b'{"events": ' + _deep(10_000, b"[", b"]") + b"}",
        S422,
        r"depth|not valid json",
    ),
    Case(
        "10k-nested-objects-in-a-field",
        _body(raw_event=_event_with(b'"sentiment": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000)),
        S422,
        r"depth|not valid json",
    ),
    Case(
        "10k-nested-arrays-as-tokens",
        _body(raw_event=_event_with(b'"prompt_tokens": ' + _deep(10_000, b"[", b"]"), GENERATION)),
        S422,
        r"depth|not valid json",
    ),
    Case(
        "nested-event-object", _body(dict(VALID, sentiment={"a": {"b": [1]}})), S422, r"sentiment"
    ),
]

NUMBERS = [
    Case(
        "1e400",
        _body(raw_event=_event_with(b'"sentiment": 1e400')),
        S422,
        r"infinity|not valid json",
    ),
    Case(
        "-1e400",
        _body(raw_event=_event_with(b'"sentiment": -1e400')),
        S422,
        r"infinity|not valid json",
    ),
    Case(
        "1000-digit-integer",
        _body(raw_event=_event_with(b'"sentiment": ' + b"9" * 1000)),
        S422,
        r"sentiment|not valid json",
    ),
    Case(
        "2**70-token-id", _body(dict(GENERATION, prompt_tokens=[72, 2**70])), S422, r"prompt_tokens"
    ),
    Case(
        "2**64-token-id",
        _body(dict(GENERATION, completion_tokens=[33, 2**64])),
        S422,
        r"completion_tokens",
    ),
    Case("negative-token-id", _body(dict(GENERATION, prompt_tokens=[-1])), S422, r"prompt_tokens"),
    Case("float-token-id", _body(dict(GENERATION, prompt_tokens=[1.5])), S422, r"prompt_tokens"),
    Case("sentiment-out-of-range", _body(dict(VALID, sentiment=1e300)), S422, r"sentiment"),
]

NON_FINITE = [
    Case(
        "NaN",
        _body(raw_event=_event_with(b'"sentiment": NaN')),
        S422,
        r"NaN and Infinity are not JSON",
    ),
    Case(
        "Infinity",
        _body(raw_event=_event_with(b'"sentiment": Infinity')),
        S422,
        r"NaN and Infinity are not JSON",
    ),
    Case(
        "-Infinity",
        _body(raw_event=_event_with(b'"sentiment": -Infinity')),
        S422,
        r"NaN and Infinity are not JSON",
    ),
    Case("nan-lowercase", _body(raw_event=_event_with(b'"sentiment": nan')), S422, INVALID_JSON),
    Case(
        "NaN-logprob",
        _body(raw_event=_event_with(b'"logprobs": [-0.5, NaN]', GENERATION)),
        S422,
        r"NaN and Infinity",
    ),
    Case("NaN-string", _body(dict(VALID, sentiment="NaN")), S422, r"sentiment"),
]

STRINGS = [
    Case(
        "lone-high-surrogate-escape",
        _body(raw_event=_event_with(b'"session_id": "a\\ud800b"')),
        S422,
        r"surrogate|not valid json",
    ),
    Case(
        "lone-low-surrogate-escape",
        _body(raw_event=_event_with(b'"session_id": "\\udc00"')),
        S422,
        r"surrogate|not valid json",
    ),
    Case(
        "reversed-surrogate-pair",
        _body(raw_event=_event_with(b'"request_id": "\\udc00\\ud800"')),
        S422,
        r"surrogate|not valid json",
    ),
    Case(
        "invalid-utf8-byte",
        _body(raw_event=_event_with(b'"session_id": "a\xffb"')),
        S422,
        r"utf-8|not valid json",
    ),
    Case(
        "overlong-utf8",
        _body(raw_event=_event_with(b'"session_id": "\xc0\xaf"')),
        S422,
        r"utf-8|not valid json",
    ),
    Case(
        "utf8-encoded-surrogate",
        _body(raw_event=_event_with(b'"session_id": "\xed\xa0\x80"')),
        S422,
        r"utf-8|surrogate|not valid json",
    ),
    Case(
        "raw-control-character",
        _body(raw_event=_event_with(b'"session_id": "a\x01b"')),
        S422,
        r"control|not valid json",
    ),
    Case("overlong-request-id", _body(dict(VALID, request_id="r" * 10_000)), S422, r"request_id"),
    Case("empty-event-id", _body(dict(VALID, event_id="")), S422, r"event_id"),
]

WRONG_TYPES = [
    Case("events-string", b'{"events": "accept"}', S422, r"events.*json array"),
    Case("events-number", b'{"events": 1}', S422, r"events.*json array"),
    Case("events-null", b'{"events": null}', S422, r"events.*json array"),
    Case("event-is-a-list", _body(["accept"]), S422, r"object|dict|type"),
    Case("event-is-a-string", _body("accept"), S422, r"object|dict|type"),
    Case("event-is-null", _body(None), S422, r"object|dict|type"),
    Case(
        "rating-as-string",
        _body(dict(VALID, type="rating", value="1", sentiment=None)),
        S422,
        r"value",
    ),
    Case(
        "rating-as-bool",
        _body(
            {k: v for k, v in dict(VALID, type="rating", value=True).items() if k != "sentiment"}
        ),
        S422,
        r"value.*boolean",
    ),
    Case("temperature-huge", _body(dict(GENERATION, temperature=1e308)), S422, r"temperature"),
    Case(
        "tokens-as-string", _body(dict(GENERATION, prompt_tokens="72,105")), S422, r"prompt_tokens"
    ),
    Case("ts-as-number", _body(dict(VALID, ts=1_700_000_000)), S422, r"ts"),
    Case("ts-without-zone", _body(dict(VALID, ts="2026-11-21T10:00:00")), S422, r"ts"),
    Case("event-id-as-number", _body(dict(VALID, event_id=5)), S422, r"event_id"),
    Case("type-as-number", _body(dict(VALID, type=7)), S422, r"type"),
    Case("unknown-type", _body(dict(VALID, type="explode")), S422, r"type"),
    Case("missing-type", _body({k: v for k, v in VALID.items() if k != "type"}), S422, r"type"),
    Case("unknown-field", _body(dict(VALID, admin=True)), S422, r"admin"),
    Case("unknown-top-level-field", b'{"events": [], "debug": true}', S422, r"debug"),
]

DUPLICATE_KEYS = [
    Case(
        "duplicate-type",
        _body(raw_event=json.dumps(VALID).encode()[:-1] + b', "type": "followup"}'),
        S422,
        r"duplicate key",
    ),
    Case(
        "duplicate-event-id",
        _body(raw_event=json.dumps(VALID).encode()[:-1] + b', "event_id": "ev-other"}'),
        S422,
        r"duplicate key",
    ),
    Case(
        "duplicate-events",
        b'{"events": [], "events": ' + _body(VALID)[len(b'{"events": ') :],
        S422,
        r"duplicate key",
    ),
    Case(
        "duplicate-key-with-spaces",
        _body(raw_event=json.dumps(VALID).encode()[:-1] + b', "sentiment"  :  0.25}'),
        S422,
        r"duplicate key",
    ),
]

_PLAIN = _body(VALID)
ENCODINGS = [
    Case(
        "gzip",
        gzip.compress(_PLAIN),
        frozenset({415}),
        r"content-encoding.*gzip",
        headers={"Content-Encoding": "gzip"},
    ),
    Case(
        "gzip-bomb",
        gzip.compress(b" " * (64 << 20)),
        frozenset({413, 415}),
        r"content-encoding|exceeds",
        headers={"Content-Encoding": "gzip"},
    ),
    Case(
        "deflate",
        zlib.compress(_PLAIN),
        frozenset({415}),
        r"content-encoding.*deflate",
        headers={"Content-Encoding": "deflate"},
    ),
    Case(
        "br-declared",
        _PLAIN,
        frozenset({415}),
        r"content-encoding.*br",
        headers={"Content-Encoding": "br"},
    ),
    Case("gzip-undeclared", gzip.compress(_PLAIN), S422, r"not valid json|utf-8"),
]

_AUTH = frozenset({401, 429})
_AUTH_SAYS = r"bearer|api key|authorization header|too many|rate"
AUTH = [
    Case("no-header", _PLAIN, _AUTH, _AUTH_SAYS, auth=None),
    Case("wrong-scheme", _PLAIN, _AUTH, _AUTH_SAYS, auth="Basic dXNlcjpwYXNz"),
    Case("empty-token", _PLAIN, _AUTH, _AUTH_SAYS, auth="Bearer ", raw=True),
    Case("whitespace-token", _PLAIN, _AUTH, _AUTH_SAYS, auth="Bearer \t ", raw=True),
    Case("scheme-only", _PLAIN, _AUTH, _AUTH_SAYS, auth="Bearer"),
    Case("10kb-token", _PLAIN, _AUTH, _AUTH_SAYS, auth="Bearer " + "k" * 10_240),
    Case("non-ascii-token", _PLAIN, _AUTH, _AUTH_SAYS, auth="Bearer ключ-🔑".encode()),
    Case("latin1-token", _PLAIN, _AUTH, _AUTH_SAYS, auth=b"Bearer \xe9\xff"),
    Case("unknown-key", _PLAIN, _AUTH, _AUTH_SAYS, auth="Bearer fw_" + "0" * 40),
    Case("read-scope-key", _PLAIN, frozenset({403}), r"needs 'ingest'", auth=READ),
]

CASES: list[Case] = [
    *MALFORMED,
    *NESTING,
    *NUMBERS,
    *NON_FINITE,
    *STRINGS,
    *WRONG_TYPES,
    *DUPLICATE_KEYS,
    *ENCODINGS,
    *AUTH,
]
assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
assert all(s // 100 == 4 for c in CASES for s in c.statuses), "every hostile case is a 4xx"
