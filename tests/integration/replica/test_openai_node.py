"""The official `openai` npm package against a real replica on the real broker: `node --test` runs
tests/node/openai-compat/*.test.mjs (a completion, a streamed completion, a streamed chat
completion, an error, tool calls: named, required and streamed through the SDK's `stream`
helper, and a tool result in the next turn) with the replica's URL and key in its environment;
this driver asserts node's exit code and reads the generation events of what node received back
from Kafka. The tiny model's context is widened to 4096 tokens: prompts carry the tools."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.replica.conftest import read_topic

pytestmark = pytest.mark.integration

PACKAGE = Path(__file__).resolve().parents[2] / "node" / "openai-compat"
KEY = "node-serving-key"


def _decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def test_the_openai_npm_client_completes_and_streams_against_a_real_replica(
    seeded_replica, tmp_path
):
    node = shutil.which("node")
    assert node, "node is not installed: Node >= 20 is needed for the npm client tests"
    assert (PACKAGE / "node_modules" / "openai" / "package.json").exists(), (
        f"{PACKAGE}/node_modules is missing: run `make node` (npm ci in {PACKAGE})"
    )
    srv = seeded_replica(id="replica-node", api_key=KEY, max_context=4096)
    result_file = tmp_path / "node-results.json"
    env = {
        **os.environ,
        "FLYWHEEL_REPLICA_URL": srv.url,
        "FLYWHEEL_REPLICA_KEY": KEY,
        "FLYWHEEL_MODEL": srv.settings.model_name,
        "FLYWHEEL_RESULT_FILE": str(result_file),
    }
    tests = sorted(str(p.name) for p in PACKAGE.glob("*.test.mjs"))
    proc = subprocess.run(
        [node, "--test", *tests], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"node --test failed:\n{proc.stdout}\n{proc.stderr}"
    got = json.loads(result_file.read_text())
    assert set(got) == {"completion", "stream", "chat", "tool_named", "tool_stream", "tool_result"}

    ids = [got[k]["id"] for k in ("completion", "stream", "chat")]
    events = read_topic(srv.settings, "interactions", 3, where=lambda e: e.get("request_id") in ids)
    by_id = {e["request_id"]: e for e in events}
    assert sorted(by_id) == sorted(ids) and len(events) == 3, "one event per completion"
    for kind, streamed in (("completion", False), ("stream", True), ("chat", True)):
        e, r = by_id[got[kind]["id"]], got[kind]
        assert e["stream"] is streamed and e["finish_reason"] == r["finish_reason"], (kind, e)
        assert _decode(e["completion_tokens"]) == r["text"], kind
    assert (
        len(by_id[got["stream"]["id"]]["completion_tokens"]) == got["stream"]["completion_tokens"]
    )
    assert by_id[got["chat"]["id"]]["session_id"] == "node-3"

    tools = ("tool_named", "tool_stream", "tool_result")
    ids = [got[k]["id"] for k in tools]
    events = read_topic(srv.settings, "interactions", 3, where=lambda e: e.get("request_id") in ids)
    by_kind = {k: next(e for e in events if e["request_id"] == got[k]["id"]) for k in tools}
    for kind in ("tool_named", "tool_stream"):
        e, r = by_kind[kind], got[kind]
        assert e["turn"] == 0 and e["constrained"] and e["finish_reason"] == "tool_calls", e
        assert [(c["id"], c["arguments"]) for c in e["tool_calls"]] == [
            (r["call_id"], r["arguments"])
        ]
        assert e["stream"] is (kind == "tool_stream")
    assert by_kind["tool_named"]["tool_choice"] == "function"
    assert by_kind["tool_stream"]["tool_choice"] == "required"
    assert (
        len(by_kind["tool_stream"]["completion_tokens"]) == got["tool_stream"]["completion_tokens"]
    )
    answer = by_kind["tool_result"]
    assert answer["turn"] == 1 and answer["tool_choice"] == "auto" and not answer["constrained"]
    file_text = {"notes.txt": "the answer is 42\n", "todo.txt": "water the plants\n"}
    assert file_text[got["tool_result"]["file"]] in _decode(answer["prompt_tokens"])
