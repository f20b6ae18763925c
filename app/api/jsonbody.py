"""Strict JSON request bodies for the API's small JSON routes (admin verbs, webhook receiver).

`parse_json(body, max_depth)` accepts standard JSON only and raises `JsonBodyError(field, message)`
naming where the problem is:

- NaN, Infinity, -Infinity and numbers beyond float range (`1e400`) are refused (not JSON /
  not finite), with the field they appear in;
- lone UTF-16 surrogates (`"\\ud800"`) and bytes that are not UTF-8 are refused, with the field;
- nesting deeper than `max_depth` is refused before it can reach a recursive reader.

The fast path is one orjson parse (which already refuses all of the above); only a body that
fails is parsed again with the standard library to find the field to name.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

_BAD = object()  # stands in for a NaN/Infinity literal while looking for its field


class JsonBodyError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def detail(self) -> list[dict[str, Any]]:
        """FastAPI's 422 shape: `[{"loc": ["body", ...], "msg", "type"}]`."""
        loc = ["body"] if self.field == "(body)" else ["body", *self.field.split(".")]
        return [{"loc": loc, "msg": self.message, "type": "value_error"}]


def depth(doc: Any, limit: int) -> int:
    """Nesting depth of `doc` (a scalar is 0), counting no further than `limit + 1`."""
    deepest, stack = 0, [(doc, 0)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            d += 1
            deepest = max(deepest, d)
            if d > limit:
                return d
            stack.extend((v, d) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(body: bytes, max_depth: int = 32) -> Any:
    """The JSON document in `body`; JsonBodyError naming the field when it is not strict, finite JSON."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _explain(body, exc, max_depth) from None
    if depth(doc, max_depth) > max_depth:
        raise JsonBodyError("(body)", f"nested deeper than {max_depth} levels")
    return doc


def _explain(body: bytes, exc: orjson.JSONDecodeError, max_depth: int) -> JsonBodyError:
    if "depth" in str(exc):
        return JsonBodyError("(body)", f"nested deeper than {max_depth} levels")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as ue:
        return JsonBodyError("(body)", f"not UTF-8 (byte {ue.start}); send JSON encoded as UTF-8")
    if (
        body.count(b"[") + body.count(b"{") < 2 * max_depth + 2
    ):  # the stdlib parser recurses: only shallow bodies
        try:
            doc = json.loads(text, parse_constant=lambda _name: _BAD)
        except (ValueError, RecursionError):
            doc = None
        if doc is not None:
            found = _find_bad(doc, "")
            if found is not None:
                return JsonBodyError(*found)
    return JsonBodyError("(body)", f"not valid JSON: {exc}")


def _find_bad(node: Any, path: str) -> tuple[str, str] | None:
    where = path or "(body)"
    if node is _BAD:
        return where, "NaN and Infinity are not JSON; send a finite number"
    if isinstance(node, float) and not math.isfinite(node):
        return where, "number out of range (not a finite double)"
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError:
            return (
                where,
                "string contains a lone UTF-16 surrogate (\\ud800-\\udfff escape without its pair)",
            )
        return None
    if isinstance(node, dict):
        for k, v in node.items():
            try:
                k.encode("utf-8")
            except UnicodeEncodeError:
                return where, "a key contains a lone UTF-16 surrogate"
            found = _find_bad(v, f"{path}.{k}" if path else k)
            if found is not None:
                return found
    if isinstance(node, list):
        for i, v in enumerate(node):
            found = _find_bad(v, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None
