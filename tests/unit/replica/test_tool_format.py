"""policy/tool_format.py: the Hermes reader (one reader for the answer and the stream), the format
factory, and the built-in chat template's tools and history."""

from __future__ import annotations

import json

import pytest

from policy.tokenizer import ByteTokenizer
from policy.tool_format import HermesFormat, make_format, tool_format_for

NAMES = ["read_file", "apply_edit"]
TWO_CALLS = (
    "Let me look.\n"
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "apply_edit", "arguments": {}}\n</tool_call>'
)


def read(text: str, chunk: int) -> tuple[str, list, list]:
    """The text fed `chunk` characters at a time, then finished: (content, calls, invalid)."""
    r = HermesFormat().reader(NAMES)
    outs = [r.feed(text[i : i + chunk]) for i in range(0, len(text), chunk)] + [r.finish()]
    return (
        "".join(o.content for o in outs),
        [c for o in outs for c in o.calls],
        [c for o in outs for c in o.invalid],
    )


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_calls_and_content_are_the_same_however_the_text_arrives(chunk):
    content, calls, invalid = read(TWO_CALLS, chunk)
    assert content == "Let me look." and not invalid
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("read_file", {"path": "a.py"}),
        ("apply_edit", {}),
    ]


def test_a_call_is_not_streamed_as_content_before_its_tag_is_decided():
    r = HermesFormat().reader(NAMES)
    assert r.feed("ok <tool_").content == "ok"  # "<tool_" may start a call: held back
    assert r.feed("box>").content == " <tool_box>"  # it did not


@pytest.mark.parametrize("chunk", [1, 1000])
def test_a_plain_answer_keeps_its_text_exactly(chunk):
    text = "def f(x):\n    return x < tool  \n"
    assert read(text, chunk) == (text, [], [])


@pytest.mark.parametrize(
    "body, error",
    [
        ('{"name": "read_file", "arguments": {"path": ', "not JSON"),
        ('{"name": "rm", "arguments": {}}', "unknown function 'rm'"),
        ('{"name": "read_file", "arguments": [1]}', "`arguments` is not a JSON object"),
        ('["read_file"]', "not a JSON object"),
    ],
)
def test_a_malformed_call_stays_content_and_is_reported_never_repaired(body, error):
    text = f"<tool_call>\n{body}\n</tool_call>"
    content, calls, invalid = read(text, 3)
    assert calls == [] and content == text
    assert len(invalid) == 1 and error in invalid[0].error


def test_an_unterminated_call_at_the_end_is_content_and_invalid():
    text = '<tool_call>\n{"name": "read_file", "argu'
    content, calls, invalid = read(text, 4)
    assert (content, calls) == (text, []) and invalid[0].error == "unterminated tool call"


def test_the_factory_picks_hermes_for_the_builtin_and_qwen_style_templates():
    assert tool_format_for(ByteTokenizer()).name == "hermes"

    class HF:
        def __init__(self, template):
            self.hf = type("T", (), {"chat_template": template})()

    assert tool_format_for(HF("... <tool_call> ...")).name == "hermes"
    assert tool_format_for(HF("{{ messages }}")) is None
    with pytest.raises(ValueError, match="unknown tool-call format 'mistral'"):
        make_format("mistral")


def test_the_builtin_template_renders_tools_calls_and_results_and_a_call_as_generated():
    fmt = HermesFormat()
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "read_file", "arguments": '{"path": "a.py"}'}
    prompt = ByteTokenizer().apply_chat_template(
        [
            {"role": "user", "content": "open a.py"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "print(1)", "tool_call_id": "c1"},
        ],
        [tool],
    )
    generated = fmt.render_call("read_file", '{"path": "a.py"}')
    assert prompt == (
        f"tools: read_file()\nuser: open a.py\nassistant: {generated}\ntool: print(1)\nassistant: "
    )
    # what the model wrote for that call reads back as the same call
    content, calls, _ = read(generated, 7)
    assert content == "" and (calls[0].name, calls[0].arguments) == (
        "read_file",
        '{"path": "a.py"}',
    )


def test_arguments_are_returned_as_the_model_wrote_them():
    body = '{"arguments": {"a": "\\u00e9", "b":[1,2]}, "name": "read_file", "x": 1}'
    content, calls, _ = read(f"<tool_call>\n{body}\n</tool_call>", 1000)
    assert calls[0].arguments == '{"a": "\\u00e9", "b":[1,2]}'
    dup = '{"name": "read_file", "arguments": {"a": 1}, "arguments": {"b": 2}}'
    assert read(f"<tool_call>{dup}</tool_call>", 1000)[1][0].arguments == '{"b": 2}'


def test_the_builtin_template_writes_each_tool_as_its_signature_on_one_line():
    tok = ByteTokenizer()
    string = {"type": "string"}
    tools = [
        {
            "type": "function",
            "function": {
                "name": "apply_edit",
                "description": "not rendered",
                "parameters": {
                    "type": "object",
                    "properties": {"path": string, "old": string, "line": {"type": "integer"}},
                },
            },
        },
        {"type": "function", "function": {"name": "run_tests"}},
    ]
    prompt = tok.apply_chat_template([{"role": "user", "content": "go"}], tools)
    assert (
        prompt == "tools: apply_edit(path, old, line: integer); run_tests()\nuser: go\nassistant: "
    )
    assert tok.apply_chat_template([{"role": "user", "content": "go"}]) == "user: go\nassistant: "
