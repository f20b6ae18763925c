"""Validation against OpenAI's published schemas (tests/data/openai/, with their source).

    from tests.openai_schemas import check
    check("CreateChatCompletionResponse", body)   # AssertionError naming every violation

The OpenAPI document marks optional nulls with OpenAPI 3.0's `nullable: true`; they are turned
into JSON Schema's `"type": [T, "null"]` (and `null` joins an `enum`) before validating with
`jsonschema` (draft 2020-12), `$ref`s resolved within the same document.
"""

from __future__ import annotations

import copy
import json
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).parent / "data" / "openai" / "openai_schemas.json"
PREFIX = "#/components/schemas/"


def _nullable(node: Any) -> Any:
    """A copy of `node` with every `nullable: true` written as JSON Schema says it."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        if "type" in out:
            types = out["type"] if isinstance(out["type"], list) else [out["type"]]
            out["type"] = [*types, "null"] if "null" not in types else types
            if "enum" in out and None not in out["enum"]:
                out["enum"] = [*out["enum"], None]
        else:  # a $ref or a composition: null besides it
            out = {"anyOf": [out, {"type": "null"}]}
    return out


@lru_cache(maxsize=1)
def _document() -> dict[str, Any]:
    raw = json.loads(SCHEMAS.read_text())
    return {"components": {"schemas": _nullable(copy.deepcopy(raw["schemas"]))}}


@cache
def _validator(name: str):
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    doc = _document()
    if name not in doc["components"]["schemas"]:
        raise KeyError(f"{name} is not in {SCHEMAS.name}")
    resource = Resource.from_contents(doc, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:openai", resource)
    return Draft202012Validator({"$ref": f"urn:openai{PREFIX}{name}"}, registry=registry)


def violations(name: str, instance: Any) -> list[str]:
    """Every way `instance` violates OpenAI's schema `name` (`path: message`), none if it conforms."""
    out = []
    for error in sorted(_validator(name).iter_errors(instance), key=lambda e: list(e.path)):
        while error.context:  # anyOf / oneOf: the deepest failure says what is wrong
            error = max(error.context, key=lambda e: len(e.absolute_path))
        out.append(f"{'/'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}")
    return out


def check(name: str, instance: Any) -> None:
    """Assert that `instance` conforms to OpenAI's schema `name`."""
    found = violations(name, instance)
    assert not found, f"not a valid {name}:\n  " + "\n  ".join(found)
