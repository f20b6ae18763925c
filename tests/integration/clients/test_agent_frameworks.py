"""Agent frameworks, unmodified, calling tools on a real replica over real HTTP: the OpenAI Agents
SDK (`OpenAIChatCompletionsModel` on an `AsyncOpenAI` client, `Runner.run` and
`Runner.run_streamed`) and LangChain (`ChatOpenAI.bind_tools`, invoke and stream).

The replica serves the tiny untrained built-in model (version 7) with a context of 4096 tokens
(the tools and the tool results are in the prompt). Untrained, it calls a tool only when the
request makes it: `tool_choice` "required" or a named function is enforced by constrained
decoding, so the call's arguments validate against the tool's schema; under "auto" it writes
text, which ends an agent's run. What the frameworks sent back is read from the generation events
on Kafka: the turn, the calls, and the prompt (byte tokens) that must carry the tool's result.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any, Literal

import pytest
from jsonschema import Draft202012Validator

from tests.integration.replica.conftest import read_topic, replica_factory, seeded_replica  # noqa: F401
from tests.openai_schemas import check

pytestmark = pytest.mark.integration

KEY = "frameworks-serving-key"
CONTEXT = 4096
MAX_TOKENS = 160  # one call to `read_file` is about 80 byte tokens
FILES = {"notes.txt": "the answer is 42\n", "todo.txt": "water the plants\n"}


def _text(srv, tokens: list[int]) -> str:
    """Token ids as text, by the tokenizer of the version `srv` serves (either engine)."""
    return srv.replica.store.snapshot().champion.policy.tokenizer.decode(tokens)


def _generations(settings, session: str, want: int) -> list[dict[str, Any]]:
    """The session's generation events (at least `want` of them), in turn order."""
    events = read_topic(
        settings,
        "interactions",
        want,
        where=lambda e: e.get("type") == "generation" and e.get("session_id") == session,
    )
    assert len(events) >= want, f"{len(events)} generation events of {session}, expected {want}"
    return sorted(events, key=lambda e: (e["turn"], e["ts"]))


@pytest.fixture()
def srv(seeded_replica):
    return seeded_replica(id="replica-frameworks", api_key=KEY, max_context=CONTEXT)


@pytest.fixture()
def files(tmp_path) -> Path:
    root = tmp_path / "files"
    root.mkdir()
    for name, text in FILES.items():
        (root / name).write_text(text)
    return root


# --- OpenAI Agents SDK ------------------------------------------------------------------------


def _agent(srv, files: Path, session: str, calls: list[dict[str, Any]]):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool
    from openai import AsyncOpenAI

    @function_tool
    def read_file(name: Literal["notes.txt", "todo.txt"]) -> str:
        """Read one of the user's files.

        Args:
            name: the file's name.
        """
        calls.append({"name": name})
        return (files / name).read_text()

    client = AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    agent = Agent(
        name="reader",
        instructions="Answer from the user's files: read the one you need, then answer.",
        tools=[read_file],
        model=OpenAIChatCompletionsModel(model=srv.settings.model_name, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required",  # reset to auto after the first call (reset_tool_choice)
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            extra_headers={"X-Flywheel-Session": session},
        ),
    )
    return agent, read_file, client


def _check_agent_run(srv, result, tool, calls, session: str) -> None:
    from agents import ToolCallItem, ToolCallOutputItem

    # The tool really ran, with arguments that validate against the schema the SDK sent.
    made = [i.raw_item for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert len(made) == 1 and len(outputs) == 1 and len(calls) == 1, result.new_items
    args = json.loads(made[0].arguments)
    Draft202012Validator(tool.params_json_schema).validate(args)
    assert made[0].name == "read_file" and calls == [args]
    assert outputs[0].output == FILES[args["name"]]
    # The run finished: the second turn (auto, after reset_tool_choice) answered in text.
    assert isinstance(result.final_output, str)
    assert len(result.raw_responses) == 2

    first, second = _generations(srv.settings, session, 2)[:2]
    assert first["turn"] == 0 and first["tool_choice"] == "required" and first["constrained"]
    assert [c["name"] for c in first["tool_calls"]] == ["read_file"]
    assert first["tool_calls"][0]["id"] == made[0].call_id
    assert first["tool_calls"][0]["arguments_valid"], first["tool_calls"]
    assert first["finish_reason"] == "tool_calls"
    # The next request carried the call and its result back: the history has the tool message.
    assert second["turn"] == 1 and second["tool_choice"] == "auto"
    assert not second["constrained"] and second["tool_calls"] == []
    prompt = _text(srv, second["prompt_tokens"])
    assert FILES[args["name"]] in prompt and '"read_file"' in prompt, prompt[-600:]
    assert first["tools_digest"] == second["tools_digest"]


def test_openai_agents_sdk_runs_a_function_tool(srv, files):
    run_agents_sdk(srv, files)


def run_agents_sdk(srv, files: Path) -> None:
    """An Agents SDK agent with a function tool runs to its final output on `srv` (either engine:
    tests/integration/replica/test_vllm_engine.py runs it on vLLM)."""
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)
    session, calls = f"agents-{uuid.uuid4().hex[:8]}", []
    agent, tool, client = _agent(srv, files, session, calls)

    async def run():
        try:
            return await Runner.run(agent, "What is the answer in my notes?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    _check_agent_run(srv, result, tool, calls, session)


def test_openai_agents_sdk_streams_a_function_tool(srv, files):
    from agents import RawResponsesStreamEvent, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    session, calls = f"agents-stream-{uuid.uuid4().hex[:8]}", []
    agent, tool, client = _agent(srv, files, session, calls)

    async def run():
        try:
            result = Runner.run_streamed(agent, "What is the answer in my notes?", max_turns=4)
            kinds = [e.type async for e in result.stream_events()]
            return result, kinds
        finally:
            await client.close()

    result, kinds = asyncio.run(run())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds, set(kinds)
    assert RawResponsesStreamEvent  # the raw events are the SDK's from the replica's chunks
    _check_agent_run(srv, result, tool, calls, session)
    events = _generations(srv.settings, session, 2)
    assert all(e["stream"] for e in events[:2])


# --- LangChain ----------------------------------------------------------------------------------


def _lc_tool(files: Path, calls: list[dict[str, Any]]):
    from langchain_core.tools import tool

    @tool
    def read_file(name: Literal["notes.txt", "todo.txt"]) -> str:
        """Read one of the user's files by name."""
        calls.append({"name": name})
        return (files / name).read_text()

    return read_file


def _schema(lc_tool, strict: bool = True) -> dict[str, Any]:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(lc_tool, strict=strict)["function"]["parameters"]


def _chat(srv, session: str, **kw: Any):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=srv.settings.model_name,
        base_url=f"{srv.url}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=60,
        max_tokens=MAX_TOKENS,
        default_headers={"X-Flywheel-Session": session},
        **kw,
    )


def test_langchain_binds_a_named_tool_and_takes_its_result_back(srv, files):
    run_langchain(srv, files)


def run_langchain(srv, files: Path) -> None:
    """LangChain's ChatOpenAI binds a named tool, and its result goes back, on `srv` (either
    engine)."""
    from langchain_core.messages import AIMessage, HumanMessage

    session, calls = f"langchain-{uuid.uuid4().hex[:8]}", []
    read_file = _lc_tool(files, calls)
    chat = _chat(srv, session)
    history = [HumanMessage("What is the answer in my notes?")]

    # strict: the schema gets additionalProperties false. Without it the grammar lets the untrained
    # model add keys of its own to the arguments, and it writes them until max_tokens.
    ai = chat.bind_tools([read_file], tool_choice="read_file", strict=True).invoke(history)
    assert isinstance(ai, AIMessage) and len(ai.tool_calls) == 1, ai
    call = ai.tool_calls[0]
    assert call["name"] == "read_file" and call["id"]
    Draft202012Validator(_schema(read_file)).validate(call["args"])
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    version = srv.replica.store.snapshot().champion.version
    assert ai.response_metadata["system_fingerprint"] == f"flywheel-v{version}"

    tool_message = read_file.invoke(call)  # a ToolCall in: a ToolMessage out, id and all
    assert calls == [call["args"]] and tool_message.tool_call_id == call["id"]
    history += [ai, tool_message]
    answer = chat.bind_tools([read_file], strict=True).invoke(
        history
    )  # auto: the untrained model writes text
    assert isinstance(answer, AIMessage) and answer.response_metadata["finish_reason"] in (
        "stop",
        "length",
        "tool_calls",
    )

    first, second = _generations(srv.settings, session, 2)[:2]
    assert first["turn"] == 0 and first["tool_choice"] == "function" and first["constrained"]
    assert first["tool_calls"][0]["id"] == call["id"]
    assert second["turn"] == 1 and second["tool_choice"] == "auto"
    assert FILES[call["args"]["name"]] in _text(srv, second["prompt_tokens"])


def test_langchain_streams_a_tool_call(srv, files):
    from langchain_core.messages import AIMessageChunk, HumanMessage

    session, calls = f"langchain-stream-{uuid.uuid4().hex[:8]}", []
    read_file = _lc_tool(files, calls)
    # not strict: the tool's schema does not say additionalProperties, and the constraint allows
    # none (policy/constrain.py), so the call closes
    bound = _chat(srv, session, stream_usage=True).bind_tools(
        [read_file], tool_choice="required", parallel_tool_calls=False
    )
    chunks = list(bound.stream([HumanMessage("Read my todo list.")]))
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert len(whole.tool_calls) == 1 and not whole.invalid_tool_calls, whole
    call = whole.tool_calls[0]
    assert call["name"] == "read_file" and call["id"].startswith("call_")
    Draft202012Validator(_schema(read_file, strict=False)).validate(call["args"])
    assert whole.response_metadata["finish_reason"] == "tool_calls"
    assert whole.usage_metadata and whole.usage_metadata["output_tokens"] >= 1

    (event,) = _generations(srv.settings, session, 1)
    assert event["stream"] and event["tool_calls"][0]["id"] == call["id"]
    assert json.loads(event["tool_calls"][0]["arguments"]) == call["args"]
    assert len(event["completion_tokens"]) == whole.usage_metadata["output_tokens"]


# --- the raw responses the frameworks read, against OpenAI's schemas ---------------------------


def test_tool_call_responses_and_chunks_conform(srv):
    """What the frameworks above parse, as raw JSON: a named call's response and a required
    call's stream chunks validate against OpenAI's published schemas."""
    import httpx

    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": sorted(FILES)}},
                    "required": ["name"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    body = {
        "model": srv.settings.model_name,
        "messages": [{"role": "user", "content": "read my notes"}],
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "read_file"}},
        "max_completion_tokens": MAX_TOKENS,
        "user": "frameworks-raw",
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        check("CreateChatCompletionResponse", r.json())
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        body.update(tool_choice="required", stream=True, parallel_tool_calls=False)
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = [ln for ln in resp.read().decode().split("\n") if ln.strip()]
    assert resp.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "read_file"
    args = "".join(d["function"].get("arguments", "") for d in deltas)
    assert json.loads(args)["name"] in FILES
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
